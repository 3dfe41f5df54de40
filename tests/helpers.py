"""Test helpers: tiny random models of every family, built with transformers and saved as users have them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

TEXT = (
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
    "To be, or not to be, that is the question. The quick brown fox jumps over the lazy dog.\n"
)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE of exactly `vocab_size` ids (the last one is the EOS token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([TEXT] * 4, trainer)
    tok.add_special_tokens(["<|endoftext|>"])
    assert tok.get_vocab_size() <= vocab_size
    tok.save(str(folder / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    cfg = {"eos_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))


def save_model(model: Any, folder: Path, vocab_size: int, **kwargs: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), **kwargs)
    write_tokenizer(folder, vocab_size)
    return folder


def random_model(family: str, folder: Path, seed: int = 0, **overrides: Any) -> Path:
    """Build a tiny random model of `family` with transformers, save it with its tokenizer, return the folder."""
    import transformers

    torch.manual_seed(seed)
    cfg_cls, model_cls, base = FAMILY_CONFIGS[family]
    params = {**base, **overrides}
    config = getattr(transformers, cfg_cls)(**params)
    model = getattr(transformers, model_cls)(config).eval()
    # Random init leaves norms at 1 and routers near-uniform; perturb so every weight matters.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        for name, b in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):  # router biases: enough to change choices
                b.add_(torch.randn_like(b) * 0.05)
        for name, p in model.named_parameters():
            if name.endswith(".sinks"):  # gpt-oss's sink logits: big enough to take a share of every softmax
                p.add_(torch.randn_like(p))
    return save_model(model, folder, params["vocab_size"])


# Families whose attention reads its cache otherwise than plain grouped KV (sliding windows, sinks, latent attention,
# convolution states, chunks). Plain grouped KV reads its cache by the same code in every family, so the costlier
# family matrices (tests/conftest.py's fast fp32 parity, test_families.py's two-capacity compiled step) run for these.
OWN_CACHE_FAMILIES = frozenset(
    ("mixtral", "deepseek_v3", "glm4_moe_lite", "gpt_oss", "lfm2_moe", "exaone_moe", "llama4", "qwen3")
)


COMMON = dict(vocab_size=300, hidden_size=48, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
              max_position_embeddings=512, tie_word_embeddings=False)  # fmt: skip
FAMILY_CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        COMMON, head_dim=16, intermediate_size=80, moe_intermediate_size=24, num_experts=10, num_experts_per_tok=3,
        norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        COMMON, intermediate_size=72, moe_intermediate_size=16, shared_expert_intermediate_size=36, num_experts=9,
        num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[1])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        COMMON, intermediate_size=40, num_local_experts=7, num_experts_per_tok=3, eos_token_id=None)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        COMMON, intermediate_size=24, num_experts=11, num_experts_per_tok=3, norm_topk_prob=False,
        eos_token_id=None, pad_token_id=None)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        COMMON, num_key_value_heads=6, intermediate_size=40, moe_intermediate_size=16, n_routed_experts=8,
        n_shared_experts=2, num_experts_per_tok=3, first_k_dense_replace=1, kv_lora_rank=20, q_lora_rank=None,
        qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=12, routed_scaling_factor=1.5, topk_method="greedy",
        norm_topk_prob=False, eos_token_id=None, bos_token_id=None)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        COMMON, num_key_value_heads=6, intermediate_size=40, moe_intermediate_size=16, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=3, first_k_dense_replace=1, kv_lora_rank=20, q_lora_rank=None,
        qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=12, routed_scaling_factor=2.5, n_group=2, topk_group=1,
        norm_topk_prob=True, eos_token_id=None, bos_token_id=None)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        COMMON, head_dim=16, intermediate_size=72, moe_intermediate_size=24, n_routed_experts=12,
        num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1, attention_bias=True, n_group=1,
        topk_group=1, norm_topk_prob=True, eos_token_id=None, pad_token_id=None)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        COMMON, head_dim=16, intermediate_size=24, num_local_experts=10, num_experts_per_tok=3, sliding_window=12,
        max_position_embeddings=8192, eos_token_id=None, pad_token_id=None)),
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", dict(
        COMMON, num_hidden_layers=4, intermediate_size=72, moe_intermediate_size=24, num_experts=10,
        num_experts_per_tok=3, num_dense_layers=1, layer_types=["conv", "full_attention", "conv", "conv"],
        eos_token_id=None, bos_token_id=None, pad_token_id=None)),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", dict(
        COMMON, intermediate_size=72, moe_intermediate_size=24, moe_num_experts=10, moe_k=3, moe_num_shared_experts=2,
        moe_layer_start_index=1, eos_token_id=None, bos_token_id=None, pad_token_id=None)),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", dict(
        COMMON, head_dim=16, intermediate_size=24, num_experts=10, moe_topk=3, eos_token_id=None, bos_token_id=None,
        pad_token_id=None, eod_token_id=None, sep_token_id=None)),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", dict(
        COMMON, intermediate_size=24, num_local_experts=10, num_experts_per_tok=2, eos_token_id=None, bos_token_id=None,
        pad_token_id=None)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        COMMON, intermediate_size=24, num_local_experts=10, num_experts_per_tok=3, embedding_multiplier=2.0,
        attention_multiplier=0.125, residual_multiplier=0.5, logits_scaling=2.0, eos_token_id=None, bos_token_id=None,
        pad_token_id=None)),
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", dict(
        COMMON, intermediate_size=24, num_local_experts=10, num_experts_per_tok=3, shared_intermediate_size=36,
        embedding_multiplier=2.0, attention_multiplier=0.125, residual_multiplier=0.5, logits_scaling=2.0,
        eos_token_id=None, bos_token_id=None, pad_token_id=None)),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(
        COMMON, num_key_value_heads=6, intermediate_size=40, moe_intermediate_size=16, n_routed_experts=12,
        n_shared_experts=1, num_experts_per_tok=3, kv_lora_rank=20, q_lora_rank=24, qk_nope_head_dim=10,
        qk_rope_head_dim=6, v_head_dim=12, eos_token_id=None, bos_token_id=None, pad_token_id=None)),
    "dots1": ("Dots1Config", "Dots1ForCausalLM", dict(
        COMMON, intermediate_size=72, moe_intermediate_size=24, n_routed_experts=12, n_shared_experts=2,
        num_experts_per_tok=3, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=1.5,
        sliding_window=None)),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(
        COMMON, head_dim=16, intermediate_size=24, num_local_experts=10, num_experts_per_tok=3, rotary_dim=8,
        eos_token_id=None, bos_token_id=None)),
    "exaone_moe": ("ExaoneMoeConfig", "ExaoneMoeForCausalLM", dict(
        COMMON, num_hidden_layers=4, head_dim=16, intermediate_size=72, moe_intermediate_size=24, num_experts=10,
        num_experts_per_tok=3, sliding_window=12, eos_token_id=None, bos_token_id=None, pad_token_id=None)),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", dict(
        COMMON, head_dim=16, intermediate_size=24, intermediate_size_mlp=72, num_local_experts=10,
        num_experts_per_tok=3, no_rope_layer_interval=2, attention_chunk_size=16, floor_scale=8, eos_token_id=None,
        bos_token_id=None, pad_token_id=None)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(COMMON, head_dim=16, intermediate_size=72)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        COMMON, intermediate_size=72, eos_token_id=None, bos_token_id=None, pad_token_id=None)),
}  # fmt: skip


def check_pages_as_resident(folder: Path, prompt: list[int], n_tokens: int = 12, expert_memory: str = "50%") -> None:
    """Greedy tokens with the pager at `expert_memory` (default half the expert bytes: misses on the way) equal the
    all-resident run's; the look-ahead predicted experts on the way (a model of two MoE layers or more)."""
    import moelane
    from moelane.pager.live.store import ExpertStore

    want = list(moelane.load(folder).generate_ids(prompt, n_tokens))
    lm = moelane.load(folder, expert_memory=expert_memory)  # (its store attached, prefill chunks fitted to its pool)
    store = lm.provider
    assert isinstance(store, ExpertStore)
    assert list(lm.generate_ids(prompt, n_tokens)) == want
    lm.close()
    store.check_invariants()
    assert store.stats.totals().misses > 0
    assert len(lm.moe_layers) < 2 or store.stats.source("lookahead").routed > 0


def drop_tensor(folder: Path, name: str) -> None:
    """Take one tensor out of a single-file checkpoint."""
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    del weights[name]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def write_harmony_tokenizer(folder: Path, chat_template: str) -> Path:
    """`write_tokenizer`'s test tokenizer with gpt-oss's channel tokens (harmony) added, and `chat_template`."""
    from tokenizers import Tokenizer as HfTokenizer

    from moelane.model.reasoning import SPECIALS

    write_tokenizer(folder, 300)
    tok = HfTokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens(list(SPECIALS))
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": chat_template}))
    return folder


def write_think_tokenizer(folder: Path, chat_template: str) -> Path:
    """`write_tokenizer`'s test tokenizer with Qwen3's think tags (added tokens, not special: they decode as text),
    and `chat_template`."""
    from tokenizers import Tokenizer as HfTokenizer

    write_tokenizer(folder, 300)
    tok = HfTokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_tokens(["<think>", "</think>"])
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": chat_template}))
    return folder
