"""Every family against transformers on tiny random checkpoints: prefill logits, KV-cache decode, greedy generation.

Each case saves a random transformers model (odd sizes, GQA, top-k > 1, a dense layer where the family allows one),
loads it with `moelane.load`, and compares in fp32 (logits within 1e-4, greedy ids identical) and in bf16 (greedy ids
identical to transformers' bf16 run). The reference uses eager attention (sdpa rounds differently in bf16) and its
default grouped_mm experts, which need expert widths that are multiples of 8. Which layers are MoE is checked against
transformers' own placement in every case. Hub configs that leave keys out, or say more than transformers writes, are
checked by editing config.json; settings no family implements must be refused at load with one line.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import moelane
import moelane.model.load as load_module
from moelane.errors import ModelLoadError
from moelane.model.cache import Rows
from moelane.model.exported import AheadOrCompiled
from tests.helpers import OWN_CACHE_FAMILIES, random_model

N_PROMPT, N_DECODE, N_GREEDY, TOL = 37, 16, 32, 1e-4
NEAR_TIE = 1 / 64  # (of the largest logit: a few bf16 roundings, 2**-8 each)

# (case id, family, config overrides)
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("qwen3_moe", "qwen3_moe", {}),
    ("qwen3_moe-sparse_step-bias", "qwen3_moe", dict(
        norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=2, attention_bias=True)),
    ("qwen2_moe", "qwen2_moe", {}),
    ("qwen2_moe-norm-sparse_step", "qwen2_moe", dict(norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=2)),
    ("mixtral-window", "mixtral", dict(sliding_window=20)),
    ("olmoe", "olmoe", {}),
    ("olmoe-norm-clip-bias", "olmoe", dict(norm_topk_prob=True, clip_qkv=0.3, attention_bias=True)),
    ("deepseek_v2", "deepseek_v2", {}),
    ("deepseek_v2-group-qlora-yarn", "deepseek_v2", dict(
        topk_method="group_limited_greedy", n_group=4, topk_group=2, q_lora_rank=24, first_k_dense_replace=0,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
                             mscale=1.0, mscale_all_dim=0.8, beta_fast=32, beta_slow=1))),
    ("deepseek_v3", "deepseek_v3", {}),
    ("deepseek_v3-halves-qlora-yarn-8groups", "deepseek_v3", dict(
        rope_interleave=False, q_lora_rank=24, n_routed_experts=16, n_group=8, topk_group=3, num_experts_per_tok=4,
        norm_topk_prob=False, first_k_dense_replace=0,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
                             mscale=1.0, mscale_all_dim=0.8, beta_fast=32, beta_slow=1))),
    ("glm4_moe", "glm4_moe", {}),
    ("glm4_moe-groups-qknorm-scaled", "glm4_moe", dict(
        n_group=4, topk_group=2, use_qk_norm=True, routed_scaling_factor=2.5, norm_topk_prob=False,
        attention_bias=False, partial_rotary_factor=0.75, first_k_dense_replace=0)),
    ("gpt_oss", "gpt_oss", {}),
    # the clamps bite (a limit below the tiny model's activations), full attention first, no attention biases
    ("gpt_oss-clamped-fullfirst-nobias", "gpt_oss", dict(
        swiglu_limit=0.02, swiglu_alpha=1.2, attention_bias=False, num_hidden_layers=4, num_experts_per_tok=4,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters=dict(rope_type="yarn", rope_theta=5e4, factor=8.0, beta_fast=16.0, beta_slow=2.0,
                             truncate=True, original_max_position_embeddings=256))),
    ("lfm2_moe", "lfm2_moe", {}),
    ("lfm2_moe-attention-first-kernel4-bias-tied", "lfm2_moe", dict(
        layer_types=["full_attention", "conv", "full_attention", "conv"], conv_L_cache=4, conv_bias=True,
        use_expert_bias=False, norm_topk_prob=False, routed_scaling_factor=1.7, tie_word_embeddings=True,
        num_dense_layers=0)),
    ("ernie4_5_moe", "ernie4_5_moe", {}),
    ("ernie4_5_moe-noshared-bias-interval-tied", "ernie4_5_moe", dict(
        moe_num_shared_experts=0, use_bias=True, moe_layer_start_index=0, moe_layer_interval=2, num_hidden_layers=4,
        tie_word_embeddings=True)),
    ("hunyuan_v1_moe", "hunyuan_v1_moe", {}),
    ("hunyuan_v1_moe-bias-tied-alpharope-topklist", "hunyuan_v1_moe", dict(
        attention_bias=True, tie_word_embeddings=True, head_dim=12, moe_topk=[2, 2, 2], rope_parameters=dict(
            rope_type="dynamic", rope_theta=10000.0, factor=1.0, alpha=1000.0))),
    ("phimoe", "phimoe", {}),
    # the sparsemixer's mask wide, LongRoPE below its switch (128: beyond the greedy run's 69 positions)
    ("phimoe-bias-headbias-tied-window-longrope", "phimoe", dict(
        attention_bias=True, lm_head_bias=True, tie_word_embeddings=True, sliding_window=20, router_jitter_noise=0.2,
        input_jitter_noise=0.3, head_dim=12, rope_parameters=dict(
            rope_type="longrope", rope_theta=10000.0, short_factor=[1.0, 1.3, 1.9, 2.6, 4.0, 7.5],
            long_factor=[1.1, 2.0, 3.5, 6.0, 11.0, 23.0], short_mscale=1.2, long_mscale=1.45,
            original_max_position_embeddings=128))),
    ("granitemoe", "granitemoe", {}),
    ("granitemoe-bias-tied-linearrope-multipliers", "granitemoe", dict(
        attention_bias=True, tie_word_embeddings=True, embedding_multiplier=3.0, attention_multiplier=1.0,
        residual_multiplier=1.7, logits_scaling=0.5, rope_parameters=dict(rope_type="linear", rope_theta=1e6,
                                                                          factor=2.0))),
    ("granitemoeshared", "granitemoeshared", {}),
    ("granitemoeshared-bias-tied-yarn-multipliers", "granitemoeshared", dict(
        shared_intermediate_size=20, attention_bias=True, tie_word_embeddings=True, embedding_multiplier=0.5,
        attention_multiplier=0.25, residual_multiplier=1.3, logits_scaling=3.0, num_experts_per_tok=4,
        rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=128))),
    ("glm4_moe_lite", "glm4_moe_lite", {}),
    ("glm4_moe_lite-noqlora-bias-tied-halves-yarn-groups-layertypes", "glm4_moe_lite", dict(
        q_lora_rank=None, attention_bias=True, tie_word_embeddings=True, rope_interleave=False, n_group=6, topk_group=2,
        norm_topk_prob=False, routed_scaling_factor=2.5, n_shared_experts=2, num_hidden_layers=4,
        mlp_layer_types=["sparse", "dense", "sparse", "sparse"],
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
                             mscale=1.0, mscale_all_dim=0.8, beta_fast=32, beta_slow=1))),
    ("dots1", "dots1", {}),
    ("dots1-window-groups-bias-tied-yarn-noshared-allmoe", "dots1", dict(
        sliding_window=20, max_window_layers=1, n_group=4, topk_group=2, attention_bias=True, tie_word_embeddings=True,
        norm_topk_prob=False, routed_scaling_factor=1.0, n_shared_experts=0, first_k_dense_replace=0,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128))),
    ("minimax_m2", "minimax_m2", {}),
    ("minimax_m2-tied-wholehead-yarn", "minimax_m2", dict(
        tie_word_embeddings=True, head_dim=12, rotary_dim=None, num_experts_per_tok=4, rope_parameters=dict(
            rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=128))),
    ("exaone_moe", "exaone_moe", {}),
    # a global layer between sliding ones, a dense layer between MoE ones, expert groups, unnormalised scaled weights
    ("exaone_moe-layerlists-groups-scaled-tied-linearrope", "exaone_moe", dict(
        sliding_window=20, layer_types=["sliding_attention", "full_attention"] + ["sliding_attention"] * 2,
        mlp_layer_types=["sparse", "dense", "sparse", "sparse"], n_group=2, topk_group=1, norm_topk_prob=False,
        routed_scaling_factor=1.7, num_shared_experts=2, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0))),
    # chunks of 16 (the prompt and its decode cross three), a NoPE layer between rope layers, temperature from 8
    ("llama4", "llama4", {}),
    # Maverick's shape (dense layers between MoE ones, no q/k norm), Scout's rope scaling (a hard cut: low and high
    # frequency factors equal) from a short original length, so it bites; a rope layer with full attention
    # (`layer_types`), chunks of 8, a stronger temperature
    ("llama4-dense-bias-tied-llama3rope-layertypes", "llama4", dict(
        num_hidden_layers=4, interleave_moe_layer_step=2, use_qk_norm=False, attention_bias=True,
        tie_word_embeddings=True, head_dim=12, no_rope_layers=[1, 0, 1, 1], attention_chunk_size=8,
        layer_types=["chunked_attention", "full_attention", "full_attention", "chunked_attention"], floor_scale=4,
        attn_scale=0.3, rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=16.0, low_freq_factor=1.0,
                                             high_freq_factor=1.0, original_max_position_embeddings=64))),
    ("qwen3-tied-bias-window", "qwen3", dict(tie_word_embeddings=True, attention_bias=True, use_sliding_window=True,
                                             sliding_window=20, max_window_layers=1)),
    ("llama-bias-llama3rope", "llama", dict(attention_bias=True, mlp_bias=True, head_dim=12, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
]  # fmt: skip


def token_ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {}


def folder_for(folders: dict[str, Path], tmp: pytest.TempPathFactory, case: str, family: str, overrides: dict) -> Path:
    if case not in folders:
        folders[case] = random_model(family, tmp.mktemp(case), **overrides)
    return folders[case]


def reference(folder: Path, dtype: torch.dtype) -> Any:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, attn_implementation="eager")
    return model.eval()


@pytest.mark.parametrize(("case", "family", "overrides"), CASES, ids=[c[0] for c in CASES])
def test_fp32_matches_transformers(
    case: str, family: str, overrides: dict, folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = folder_for(folders, tmp_path_factory, case, family, overrides)
    ref, lm = reference(folder, torch.float32), moelane.load(folder)
    feed_forward = [getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None) or layer.feed_forward
                    for layer in ref.model.layers]  # (Granite's and LFM2's names)  # fmt: skip
    assert lm.model.moe_layers == [i for i, ff in enumerate(feed_forward) if hasattr(ff, "experts")]
    prompt = token_ids(N_PROMPT, lm.vocab_size, 1)
    more = token_ids(N_DECODE, lm.vocab_size, 2)
    cache = lm.new_cache(N_PROMPT + N_DECODE)
    with torch.no_grad():
        out = ref(torch.tensor([prompt]), use_cache=True)
        ours = lm.forward([Rows(cache, prompt, 0)])[0]
        assert (ours - out.logits[0]).abs().max().item() <= TOL
        ref_cache = out.past_key_values
        for i, tok in enumerate(more):
            out = ref(torch.tensor([[tok]]), cache=ref_cache, use_cache=True)
            ref_cache = out.past_key_values
            ours = lm.forward([Rows(cache, [tok], N_PROMPT + i)])[0]
            assert (ours - out.logits[0]).abs().max().item() <= TOL, f"decode step {i}"
    assert greedy(lm, prompt) == greedy_ref(ref, prompt)


def greedy(lm: Any, prompt: list[int]) -> list[int]:
    ids = list(lm.generate_ids(prompt, N_GREEDY, stop_ids=frozenset()))
    assert len(ids) == N_GREEDY
    return ids


def greedy_ref(ref: Any, prompt: list[int]) -> list[int]:
    ref.generation_config.eos_token_id = None  # a generation_config argument alone still stops at the saved EOS
    ids_t = torch.tensor([prompt])  # (with its mask said: else generate masks every token equal to pad_token_id)
    with torch.no_grad():
        out = ref.generate(ids_t, attention_mask=torch.ones_like(ids_t), do_sample=False, max_new_tokens=N_GREEDY,
                           pad_token_id=0)  # fmt: skip
    ids: list[int] = out[0, len(prompt) :].tolist()
    assert len(ids) == N_GREEDY
    return ids


@pytest.mark.parametrize(("case", "family", "overrides"), CASES, ids=[c[0] for c in CASES])
def test_bf16_greedy_matches_transformers(
    case: str, family: str, overrides: dict, folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """moelane's bf16 projections sum each row in their own fixed order (`model/weights.py`), oneDNN's in another, so
    a random model's near-ties may break the other way: the replies agree token for token up to the first difference,
    and there the reference itself scored moelane's token within bf16's rounding of its own."""
    folder = folder_for(folders, tmp_path_factory, case, family, overrides)
    ref, lm = reference(folder, torch.bfloat16), moelane.load(folder, dtype=torch.bfloat16)
    prompt = token_ids(N_PROMPT, lm.vocab_size, 1)
    ours, theirs = greedy(lm, prompt), greedy_ref(ref, prompt)
    if ours != theirs:
        at = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + theirs[:at]])).logits[0, -1].float()
        margin = (logits[theirs[at]] - logits[ours[at]]).item()
        assert margin <= NEAR_TIE * logits.abs().max().item(), f"token {at}: the reference preferred its by {margin}"


@pytest.mark.parametrize(("case", "family", "overrides"), CASES, ids=[c[0] for c in CASES])
def test_bf16_prefill_logits_are_transformers_bit_for_bit(
    case: str,
    family: str,
    overrides: dict,
    folders: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same roundings in the same places: the routed experts' outputs weighed in the dtype the reference's router
    gives its weights (fp32 for Mixtral, DeepSeek-V3, GLM, Hunyuan and MiniMax-M2, the model's for Qwen, OLMoE and
    ERNIE), then rounded once. Weighed in bf16 throughout, Mixtral's logits were off by up to 0.012; with DeepSeek-V2's
    router weight rounded to bf16 at load, or LFM2's short convolution summed in bf16 (F.conv1d sums in fp32 and rounds
    once), theirs were off by up to 0.016. The dense projections are left to the BLAS here, as the reference computes
    them: moelane's own bf16 products (`model/weights.py`) sum in another fixed order, so their bits differ from
    oneDNN's, and `test_bf16_greedy_matches_transformers` checks them."""
    monkeypatch.setattr(load_module, "prepare_weights", lambda model, quantize, progress, cache, device: 0)
    folder = folder_for(folders, tmp_path_factory, case, family, overrides)
    ref, lm = reference(folder, torch.bfloat16), moelane.load(folder, dtype=torch.bfloat16)
    prompt = token_ids(N_PROMPT, lm.vocab_size, 1)
    with torch.no_grad():
        assert torch.equal(lm.logits(prompt), ref(torch.tensor([prompt])).logits[0].float())


class Collect:
    def __init__(self) -> None:
        self.records: list[Any] = []

    def observe(self, record: Any) -> None:
        self.records.append(record)


def test_deepseek_norm_topk_prob_renormalises_instead_of_scaling(tmp_path: Path) -> None:
    """transformers ignores `norm_topk_prob` for deepseek_v2; DeepSeek's own code renormalises (and skips
    `routed_scaling_factor`) when it is set. Same experts either way; weights sum to 1 with it, and are 1.5x the
    top-k softmax scores without."""
    folder = random_model("deepseek_v2", tmp_path / "plain")
    normed = tmp_path / "normed"
    shutil.copytree(folder, normed)
    config = json.loads((normed / "config.json").read_text())
    (normed / "config.json").write_text(json.dumps({**config, "norm_topk_prob": True}))
    prompt = token_ids(N_PROMPT, 300, 1)
    routes = []
    for path in (folder, normed):
        lm, seen = moelane.load(path), Collect()
        lm.observers.append(seen)
        lm.logits(prompt)
        routes.append(seen.records[0])
    plain, norm = routes
    sums = norm.weights.sum(-1)
    torch.testing.assert_close(sums, torch.ones_like(sums))
    # The first MoE layer sees the same input in both runs (later ones see the first one's different output).
    assert torch.equal(plain.expert_ids[0], norm.expert_ids[0])
    torch.testing.assert_close(norm.weights[0] * plain.weights[0].sum(-1, keepdim=True), plain.weights[0])
    assert not torch.allclose(plain.weights[0].sum(-1), torch.ones_like(sums[0]))


def test_glm_router_stays_fp32_and_its_mtp_layer_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """GLM's router weight and score bias load in fp32 into a bf16 model, as the reference keeps them (the bias
    decides near-ties between experts); the checkpoint's multi-token-prediction layer (one past the decoder's) is
    skipped without a warning and changes nothing."""
    from safetensors.torch import load_file, save_file

    folder = random_model("glm4_moe", tmp_path / "glm")
    prompt = token_ids(N_PROMPT, 300, 1)
    plain = moelane.load(folder).logits(prompt)
    weights = load_file(folder / "model.safetensors")
    mtp = "model.layers.3."  # the layer after the decoder's three
    extra = {
        mtp + "eh_proj.weight": torch.randn(48, 96),
        mtp + "mlp.gate.weight": torch.randn(12, 48),
        mtp + "mlp.experts.0.gate_proj.weight": torch.randn(24, 48),
    }
    save_file({**weights, **extra}, folder / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("WARNING"):
        lm = moelane.load(folder)
    assert not caplog.records
    assert torch.equal(lm.logits(prompt), plain)
    bf16 = moelane.load(folder, dtype=torch.bfloat16)
    gate = bf16.model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(gate.weight, weights["model.layers.1.mlp.gate.weight"])
    assert torch.equal(gate.e_score_correction_bias, weights["model.layers.1.mlp.gate.e_score_correction_bias"])
    up = bf16.model.model.layers[1].mlp.shared_experts.up_proj.weight
    assert up.data.dtype == torch.bfloat16  # (a tensor, or a kernels Pool)


# Multi-token-prediction tensors as checkpoints carry them: (family, their names and shapes, config.json changes)
MTP = [
    # MiniMax-M2: `num_mtp_modules` layers after the decoder's, under Mixtral's names
    ("minimax_m2", {f"model.layers.{i}.{name}": shape for i in (3, 4) for name, shape in [
        ("self_attn.q_proj.weight", (96, 48)), ("block_sparse_moe.gate.weight", (10, 48)),
        ("block_sparse_moe.e_score_correction_bias", (10,)), ("block_sparse_moe.experts.0.w1.weight", (24, 48)),
    ]}, dict(num_mtp_modules=2, use_mtp=True)),
    # K-EXAONE: a module of its own (`mtp.*`)
    ("exaone_moe", {"mtp.fc.weight": (48, 96), "mtp.norm.weight": (48,),
                    "mtp.layers.0.mlp.experts.0.gate_proj.weight": (24, 48)}, {}),
]  # fmt: skip


@pytest.mark.parametrize(("family", "shapes", "changes"), MTP, ids=[c[0] for c in MTP])
def test_mtp_tensors_are_skipped(
    family: str, shapes: dict, changes: dict, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint's multi-token-prediction tensors, which plain decoding does not use, are skipped without a
    warning and change nothing."""
    from safetensors.torch import load_file, save_file

    folder = random_model(family, tmp_path / family)
    prompt = token_ids(N_PROMPT, 300, 1)
    plain = moelane.load(folder).logits(prompt)
    weights = load_file(folder / "model.safetensors") | {name: torch.randn(*shape) for name, shape in shapes.items()}
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("WARNING"):
        lm = moelane.load(edit_config(folder, **changes))
    assert not caplog.records
    assert torch.equal(lm.logits(prompt), plain)


def test_deepseek_moe_layer_placement() -> None:
    from moelane.model.families.deepseek_v2 import DeepseekV2Config
    from tests.helpers import FAMILY_CONFIGS

    config = {**FAMILY_CONFIGS["deepseek_v2"][2], "model_type": "deepseek_v2", "num_hidden_layers": 6,
              "n_routed_experts": 4, "first_k_dense_replace": 1, "moe_layer_freq": 2}  # fmt: skip
    assert DeepseekV2Config.from_dict(config).moe_layers() == [2, 4]
    assert DeepseekV2Config.from_dict({**config, "n_routed_experts": 0}).moe_layers() == []


@pytest.mark.parametrize("eps", [0.0, 0.01, 0.2])
def test_phimoe_sparsemixer_routes_as_transformers_does(eps: float) -> None:
    """Both experts and both weights, bit for bit, against transformers' sparsemixer at inference (ties included:
    logits rounded to a coarse grid), in fp32 and bf16."""
    from transformers.models.phimoe.modeling_phimoe import sparsemixer as reference_sparsemixer

    from moelane.model.families.phimoe import sparsemixer

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.cat([torch.randn(64, 10, generator=g), (torch.randn(64, 10, generator=g) * 4).round() / 4])
        logits = logits.to(dtype)
        want_weights, want_ids = reference_sparsemixer(logits, jitter_eps=eps, training=False)
        weights, ids = sparsemixer(logits, eps)
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)


def test_longrope_turns_each_position_by_its_own_factors() -> None:
    """LongRoPE per position: below `original_max_position_embeddings` the short factors and scale, from it on the
    long ones (transformers' frequency sets for a sequence below and above the switch; its attention factor)."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from moelane.model.rope import Rope, rope_parameters

    rope_config = dict(rope_type="longrope", rope_theta=1e4, short_factor=[1.0, 1.5, 2.5, 5.0],
                       long_factor=[1.2, 3.0, 8.0, 20.0], original_max_position_embeddings=16)  # fmt: skip
    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, max_position_embeddings=256,
                                      rope_parameters=rope_config)  # fmt: skip
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](config)
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=17)
    assert not torch.allclose(short, long)
    rope = Rope.build(rope_parameters(config.to_dict()), 8, 256)
    positions = torch.arange(40)
    cos, sin = rope.cos_sin(positions, torch.float32)
    for inv, at in ((short, positions < 16), (long, positions >= 16)):
        angles = positions[at].float()[:, None] * inv[None]
        torch.testing.assert_close(cos[at], torch.cat([angles, angles], -1).cos() * factor, rtol=0, atol=1e-6)
        torch.testing.assert_close(sin[at], torch.cat([angles, angles], -1).sin() * factor, rtol=0, atol=1e-6)


def test_phimoe_decodes_across_the_longrope_switch_as_it_prefills(tmp_path: Path) -> None:
    """Past `original_max_position_embeddings` a token-by-token decode through the KV cache gives the logits of one
    whole prefill (each position keeps its own factors), and the long factors and `long_mscale` are in use there."""
    rope = dict(rope_type="longrope", rope_theta=1e4, short_factor=[1.0, 1.3, 1.9, 2.6],
                long_factor=[1.1, 2.0, 3.5, 6.0], short_mscale=1.2, long_mscale=1.45,
                original_max_position_embeddings=16)  # fmt: skip
    folder = random_model("phimoe", tmp_path / "long", rope_parameters=rope)
    lm, ids = moelane.load(folder), token_ids(30, 300, 1)
    whole = lm.logits(ids)
    cache = lm.new_cache(len(ids))
    with torch.no_grad():
        steps = [lm.forward([Rows(cache, ids[:8], 0)])[0]]
        steps += [lm.forward([Rows(cache, [tok], 8 + i)])[0] for i, tok in enumerate(ids[8:])]
    assert (torch.cat(steps) - whole).abs().max().item() <= TOL
    short = moelane.load(edit_config(folder, rope_parameters={**rope, "long_factor": rope["short_factor"],
                                                              "long_mscale": 1.2}))  # fmt: skip
    assert torch.equal(short.logits(ids)[:16], whole[:16])
    assert not torch.allclose(short.logits(ids)[16:], whole[16:])


LONGROPE = dict(rope_type="longrope", rope_theta=1e4, short_factor=[1.0] * 4, long_factor=[1.0] * 4)  # head dim 8


@pytest.mark.parametrize(
    ("family", "config", "message"),
    [
        ("deepseek_v2", dict(topk_method="noaux_tc"), "unsupported topk_method 'noaux_tc'"),
        ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=3, topk_group=2), "n_group dividing 8"),
        ("deepseek_v2", dict(num_key_value_heads=2), "MLA needs num_key_value_heads"),
        ("qwen3", dict(use_sliding_window=True, sliding_window=16, layer_types=None), "has no layer_types"),
        ("llama", dict(rope_parameters=dict(rope_type="proportional", rope_theta=1e4)), "unsupported rope scaling"),
        ("llama", dict(rope_parameters=dict(LONGROPE, long_factor=None)), "longrope needs long_factor: 4 positive"),
        ("llama", dict(rope_parameters=dict(LONGROPE, short_factor=[1.0] * 3)), "needs short_factor: 4 positive"),
        ("llama", dict(rope_parameters=dict(rope_type="default", rope_theta=0)), "bad rope parameters"),
        ("qwen3_moe", dict(use_sliding_window=True, sliding_window=16), "use_sliding_window is not supported"),
        ("mixtral", dict(sliding_window=-5), "sliding_window must be a positive number"),
        ("deepseek_v3", dict(topk_method="greedy"), "routes with topk_method 'noaux_tc', got 'greedy'"),
        ("deepseek_v3", dict(n_group=8, topk_group=2), "into groups of 2 or more"),
        ("glm4_moe", dict(n_group=5, topk_group=2), "n_group dividing the 12 experts"),
        ("glm4_moe", dict(n_group=4, topk_group=5), "1 <= topk_group <= n_group"),
        ("glm4_moe", dict(n_group=4, topk_group=1, num_experts_per_tok=4), "exceeds the experts of the 1 groups"),
        ("glm4_moe", dict(partial_rotary_factor=0.1), "partial_rotary_factor gives 1 rotary dims"),
        ("gpt_oss", dict(layer_types=["full_attention"]), "has 1 layer_types for 3 layers"),
        ("gpt_oss", dict(sliding_window=0.5), "sliding_window must be a positive number"),
        ("gpt_oss", dict(num_local_experts=0), "gpt_oss needs num_local_experts >= 1"),
        ("lfm2_moe", dict(layer_types=["conv"] * 3), "lfm2_moe needs layer_types, one per layer (4)"),
        ("lfm2_moe", dict(layer_types=["conv", "mamba", "conv", "conv"]), "unknown layer_types ['mamba']"),
        ("ernie4_5_moe", dict(moe_layer_interval=0), "moe_layer_interval must be a whole number >= 1, got 0"),
        ("hunyuan_v1_moe", dict(moe_topk=[3, 2, 3]), "per-layer moe_topk that differ is not supported"),
        ("hunyuan_v1_moe", dict(use_cla=True), "hunyuan_v1_moe with use_cla, mlp_bias or no use_qk_norm"),
        ("hunyuan_v1_moe", dict(num_shared_expert=[2, 2, 2]), "needs one shared MLP"),
        ("hunyuan_v1_moe", dict(moe_intermediate_size=16), "needs moe_intermediate_size == intermediate_size"),
        ("phimoe", dict(num_experts_per_tok=3), "phimoe routes with sparsemixer, which picks 2 experts"),
        ("phimoe", dict(rope_parameters=dict(LONGROPE, rope_type="yarn", factor=2.0)), "rope scaling 'yarn' is not"),
        ("phimoe", dict(rope_parameters=dict(LONGROPE, short_mscale=1.1)), "needs short_mscale and long_mscale, got"),
        ("phimoe", dict(partial_rotary_factor=0.5), "phimoe with partial_rotary_factor is not supported"),
        ("phimoe", dict(num_local_experts=0), "phimoe needs num_local_experts >= 2"),
        ("granitemoe", dict(num_local_experts=0), "granitemoe needs num_local_experts >= 1"),
        ("granitemoe", dict(logits_scaling=0), "granitemoe needs logits_scaling != 0"),
        ("granitemoeshared", dict(shared_intermediate_size=-4), "shared_intermediate_size a whole number >= 0"),
        ("granitemoeshared", dict(logits_scaling=0), "granitemoeshared needs logits_scaling != 0"),
        ("glm4_moe_lite", dict(partial_rotary_factor=0.5), "turns all qk_rope_head_dim dims, got partial_rotary_f"),
        ("glm4_moe_lite", dict(mlp_bias=True), "glm4_moe_lite with mlp_bias is not supported"),
        ("glm4_moe_lite", dict(topk_method="greedy"), "glm4_moe_lite routes with topk_method 'noaux_tc', got 'greedy'"),
        ("glm4_moe_lite", dict(mlp_layer_types=["dense", "sparse"]), "mlp_layer_types 'dense' or 'sparse', one per"),
        ("glm4_moe_lite", dict(mlp_layer_types=["dense", "moe", "sparse"]), "mlp_layer_types 'dense' or 'sparse'"),
        ("glm4_moe_lite", dict(first_k_dense_replace=2), "first_k_dense_replace 2 contradicts mlp_layer_types"),
        ("glm4_moe_lite", dict(num_key_value_heads=2), "MLA needs num_key_value_heads"),
        ("dots1", dict(n_shared_experts=None), "dots1 needs n_shared_experts"),
        ("dots1", dict(moe_layer_freq=2), "dots1 has MoE in every layer from first_k_dense_replace, got moe_layer_f"),
        ("dots1", dict(scoring_func="softmax"), "dots1 routes with sigmoid scores and topk_method 'noaux_tc', got"),
        ("dots1", dict(topk_method="greedy"), "topk_method 'greedy'"),
        ("dots1", dict(layer_types=["full_attention"] * 2), "dots1 needs layer_types 'full_attention' or 'sliding"),
        ("dots1", dict(sliding_window=0, max_window_layers=1), "sliding_window must be a positive number"),
        ("dots1", dict(sliding_window=8, max_window_layers=1, use_sliding_window=False), "use_sliding_window false"),
        ("dots1", dict(n_group=5, topk_group=2), "n_group dividing the 12 experts"),
        ("minimax_m2", dict(qk_norm_type="per_head"), "minimax_m2 needs q/k norms over the whole projection"),
        ("minimax_m2", dict(use_qk_norm=False), "minimax_m2 needs q/k norms over the whole projection"),
        ("minimax_m2", dict(scoring_func="softmax"), "minimax_m2 routes by sigmoid scores with a routing bias"),
        ("minimax_m2", dict(use_routing_bias=False), "minimax_m2 routes by sigmoid scores with a routing bias"),
        ("minimax_m2", dict(shared_intermediate_size=24), "minimax_m2 with shared experts"),
        ("minimax_m2", dict(attn_type_list=[0, 1, 1]), "or lightning-attention layers (attn_type_list 0)"),
        ("minimax_m2", dict(rotary_dim=3), "minimax_m2 rotates 3 dims of a head's 16"),
        ("exaone_moe", dict(sliding_window_pattern="LLLG"), "exaone_moe without layer_types needs a whole-number"),
        ("exaone_moe", dict(layer_types=["sliding_attention"] * 3), "needs layer_types, one of ('sliding_attention'"),
        ("exaone_moe", dict(mlp_layer_types=["dense", "moe", "sparse", "sparse"]), "needs mlp_layer_types, one of"),
        ("exaone_moe", dict(sliding_window=None), "sliding_window must be a positive number of positions, got None"),
        ("exaone_moe", dict(n_group=3), "n_group dividing the 10 experts"),
        ("llama4", dict(no_rope_layers=[1, 0]), "llama4 needs no_rope_layers for each of its 3 layers, got 2"),
        ("llama4", dict(layer_types=["full_attention", "sliding_attention", "full_attention"]), "one per layer (3)"),
        ("llama4", dict(attention_chunk_size=None, layer_types=["chunked_attention"] * 3), "need an attention_chunk"),
        ("llama4", dict(attention_chunk_size=0), "llama4 attention_chunk_size must be a whole number >= 1, got 0"),
        ("llama4", dict(interleave_moe_layer_step=0), "interleave_moe_layer_step must be a whole number >= 1, got 0"),
        ("llama4", dict(no_rope_layer_interval=0), "no_rope_layer_interval must be a whole number >= 1, got 0"),
        ("llama4", dict(num_local_experts=0), "llama4 needs num_local_experts >= 1 for its MoE layers"),
    ],
)
def test_bad_configs_raise_model_load_error(family: str, config: dict, message: str) -> None:
    from moelane.model.family import family_of
    from tests.helpers import FAMILY_CONFIGS

    kind = family_of(family)
    with pytest.raises(ModelLoadError, match=re.escape(message)):  # (as `load` reads a config, then builds)
        kind.build(kind.config_class.from_dict({**FAMILY_CONFIGS[family][2], "model_type": family, **config}))


def edit_config(folder: Path, **changes: Any) -> Path:
    """Rewrite config.json as hub configs have it: keys changed, or left out where a change is None."""
    config = {**json.loads((folder / "config.json").read_text()), **changes}
    kept = {k: v for k, v in config.items() if k not in changes or v is not None}
    (folder / "config.json").write_text(json.dumps(kept))
    return folder


# Hub configs that leave keys out or say more than transformers writes: (case id, family, config.json changes)
EDITED: list[tuple[str, str, dict[str, Any]]] = [
    ("mixtral-no-rope_theta", "mixtral", dict(rope_parameters=None)),  # Mixtral's default theta is 1e6, not 1e4
    ("deepseek_v2-no-n_shared_experts", "deepseek_v2", dict(n_shared_experts=None)),  # default 2, not none
    ("llama-sliding_window", "llama", dict(sliding_window=7)),  # Llama has no window, whatever the config says
    ("qwen3-sliding_window-no-flag", "qwen3", dict(sliding_window=7, use_sliding_window=None, layer_types=None)),
    ("qwen3_moe-tied-with-own-head", "qwen3_moe", dict(tie_word_embeddings=True)),  # the checkpoint's head is used
    # GLM's hub configs keep rope_theta and partial_rotary_factor at the top level; without it, half the head turns
    ("glm4_moe-top-level-rope", "glm4_moe", dict(rope_parameters=None, rope_theta=5e4, partial_rotary_factor=0.75)),
    ("glm4_moe-no-partial_rotary_factor", "glm4_moe", dict(rope_parameters=dict(rope_theta=1e4, rope_type="default"))),
    # gpt-oss without rope keys: YaRN x32 from 4,096 positions at theta 150,000; without layer_types, even layers slide
    ("gpt_oss-no-rope-no-layer_types", "gpt_oss", dict(rope_parameters=None, layer_types=None)),
    # dynamic NTK scaling moves the frequencies only past max_position_embeddings, where moelane's context ends
    ("qwen3_moe-dynamic-rope", "qwen3_moe", dict(rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=4))),
    # a top-level original_max_position_embeddings (Phi-3's place for it) wins over the scaling's own
    ("llama-yarn-top-level-original-length", "llama", dict(max_position_embeddings=4096,
        original_max_position_embeddings=16, rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0,
                                                                  original_max_position_embeddings=1024))),
    ("mixtral-llama3-top-level-original-length", "mixtral", dict(original_max_position_embeddings=16,
        rope_parameters=dict(rope_type="llama3", rope_theta=1e4, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=2048))),
    # LongRoPE as dense Phi-3-style Llama checkpoints have it: the attention factor from the context's growth (x32)
    ("llama-longrope-top-level-original-length", "llama", dict(max_position_embeddings=4096,
        original_max_position_embeddings=128, rope_parameters=dict(rope_type="longrope", rope_theta=1e4,
                                                                   short_factor=[1.0, 1.5, 2.5, 5.0],
                                                                   long_factor=[1.2, 3.0, 8.0, 20.0]))),
    # Phi-3.5-MoE's config.json: `rope_scaling` with `type`, the original length also at the top level; no
    # router_jitter_noise (transformers' 0.01)
    ("phimoe-hub-rope_scaling", "phimoe", dict(rope_parameters=None, rope_theta=1e4, router_jitter_noise=None,
        original_max_position_embeddings=256, rope_scaling=dict(type="longrope", short_factor=[1.0, 1.2, 2.0, 3.1],
            long_factor=[1.5, 2.5, 6.0, 9.0], short_mscale=1.3, long_mscale=1.1,
            original_max_position_embeddings=256))),
    # Granite without its multipliers: all 1, the softmax scale too (not 1/sqrt(head_dim))
    ("granitemoe-no-multipliers", "granitemoe", dict(embedding_multiplier=None, attention_multiplier=None,
                                                     residual_multiplier=None, logits_scaling=None)),
    # without shared_intermediate_size, no shared MLP (transformers' default 0): the checkpoint's is left unused
    ("granitemoeshared-no-shared_intermediate_size", "granitemoeshared", dict(shared_intermediate_size=None)),
    # GLM-4.7-Flash's hub keys (no mlp_layer_types: its first layer dense) and transformers' defaults for the rest
    ("glm4_moe_lite-hub-keys-defaults", "glm4_moe_lite", dict(mlp_layer_types=None, first_k_dense_replace=1,
        topk_method="noaux_tc", num_nextn_predict_layers=1, rope_parameters=None, rope_theta=1e6,
        partial_rotary_factor=1.0, routed_scaling_factor=None, norm_topk_prob=None, n_shared_experts=None,
        n_group=None, topk_group=None, rope_interleave=None, rms_norm_eps=None)),
    # dots.llm1's hub keys (no window, no layer_types; routing keys transformers does not read) and its defaults
    ("dots1-hub-keys-defaults", "dots1", dict(layer_types=None, sliding_window=None, max_window_layers=62,
        use_sliding_window=False, moe_layer_freq=1, scoring_func="sigmoid", topk_method="noaux_tc",
        rope_parameters=None, rope_theta=1e7, n_group=None, topk_group=None, rms_norm_eps=None,
        attention_bias=None, norm_topk_prob=None, routed_scaling_factor=None)),
    # no layer_types: the layers from max_window_layers on slide, as transformers derives them
    ("dots1-window-by-max_window_layers", "dots1", dict(layer_types=None, sliding_window=8, max_window_layers=1)),
    # MiniMax-M2's released configs: the rotary dims as `rotary_dim`, theta at the top level (default 5e6), and keys
    # of MiniMax's own code that say what transformers computes anyway
    ("minimax_m2-released-config", "minimax_m2", dict(rope_parameters=None, rotary_dim=4, rope_theta=None,
        qk_norm_type="per_layer", use_qk_norm=True, scoring_func="sigmoid", use_routing_bias=True,
        shared_intermediate_size=0, attn_type_list=[1, 1, 1], use_mtp=True, num_mtp_modules=3)),
    # K-EXAONE without the per-layer lists or the keys they come from (a global layer every 4th, a dense one first),
    # nor its routing keys (a scale of 2.5, renormalised, one group, one shared expert)
    ("exaone_moe-defaults", "exaone_moe", dict(layer_types=None, mlp_layer_types=None, sliding_window_pattern=None,
        first_k_dense_replace=None, routed_scaling_factor=None, norm_topk_prob=None, n_group=None, topk_group=None,
        num_shared_experts=None)),
]  # fmt: skip


@pytest.mark.parametrize(("case", "family", "changes"), EDITED, ids=[c[0] for c in EDITED])
def test_edited_configs_read_as_transformers_reads_them(case: str, family: str, changes: dict, tmp_path: Path) -> None:
    folder = edit_config(random_model(family, tmp_path), **changes)
    ref, lm = reference(folder, torch.float32), moelane.load(folder)
    prompt = token_ids(N_PROMPT, lm.vocab_size, 1)
    with torch.no_grad():
        assert (lm.logits(prompt) - ref(torch.tensor([prompt])).logits[0]).abs().max().item() <= TOL


def test_llama4_release_serves_its_language_model(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A Llama 4 release's layout (`model_type` "llama4", the text model's config under `text_config`, its tensors
    under `language_model.` beside the vision tower's) gives the logits of the release's language model in
    transformers (its Llama4ForConditionalGeneration fails on text alone in 5.24, reading `image_outputs` from an
    output that has none); the image side is skipped without a word, and a quantization_config beside `text_config`
    (the FP8 release's) is refused as anywhere."""
    import transformers

    from tests.helpers import FAMILY_CONFIGS, save_model

    torch.manual_seed(0)
    text = FAMILY_CONFIGS["llama4"][2]
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)  # fmt: skip
    config = transformers.Llama4Config(text_config=text, vision_config=vision)
    model = transformers.Llama4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    folder = save_model(model, tmp_path / "release", text["vocab_size"])
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama4"
    with caplog.at_level("WARNING"):
        lm = moelane.load(folder)
    assert not caplog.records
    prompt = token_ids(N_PROMPT, lm.vocab_size, 1)
    with torch.no_grad():
        want = model.language_model(input_ids=torch.tensor([prompt])).logits[0]
        assert (lm.logits(prompt) - want).abs().max().item() <= TOL
    edit_config(folder, quantization_config=dict(quant_method="compressed-tensors"))
    with pytest.raises(ModelLoadError, match="quantized checkpoints are not supported"):
        moelane.load(folder)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_llama4_chunks_go_by_each_rows_own_position(
    compiled: bool, folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Chunked attention and the NoPE layers' temperature go by each row's position, wherever the row sits in a
    pass: a prompt fed in parts that straddle the chunks' bounds, beside another stream at other positions, then
    decoded one row and three rows at a time beside it (through the compiled step's pooled caches when `compiled`),
    gives transformers' logits for the whole sequence in one go."""
    case = next(c for c in CASES if c[0] == "llama4-dense-bias-tied-llama3rope-layertypes")
    folder = folder_for(folders, tmp_path_factory, *case)
    ref, lm = reference(folder, torch.float32), moelane.load(folder, compile=compiled)
    ids, other = token_ids(N_PROMPT + N_DECODE, lm.vocab_size, 1), token_ids(60, lm.vocab_size, 3)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    cache, beside = lm.new_cache(64), lm.new_cache(64)
    lm.forward([Rows(beside, other[:11], 0)])
    got, start = [], 0
    for n, decode in [(5, False), (7, False), (9, False), (16, False), (1, True), (1, True), (3, True), (1, True)]:
        rows = [Rows(cache, ids[start : start + n], start, decode=decode),
                Rows(beside, [other[11 + start]], 11 + start, decode=decode)]  # fmt: skip
        got.append(lm.forward(rows)[0])
        start += n
    assert (torch.cat(got) - want[:start]).abs().max().item() <= TOL


def test_gpt_oss_without_sliding_window_slides_over_128_positions(tmp_path: Path) -> None:
    """transformers' default window; a config without the key attended to everything (seen past 128 tokens)."""
    folder = edit_config(random_model("gpt_oss", tmp_path), sliding_window=None)
    ref, lm = reference(folder, torch.float32), moelane.load(folder)
    prompt = token_ids(160, lm.vocab_size, 1)
    with torch.no_grad():
        assert (lm.logits(prompt) - ref(torch.tensor([prompt])).logits[0]).abs().max().item() <= TOL


def test_expert_widths_are_read_only_where_there_are_experts(tmp_path: Path) -> None:
    """A config that leaves out the experts' width loads when no layer is MoE (as transformers does), and is
    refused in one line when one is (it was a KeyError from the expert shape check)."""
    dense = edit_config(random_model("qwen3_moe", tmp_path / "dense", mlp_only_layers=[0, 1, 2]),
                        moe_intermediate_size=None)  # fmt: skip
    ref, lm = reference(dense, torch.float32), moelane.load(dense)
    prompt = token_ids(N_PROMPT, lm.vocab_size, 1)
    with torch.no_grad():
        assert (lm.logits(prompt) - ref(torch.tensor([prompt])).logits[0]).abs().max().item() <= TOL
    moe = edit_config(random_model("qwen3_moe", tmp_path / "moe"), moe_intermediate_size=None)
    with pytest.raises(ModelLoadError, match="missing or has a bad value for 'moe_intermediate_size'"):
        moelane.load(moe)


def test_dots1_null_groups_read_as_no_group_limit(tmp_path: Path) -> None:
    """dots.llm1 configs may say `n_group: null, topk_group: null`, on which transformers 5.24 fails: moelane reads
    them as no group limit, the logits of transformers' `n_group: 1`."""
    folder = random_model("dots1", tmp_path)
    ref = reference(folder, torch.float32)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_group": None, "topk_group": None}))
    lm = moelane.load(folder)
    prompt = token_ids(N_PROMPT, lm.vocab_size, 1)
    with torch.no_grad():
        assert (lm.logits(prompt) - ref(torch.tensor([prompt])).logits[0]).abs().max().item() <= TOL


def test_deepseek_v3_defaults_are_transformers_defaults(tmp_path: Path) -> None:
    """A DeepSeek-V3 config that leaves its routing keys out: 8 groups keeping 4, a scale of 2.5, renormalised
    weights, rotary dims in interleaved pairs, as transformers reads it."""
    defaults = dict(n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True)
    folder = random_model("deepseek_v3", tmp_path, n_routed_experts=16, num_experts_per_tok=4, **defaults)
    edit_config(folder, **dict.fromkeys(defaults))
    assert not set(defaults) & set(json.loads((folder / "config.json").read_text()))
    ref, lm = reference(folder, torch.float32), moelane.load(folder)
    prompt = token_ids(N_PROMPT, lm.vocab_size, 1)
    with torch.no_grad():
        assert (lm.logits(prompt) - ref(torch.tensor([prompt])).logits[0]).abs().max().item() <= TOL


def test_auto_dtype_is_the_checkpoints_own(tmp_path: Path) -> None:
    """`dtype="auto"` (the command line's default) computes in bfloat16 for a checkpoint saved in bfloat16
    (config.json's `dtype`, or `torch_dtype` as transformers 4 wrote it) and in float32 otherwise, float16 included;
    `moelane_compute_dtype` overrides both, as the shipped models' configs do (stored in bf16, run in fp32)."""
    from moelane.commands import build_parser

    folder = random_model("qwen3_moe", tmp_path)
    for key, saved, want in [("dtype", "bfloat16", torch.bfloat16), ("torch_dtype", "bfloat16", torch.bfloat16),
                             ("dtype", "float16", torch.float32), ("dtype", "float32", torch.float32),
                             ("dtype", None, torch.float32)]:  # fmt: skip
        edit_config(folder, dtype=None, torch_dtype=None)
        edit_config(folder, **{key: saved})
        assert moelane.load(folder, "auto").dtype == want, (key, saved)
    edit_config(folder, dtype="bfloat16", moelane_compute_dtype="float32")
    assert moelane.load(folder, "auto").dtype == torch.float32
    assert moelane.load(None, "auto").dtype == torch.float32  # the shipped model
    assert moelane.load(folder).dtype == torch.float32  # the library's default stays float32
    assert build_parser().parse_args(["run", "hi"]).dtype == "auto"
    with pytest.raises(ValueError, match=re.escape("dtype must be a torch.dtype or 'auto'")):
        moelane.load(folder, "half")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(hidden_act="gelu"), "unsupported hidden_act 'gelu'"),
        (dict(num_experts_per_tok=0), "num_experts_per_tok must be 1 to the 10 experts, got 0"),
        (dict(num_experts_per_tok=11), "num_experts_per_tok must be 1 to the 10 experts, got 11"),
        (dict(num_experts_per_tok=None), "num_experts_per_tok must be 1 to the 10 experts, got None"),
        (dict(num_experts=None, num_local_experts=None), "missing or has a bad value for 'num_experts'"),
        (dict(num_hidden_layers=0), "num_hidden_layers must be a whole number >= 1, got 0"),
        (dict(max_position_embeddings=0), "max_position_embeddings must be a whole number >= 1, got 0"),
        (dict(hidden_size="64"), "hidden_size must be a whole number >= 1, got '64'"),
        (dict(quantization_config=dict(quant_method="fp8", fmt="e4m3")), "fp8 checkpoints are read with e4m3 weights"),
        (
            dict(
                quantization_config=dict(quant_method="fp8", weight_block_size=[128, 128], activation_scheme="static")
            ),
            "in blocks of scales only",
        ),
        (dict(quantization_config=dict(quant_method="gptq", bits=4)), "quantized checkpoints are not supported"),
    ],
)
def test_unservable_configs_are_refused_at_load(changes: dict, message: str, tmp_path: Path) -> None:
    """Settings no family implements fail at load with one line, not with wrong logits or a traceback at the first
    pass."""
    folder = edit_config(random_model("qwen3_moe", tmp_path), **changes)
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        moelane.load(folder)


COMPILED = [c for c in CASES if c[0] in ("qwen2_moe-norm-sparse_step",
                                         "mixtral-window",
                                         "olmoe-norm-clip-bias",
                                         "deepseek_v2-group-qlora-yarn",
                                         "deepseek_v3-halves-qlora-yarn-8groups",
                                         "glm4_moe-groups-qknorm-scaled",
                                         "gpt_oss-clamped-fullfirst-nobias",
                                         "lfm2_moe-attention-first-kernel4-bias-tied",
                                         "ernie4_5_moe-noshared-bias-interval-tied",
                                         "hunyuan_v1_moe-bias-tied-alpharope-topklist",
                                         "phimoe-bias-headbias-tied-window-longrope",
                                         "granitemoe-bias-tied-linearrope-multipliers",
                                         "granitemoeshared-bias-tied-yarn-multipliers",
                                         "glm4_moe_lite-noqlora-bias-tied-halves-yarn-groups-layertypes",
                                         "dots1-window-groups-bias-tied-yarn-noshared-allmoe",
                                         "minimax_m2-tied-wholehead-yarn",
                                         "exaone_moe-layerlists-groups-scaled-tied-linearrope",
                                         "llama4-dense-bias-tied-llama3rope-layertypes",
                                         "qwen3-tied-bias-window",
                                         "llama-bias-llama3rope")]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("case", "family", "overrides"), COMPILED, ids=[c[0] for c in COMPILED])
def test_compiled_decode_matches_eager(
    case: str, family: str, overrides: dict, folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The decode step compiles whole (exported, and compiled ahead of time) for every family and decodes the same
    tokens as eager; in OWN_CACHE_FAMILIES, rows of two cache capacities in one call (each pool's rows attend apart)
    are the bits of each stream's call alone. (That second build costs as much as the first, ~30-60 s of AOT compiling
    on 2 cores; test_core.py and test_exported.py hold the default model's compiled rows, plain grouped KV, to it.)"""
    folder = folder_for(folders, tmp_path_factory, case, family, overrides)
    lm = moelane.load(folder)
    prompt = token_ids(N_PROMPT, lm.vocab_size, 1)
    eager = greedy(lm, prompt)
    lm.enable_compile()
    assert greedy(lm, prompt) == eager
    assert isinstance(lm._compiled, AheadOrCompiled) and lm._compiled.exported is not None  # (exported, no fallback)
    if family not in OWN_CACHE_FAMILIES:
        return
    caches = [lm.new_cache(64), lm.new_cache(128)]
    for cache in caches:
        lm.forward([Rows(cache, prompt, 0)])
    rows = [Rows(caches[0], [5], len(prompt), decode=True), Rows(caches[1], [6, 7], len(prompt), decode=True)]
    together = lm.forward(rows)
    alone = [lm.forward([row])[0] for row in rows]
    assert all(torch.equal(a, b) for a, b in zip(together, alone, strict=True))
