"""The device kernel (moelane.kernels.cuda, Triton): every pool kind against the float64 reference, and a pair's bits
the same alone as among other pairs. On a CUDA device where one is present; else in Triton's interpreter on the CPU
(a subprocess with TRITON_INTERPRET=1), where Triton is installed; else skipped with the reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moelane import kernels
from tests.kernels.helpers import random_pool, reference

ROOT = Path(__file__).resolve().parents[2]
SIZES = [(192, 9), (96, 5), (36, 3), (48, 1), (100, 4), (17, 6), (2048, 40)]


def triton_found() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def check_kernel(device: str) -> None:
    """Every kind and size: within the reference's bound, and each pair's row equal to the pair computed alone (and
    to the op's own entry point on a CUDA device: `kernels.gather_linear` dispatches there)."""
    from moelane.kernels import cuda

    for kind in kernels.KINDS:
        for n_in, n_out in SIZES:
            pool = random_pool(kind, 3, n_out, n_in, seed=n_in * 10 + n_out)
            g = torch.Generator().manual_seed(1)
            x = torch.randn(4, n_in, generator=g)
            rows, slots = torch.randint(0, 4, (11,), generator=g), torch.randint(0, 3, (11,), generator=g)
            on = pool.to(torch.device(device))
            y = cuda.gather_linear(x.to(device), rows.to(device), slots.to(device), on.data, on.scales).cpu()
            want, bound = reference(x, rows, slots, pool)
            assert y.shape == (11, n_out)
            assert torch.all((y.double() - want).abs() <= bound), (kind, n_in, (y.double() - want).abs().max())
            for p in (0, 5, 10):
                alone = cuda.gather_linear(x.to(device), rows[p : p + 1].to(device), slots[p : p + 1].to(device),
                                           on.data, on.scales).cpu()  # fmt: skip
                assert torch.equal(alone[0], y[p]), (kind, n_in, p)
            dense = kernels.Pool(on.kind, on.data[:1].contiguous(), None if on.scales is None else
                                 on.scales[:1].contiguous(), on.in_features)  # fmt: skip
            first = cuda.gather_linear(x.to(device), None, None, dense.data, dense.scales).cpu()
            assert torch.equal(first[rows[slots == 0]], y[slots == 0]) or not bool((slots == 0).any())
            if device != "cpu":
                assert torch.equal(kernels.gather_linear(x.to(device), rows.to(device), slots.to(device), on).cpu(), y)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_kernel_on_cuda() -> None:
    check_kernel("cuda")


@pytest.mark.skipif(torch.cuda.is_available() or not triton_found(), reason="needs Triton (interpreted on the CPU)")
def test_device_kernel_in_tritons_interpreter() -> None:
    code = "from tests.kernels.test_cuda_kernel import check_kernel; check_kernel('cpu')"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.skipif(not triton_found(), reason="needs Triton")
@pytest.mark.parametrize(("dtype", "group"), [("fp32", 1), ("bf16", 1), ("i8", 64), ("i8", 16), ("u8", 32)])
@pytest.mark.parametrize("indexed", [True, False])
def test_device_kernel_compiles_for_hopper_without_a_gpu(dtype: str, group: int, indexed: bool) -> None:
    """The kernel through Triton's real compiler (to PTX for sm_90), which the interpreter skips: names it cannot
    resolve, types it cannot lower."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moelane.kernels import cuda

    kernel = cuda._gather_linear_kernel
    kind = {"fp32": 0, "bf16": 0, "i8": 1, "u8": 2}[dtype]
    index = "*i64" if indexed else "*fp32"
    pointers = {"x_ptr": "*fp32", "rows_ptr": index, "slots_ptr": index, "data_ptr": f"*{dtype}",
                "scales_ptr": "*fp16" if kind else f"*{dtype}", "y_ptr": "*fp32"}  # fmt: skip
    consts = {"KIND": kind, "GROUP": group, "HAS_ROWS": indexed, "HAS_SLOTS": indexed, "BLOCK_O": cuda.BLOCK_OUT,
              "BLOCK_K": cuda.BLOCK_IN}  # fmt: skip
    signature = {name: pointers.get(name, "constexpr" if name in consts else "i32") for name in kernel.arg_names}
    source = ASTSource(kernel, signature, {(kernel.arg_names.index(k),): v for k, v in consts.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    assert "ld.global" in compiled.asm["ptx"]
