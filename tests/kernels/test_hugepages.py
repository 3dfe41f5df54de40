"""Weights every pass streams live in huge-page-advised memory (kernels/hugepages.py): the tensors hold what was
written, start on a 2 MiB boundary, their mapping is advised, and a model whose pools land there computes as
transformers does."""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import pytest
import torch

import moelane
from moelane import kernels
from moelane.kernels import hugepages
from moelane.model.provider import ResidentProvider
from tests.helpers import random_model

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
advisable = pytest.mark.skipif(
    not THP.exists() or not hasattr(mmap, "MADV_HUGEPAGE"), reason="no transparent huge pages on this system"
)


def vm_flags(address: int) -> set[str]:
    """The VmFlags of this process's mapping that holds `address`."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        if m := re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line):
            inside = int(m[1], 16) <= address < int(m[2], 16)
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@advisable
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.uint8])
def test_a_large_tensor_is_advised_aligned_and_holds_its_values(dtype: torch.dtype) -> None:
    shape = (3, 1000, 1001)  # (not a whole number of huge pages)
    t = hugepages.empty(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    assert "hg" in vm_flags(t.data_ptr())
    values = torch.randint(0, 100, shape).to(dtype)
    t.copy_(values)
    assert torch.equal(t, values)
    placed = hugepages.place(values)
    assert placed is not values and torch.equal(placed, values) and "hg" in vm_flags(placed.data_ptr())
    joined = hugepages.cat([values, placed[:, :7]], dim=1)
    assert torch.equal(joined, torch.cat([values, values[:, :7]], dim=1)) and "hg" in vm_flags(joined.data_ptr())


def test_small_tensors_stay_where_they_are() -> None:
    small = torch.randn(10, 10)
    assert hugepages.place(small) is small
    t = hugepages.empty((4, 5), torch.float32)
    assert t.shape == (4, 5) and t.is_contiguous()
    assert torch.equal(hugepages.cat([small, small[:, :3]], dim=1), torch.cat([small, small[:, :3]], dim=1))


@advisable
def test_a_placed_pool_computes_the_same_bits() -> None:
    pool = kernels.quantize(torch.randn(2, 4096, 256, generator=torch.Generator().manual_seed(0)), "int8")
    placed = hugepages.place_pool(pool)
    assert placed.data is not pool.data and placed.scales is pool.scales and placed.in_features == pool.in_features
    x, slots = torch.randn(3, 256), torch.tensor([1, 0, 1])
    rows = torch.arange(3)
    assert torch.equal(kernels.gather_linear(x, rows, slots, placed), kernels.gather_linear(x, rows, slots, pool))


@advisable
@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_a_model_with_large_pools_holds_them_advised_and_computes_the_same(
    tmp_path: Path, quantize: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    folder = random_model("qwen3_moe", tmp_path / "m", vocab_size=4096, hidden_size=256, moe_intermediate_size=512,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64)  # fmt: skip
    lm = moelane.load(folder, default_tier="native", quantize=quantize)
    provider = lm.provider
    assert isinstance(provider, ResidentProvider)
    for layer in (0, 2):  # (layer 1 is dense: mlp_only_layers)
        pool = provider.pools(layer)[0]
        assert pool.kernel is not None
        for part in pool.kernel:  # w13 (10 x 1024 x 256 float32: 10 MiB), w2
            assert "hg" in vm_flags(part.data.data_ptr())
    head = lm.model.lm_head.weight  # 4096 x 256: 4 MiB in float32, 1 MiB (a plain tensor) at int8
    assert isinstance(head, kernels.Pool)
    assert ("hg" in vm_flags(head.data.data_ptr())) == (quantize == "none")
    ids = torch.randint(0, 4096, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    got = lm.logits(ids)

    # the same model in ordinary memory: the same bits
    monkeypatch.setattr(hugepages, "empty", lambda shape, dtype: torch.empty(shape, dtype=dtype))
    monkeypatch.setattr(hugepages, "place", lambda t: t)
    plain = moelane.load(folder, default_tier="native", quantize=quantize)
    assert "hg" not in vm_flags(plain.provider.pools(0)[0].kernel[0].data.data_ptr())
    assert torch.equal(plain.logits(ids), got)
    if quantize == "none":
        ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager").eval()
        with torch.no_grad():
            torch.testing.assert_close(got, ref(torch.tensor([ids])).logits[0], rtol=1e-4, atol=1e-4)
