"""Evaluate a trained model folder: held-out perplexity per domain, expert usage, sample continuations.

Uses transformers (the reference implementation) on the fixed held-out split written by ``corpus.py`` /
``tokenizer.py``. For a ``qwen3_moe`` model it reports, per MoE layer, the load entropy of the routing (over all
top-k assignments; the maximum is log2(E) bits), the least-used expert's share relative to uniform, and how
differently the domains route: the overlap of each pair of domains' top-8 experts and the total-variation distance
between their expert-load distributions.

Usage::

    python train/analyze.py src/moelane/assets/default --json train/runs/analysis-default.json
    python train/analyze.py src/moelane/assets/draft --no-routing
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
DOMAINS = ("code", "shakespeare", "vimdoc")
PROMPTS = {
    "code": "def fibonacci(n):",
    "prose": "To insert text before the cursor, use the",
    "play": "ROMEO.\nO my love, ",
}


def heldout_windows(seq: int, max_tokens: int) -> dict[str, torch.Tensor]:
    out = {}
    for d in DOMAINS:
        # windows spread evenly over the whole held-out split (its files are in path order, so the first tokens
        # alone would be one file)
        arr = np.fromfile(DATA / f"{d}.heldout.bin", dtype=np.uint16)
        n = min(max_tokens, len(arr) - 1) // seq
        starts = np.linspace(0, len(arr) - seq - 1, n).astype(np.int64)
        idx = starts[:, None] + np.arange(seq + 1)[None, :]
        out[d] = torch.from_numpy(arr[idx].astype(np.int64))
    return out


@torch.no_grad()
def evaluate(model, windows: dict[str, torch.Tensor], routing: bool, bs: int = 8) -> dict:
    """Held-out loss per domain, and per-domain expert counts [L, E] from the router's top-k."""
    cfg = model.config
    res: dict = {"loss": {}, "ppl": {}, "tokens": {}, "counts": {}}
    for d, w in windows.items():
        tot, n = 0.0, 0
        counts = None
        for i in range(0, len(w), bs):
            x = w[i : i + bs]
            out = model(input_ids=x[:, :-1], output_router_logits=routing)
            logits = out.logits.float()
            tot += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
            ).item()
            n += x[:, 1:].numel()
            if routing:
                # router_logits: one [T, E] tensor per MoE layer
                layers = torch.stack([r.float() for r in out.router_logits])  # [L, T, E]
                top = layers.topk(cfg.num_experts_per_tok, dim=-1).indices  # [L, T, K]
                c = torch.stack([torch.bincount(t.reshape(-1), minlength=layers.shape[-1]) for t in top])
                counts = c if counts is None else counts + c
        res["loss"][d] = tot / n
        res["ppl"][d] = math.exp(tot / n)
        res["tokens"][d] = n
        if routing:
            res["counts"][d] = counts
    return res


def routing_report(counts: dict[str, torch.Tensor], top: int = 8) -> dict:
    total = sum(counts.values())  # [L, E]
    n_layers, n_experts = total.shape
    load = total.double() / total.sum(dim=1, keepdim=True)
    entropy = -(load * load.clamp_min(1e-12).log2()).sum(dim=1)
    layers = []
    for layer in range(n_layers):
        per_dom = {d: (c[layer].double() / c[layer].sum()) for d, c in counts.items()}
        tops = {d: sorted(p.topk(top).indices.tolist()) for d, p in per_dom.items()}
        pairs = {}
        doms = list(per_dom)
        for i, a in enumerate(doms):
            for b in doms[i + 1 :]:
                pairs[f"{a}/{b}"] = {
                    "top_overlap": len(set(tops[a]) & set(tops[b])),
                    "tv_distance": round(0.5 * (per_dom[a] - per_dom[b]).abs().sum().item(), 3),
                }
        layers.append(
            {
                "layer": layer,
                "entropy_bits": round(entropy[layer].item(), 3),
                "max_entropy_bits": round(math.log2(n_experts), 3),
                "min_share_vs_uniform": round((load[layer].min() * n_experts).item(), 3),
                "max_share_vs_uniform": round((load[layer].max() * n_experts).item(), 3),
                "top_experts": tops,
                "pairs": pairs,
            }
        )
    return {"layers": layers}


def samples(model, tok, max_new_tokens: int, seed: int) -> dict[str, str]:
    out = {}
    for name, prompt in PROMPTS.items():
        ids = torch.tensor([tok.encode(prompt).ids])
        torch.manual_seed(seed)
        gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, repetition_penalty=1.1)
        out[name] = prompt + tok.decode(gen[0, ids.shape[1] :].tolist(), skip_special_tokens=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32768, help="held-out tokens per domain")
    ap.add_argument("--max-new-tokens", type=int, default=80)
    ap.add_argument("--no-routing", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True, dtype=torch.float32).eval()
    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    routing = not args.no_routing and hasattr(model.config, "num_experts_per_tok")
    res = evaluate(model, heldout_windows(args.seq, args.tokens), routing)
    report: dict = {
        "heldout_loss": {d: round(v, 4) for d, v in res["loss"].items()},
        "heldout_ppl": {d: round(v, 2) for d, v in res["ppl"].items()},
        "heldout_tokens": res["tokens"],
    }
    n_params = sum(p.numel() for p in model.parameters())
    report["params"] = n_params
    if routing:
        cfg = model.config
        per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
        n_moe = len(res["counts"]["code"])
        report["active_params"] = n_params - n_moe * (cfg.num_experts - cfg.num_experts_per_tok) * per_expert
        report["routing"] = routing_report(res["counts"])
    report["samples"] = samples(model, tok, args.max_new_tokens, args.seed)

    print("held-out perplexity: " + "  ".join(f"{d}={v:.2f}" for d, v in report["heldout_ppl"].items()))
    if routing:
        for lay in report["routing"]["layers"]:
            pairs = "  ".join(
                f"{k}: top8 overlap {v['top_overlap']}/8 tv {v['tv_distance']}" for k, v in lay["pairs"].items()
            )
            print(
                f"layer {lay['layer']}: entropy {lay['entropy_bits']:.2f}/{lay['max_entropy_bits']:.2f} bits, "
                f"min share {lay['min_share_vs_uniform']:.2f}x uniform | {pairs}"
            )
    for name, text in report["samples"].items():
        print(f"--- {name} ---\n{text}\n")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
