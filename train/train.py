"""Train moelane's embedded models on the three-domain corpus (CPU, fixed seed).

Two kinds:

* ``--kind moe``   -- the default model: ``qwen3_moe``, 8 MoE layers x 32 routed experts (top-4,
                      ``norm_topk_prob: true``), trained with the router's load-balancing loss.
* ``--kind draft`` -- the tiny dense ``qwen3`` draft model (same tokenizer) for speculative decoding.

A lean loop over transformers' own model classes: fp32 on CPU (these CPUs have no bf16 units),
AdamW + warmup/cosine, uniform domain mixing (each sequence's domain is drawn with p=1/3), a fixed
seed for initialisation and for batch sampling, held-out loss per domain every ``--eval-every`` steps,
a checkpoint every ``--ckpt-every`` steps. The final model is saved in bf16 with ``save_pretrained``,
together with the tokenizer and a generation config. Run ``corpus.py`` and ``tokenizer.py`` first.

Usage (the shipped models)::

    python train/train.py --kind moe   --steps 1200 --out train/runs/moe
    python train/train.py --kind draft --steps 500 --threads 1 --out train/runs/draft
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
DOMAINS = ("code", "shakespeare", "vimdoc")
EOT_ID = 0  # "<|endoftext|>" is the first special token


def moe_config(experts_impl: str):
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=8192,
        hidden_size=192,
        intermediate_size=512,  # unused: every layer is an MoE layer
        moe_intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=32,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=0.1,  # weight of the per-layer balancing loss below
        output_router_logits=False,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        hidden_act="silu",
        attention_bias=False,
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_id=EOT_ID,
        pad_token_id=EOT_ID,
        use_cache=True,
    )
    cfg._experts_implementation = experts_impl
    return cfg


def draft_config():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=8192,
        hidden_size=128,
        intermediate_size=320,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        hidden_act="silu",
        attention_bias=False,
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_id=EOT_ID,
        pad_token_id=EOT_ID,
        use_cache=True,
    )


def build_model(kind: str, experts_impl: str):
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    if kind == "moe":
        cfg = moe_config(experts_impl)
        model = Qwen3MoeForCausalLM(cfg)
    else:
        cfg = draft_config()
        model = Qwen3ForCausalLM(cfg)
    cfg._attn_implementation = "sdpa"
    return model


class Batches:
    """Deterministic batch sampler: every sequence picks a domain (p=1/3 each) and a random window."""

    def __init__(self, split: str, seed: int):
        self.data = {d: np.fromfile(DATA / f"{d}.{split}.bin", dtype=np.uint16) for d in DOMAINS}
        self.rng = np.random.default_rng(seed)

    def sample(self, batch: int, seq: int) -> tuple[torch.Tensor, list[str]]:
        x = np.empty((batch, seq + 1), dtype=np.int64)
        doms = []
        for i in range(batch):
            d = DOMAINS[int(self.rng.integers(len(DOMAINS)))]
            arr = self.data[d]
            o = int(self.rng.integers(0, len(arr) - seq - 1))
            x[i] = arr[o : o + seq + 1]
            doms.append(d)
        return torch.from_numpy(x), doms


def heldout_windows(seq: int, max_tokens: int) -> dict[str, torch.Tensor]:
    """Fixed, non-overlapping held-out windows per domain (the first ``max_tokens`` tokens of each)."""
    out = {}
    for d in DOMAINS:
        arr = np.fromfile(DATA / f"{d}.heldout.bin", dtype=np.uint16)[:max_tokens]
        n = (len(arr) - 1) // seq
        idx = np.arange(n)[:, None] * seq + np.arange(seq + 1)[None, :]
        out[d] = torch.from_numpy(arr[idx].astype(np.int64))
    return out


@torch.no_grad()
def evaluate(model, windows: dict[str, torch.Tensor], bs: int = 16) -> dict[str, float]:
    model.eval()
    res = {}
    for d, w in windows.items():
        tot, n = 0.0, 0
        for i in range(0, len(w), bs):
            x = w[i : i + bs]
            logits = model(input_ids=x[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1), reduction="sum"
            )
            tot += loss.item()
            n += x[:, 1:].numel()
        res[d] = tot / n
    res["mean"] = sum(res[d] for d in windows) / len(windows)
    model.train()
    return res


def balance_loss(router_logits: tuple[torch.Tensor, ...], top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Load-balancing losses per MoE layer, averaged over layers: (switch, kl).

    switch: the Switch-Transformer loss E * sum_e load_e * mean_prob_e (1.0 when perfectly balanced). transformers'
        own `load_balancing_loss_func` pools the tokens of all layers before balancing, which leaves experts dead in
        one layer as long as other layers use them; this balances each layer.
    kl: KL(uniform || mean router probability) (0 when balanced). The switch loss pushes a dead expert's logit up
        only in proportion to its (tiny) probability; this term pushes it at a rate that does not vanish, so experts
        that die early in training come back.
    """
    switch, kl = [], []
    for logits in router_logits:  # [T, E] per layer
        probs = logits.float().softmax(dim=-1)
        n_experts = probs.shape[-1]
        top = probs.topk(top_k, dim=-1).indices  # [T, K]
        load = torch.zeros(n_experts).index_add_(0, top.reshape(-1), torch.ones(top.numel())) / top.numel()
        mean_prob = probs.mean(dim=0)
        switch.append(n_experts * (load * mean_prob).sum())
        kl.append(-(mean_prob * n_experts).log().mean())
    return torch.stack(switch).mean(), torch.stack(kl).mean()


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


def save_final(model, out: Path, kind: str) -> Path:
    from transformers import GenerationConfig

    final = out / "final"
    if final.exists():
        shutil.rmtree(final)
    m = model.to(torch.bfloat16)
    m.config.output_router_logits = False
    m.config.use_cache = True
    m.config.moelane_compute_dtype = "float32"  # stored in bf16 for size; trained, and meant to run, in fp32
    m.generation_config = GenerationConfig(
        eos_token_id=EOT_ID,
        pad_token_id=EOT_ID,
        bos_token_id=None,
        do_sample=True,
        temperature=0.8,
        top_p=0.95,
        max_new_tokens=128,
    )
    m.save_pretrained(final, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DATA / "tokenizer" / f, final / f)
    model.to(torch.float32)
    return final


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=("moe", "draft"), default="moe")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=None, help="peak LR (default 3e-3 moe, 4e-3 draft)")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--experts-impl", default="grouped_mm", help="transformers experts implementation")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-tokens", type=int, default=8192, help="held-out tokens per domain per eval")
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--time-limit", type=float, default=0, help="minutes; stop early (and save) past this")
    ap.add_argument("--out", type=Path, default=HERE / "runs" / "moe")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    peak = args.lr if args.lr is not None else (3e-3 if args.kind == "moe" else 4e-3)

    model = build_model(args.kind, args.experts_impl)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{args.kind}: {n_params / 1e6:.2f}M parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=peak,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    batches = Batches("train", args.seed)
    windows = heldout_windows(args.seq, args.eval_tokens)
    start = 0
    ckpt = args.out / "ckpt.pt"
    if ckpt.exists():  # resume (model, optimiser, sampler state)
        st = torch.load(ckpt, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        batches.rng.bit_generator.state = st["rng"]
        torch.set_rng_state(st["torch_rng"])
        start = st["step"]
        print(f"resumed from step {start}", flush=True)

    log = open(args.out / "log.jsonl", "a")  # noqa: SIM115 -- open for the whole run, closed at exit
    aux_coef = model.config.router_aux_loss_coef if args.kind == "moe" else 0.0
    model.router_aux_loss_coef = 0.0  # out.loss is the plain cross-entropy; balance_loss() replaces the pooled one
    model.train()
    t0 = time.time()
    tokens = 0
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, mininterval=5, file=sys.stdout)
    for step in bar:
        lr = lr_at(step, args.steps, peak, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        x, _ = batches.sample(args.batch, args.seq)
        if args.kind == "moe":
            out = model(
                input_ids=x[:, :-1],
                labels=x[:, 1:].contiguous(),
                output_router_logits=True,
                use_cache=False,
                shift_labels=x[:, 1:].contiguous(),
            )
            switch, kl = balance_loss(out.router_logits, model.config.num_experts_per_tok)
            ce, aux = out.loss, switch + kl
        else:
            out = model(
                input_ids=x[:, :-1], labels=x[:, 1:].contiguous(), shift_labels=x[:, 1:].contiguous(), use_cache=False
            )
            ce, aux = out.loss, torch.zeros(())
        opt.zero_grad(set_to_none=True)
        (ce + aux_coef * aux).backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += x[:, :-1].numel()
        el = time.time() - t0
        bar.set_postfix(ce=f"{ce.item():.3f}", aux=f"{aux.item():.3f}", tok_s=f"{tokens / el:.0f}", refresh=False)
        rec = {
            "step": step + 1,
            "ce": round(ce.item(), 4),
            "aux": round(aux.item(), 4),
            "lr": lr,
            "gnorm": round(float(gn), 3),
            "elapsed_s": round(el, 1),
            "tok_s": round(tokens / el, 1),
        }
        done = step + 1 == args.steps
        over = args.time_limit and el > args.time_limit * 60
        if (step + 1) % args.eval_every == 0 or done or over:
            ev = evaluate(model, windows)
            rec["heldout"] = {k: round(v, 4) for k, v in ev.items()}
            print(f"\nstep {step + 1}: held-out loss " + " ".join(f"{k}={v:.3f}" for k, v in ev.items()), flush=True)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if (step + 1) % args.ckpt_every == 0 or done or over:
            tmp = args.out / "ckpt.pt.tmp"
            torch.save(
                {
                    "model": model.state_dict(),
                    "opt": opt.state_dict(),
                    "rng": batches.rng.bit_generator.state,
                    "torch_rng": torch.get_rng_state(),
                    "step": step + 1,
                },
                tmp,
            )
            os.replace(tmp, ckpt)
            save_final(model, args.out, args.kind)
        if over:
            print(f"time limit reached at step {step + 1}", flush=True)
            break
    final = save_final(model, args.out, args.kind)
    print(f"saved {final} after {(time.time() - t0) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
