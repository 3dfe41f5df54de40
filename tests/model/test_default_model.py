"""The shipped default model and draft model: what they are, that transformers runs them, that moelane computes the
same function, and that the default model's routing is not degenerate on held-out text.

The routing checks run on fixed excerpts of the held-out split (tests/fixtures/text/heldout_sample.json), never
trained on: code (os.py, base64.py), a play (Macbeth, Twelfth Night) and prose (Vim's user manual).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import moelane
from moelane.assets import default_model_path, draft_model_path

SAMPLE = Path(__file__).resolve().parents[1] / "fixtures" / "text" / "heldout_sample.json"
SHIPPED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
TOP = 8  # "most used experts" = the top 8 of 32
WINDOW = 256  # the training sequence length


def config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def shipped_bytes(folder: Path) -> int:
    return sum((folder / name).stat().st_size for name in SHIPPED_FILES)


def bf16_tensors(folder: Path) -> bool:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return all(f.get_slice(k).get_dtype() == "BF16" for k in f.keys())  # noqa: SIM118


@pytest.fixture(scope="module")
def sample() -> dict[str, str]:
    data = json.loads(SAMPLE.read_text())
    return {d: data[d] for d in ("code", "play", "prose")}


@pytest.fixture(scope="module")
def lm() -> moelane.LM:
    return moelane.load()  # no path: the shipped default


def test_default_model_is_fine_grained_qwen3_moe_within_budget() -> None:
    folder = default_model_path()
    cfg = config(folder)
    assert cfg["model_type"] == "qwen3_moe"
    assert cfg["norm_topk_prob"] is True
    n_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    assert n_experts >= 32
    assert cfg["num_experts_per_tok"] >= 4
    n_moe = sum(1 for i in range(cfg["num_hidden_layers"]) if i not in cfg.get("mlp_only_layers", []))
    assert n_moe >= 6
    assert shipped_bytes(folder) <= 40_000_000  # decimal MB, the stricter reading
    assert bf16_tensors(folder)
    assert (folder / "MODEL_CARD.md").is_file()


def test_draft_model_is_tiny_dense_with_the_same_tokenizer() -> None:
    folder = draft_model_path()
    cfg = config(folder)
    assert cfg["model_type"] in ("qwen3", "llama")
    assert shipped_bytes(folder) <= 4_000_000
    assert bf16_tensors(folder)
    default = default_model_path()
    assert (folder / "tokenizer.json").read_bytes() == (default / "tokenizer.json").read_bytes()
    assert cfg["vocab_size"] == config(default)["vocab_size"]


def test_generation_config_ends_on_the_tokenizers_eos() -> None:
    for folder in (default_model_path(), draft_model_path()):
        gen = json.loads((folder / "generation_config.json").read_text())
        tok = json.loads((folder / "tokenizer.json").read_text())
        eos = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<|endoftext|>")
        assert gen["eos_token_id"] == eos


def test_chat_template_renders_roles(lm: moelane.LM) -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = ImmutableSandboxedEnvironment().from_string(lm.tokenizer.chat_template)
    text = template.render(messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "<|user|>\nhi<|endoftext|>\n<|assistant|>\n"
    assert all(len(lm.tokenizer.encode(marker)) == 1 for marker in ("<|user|>", "<|assistant|>", "<|endoftext|>"))


@pytest.mark.parametrize("which", ["default", "draft"])
def test_transformers_loads_the_shipped_models(which: str, sample: dict[str, str]) -> None:
    transformers = pytest.importorskip("transformers")
    folder = default_model_path() if which == "default" else draft_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    ids = tok(sample["code"][:400], return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert loss < 7.0  # trained: well below the log(8192) = 9.0 of a uniform guess


def test_logits_match_transformers(lm: moelane.LM, sample: dict[str, str]) -> None:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        default_model_path(), local_files_only=True, dtype=torch.float32
    ).eval()
    for text in sample.values():
        ids = lm.tokenizer.encode(text)[:200]
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0].float()
        got = lm.logits(ids).float()
        assert (got - want).abs().max().item() <= 1e-4


def routing_counts(lm: moelane.LM, text: str) -> torch.Tensor:
    """Routings per expert [L, E] over the text, from the engine's own routing records."""
    records = []

    class Keep:
        def observe(self, record: object) -> None:
            records.append(record)

    ids = lm.tokenizer.encode(text)
    lm.observers.append(Keep())
    try:
        for start in range(0, len(ids), WINDOW):  # windows as long as the training sequences
            lm.logits(ids[start : start + WINDOW])
    finally:
        lm.observers.pop()
    expert_ids = torch.cat([r.expert_ids for r in records], dim=1)  # [L, T, K]
    n_experts = len(lm.expert_handles[lm.moe_layers[0]])
    return torch.stack([torch.bincount(layer.reshape(-1), minlength=n_experts) for layer in expert_ids])


def test_routing_is_not_degenerate(lm: moelane.LM, sample: dict[str, str]) -> None:
    counts = {d: routing_counts(lm, text) for d, text in sample.items()}
    total = sum(counts.values())  # [L, E]
    n_layers, n_experts = total.shape
    assert n_layers == len(lm.moe_layers)
    share = total.double() / total.sum(dim=1, keepdim=True) * n_experts  # 1.0 = uniform
    assert share.min().item() >= 0.2, f"least-used expert per layer (x uniform): {share.min(dim=1).values.tolist()}"
    # Code and prose route differently: their most used experts differ in every layer.
    for layer in range(n_layers):
        top_code = set(counts["code"][layer].topk(TOP).indices.tolist())
        top_prose = set(counts["prose"][layer].topk(TOP).indices.tolist())
        assert top_code != top_prose, f"layer {layer}: code and prose share their top {TOP} experts"


def test_default_model_continues_code_with_code(lm: moelane.LM) -> None:
    reply = lm.generate("def fibonacci(n):", max_tokens=24, temperature=0.0)
    assert reply.startswith("\n    ") and any(w in reply for w in ("return", "def ", "if ", '"""', "=")), reply
