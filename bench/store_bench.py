"""Live expert store: decode tokens/s at a share of expert bytes resident, against the all-resident run and against
the replay's prediction for the same routing trace; and the held-out perplexity cost of the int8 / int4 tiers.

For each share (default 100, 50, 25, 10 %): a fresh store, the model's shard files dropped from the page cache
(`posix_fadvise(DONTNEED)`) so misses really read the disk, one greedy generation (prompt, then `--tokens` decode
tokens); decode tok/s counts the decode passes only. Tokens are checked equal to the all-resident run. The replay
runs the same policy over the routing recorded in the all-resident run, with a cost model of this disk (measured
here: positioned reads of whole experts, cache dropped, `--io-threads` in parallel) and of this CPU (the
all-resident decode time per token as the compute floor). A second prediction ("pred live") uses the speed the run's
own disk loads had instead (one load thread's view; the cold-read speed measured up front knows nothing of pages
the OS caches as the run goes).

    python bench/store_bench.py --random /tmp/q3-2g            # builds a random qwen3_moe with ~2.4 GB of experts
    python bench/store_bench.py                                # the shipped default model
    python bench/store_bench.py --perplexity                   # held-out perplexity at native / int8 / int4

Prints one JSON line per measurement (with config and git revision) and a summary table.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers import write_tokenizer

import moelane
from moelane.model.provider import RoutingRecord
from moelane.pager.lab.policies import make_policy
from moelane.pager.lab.replay import CostModel, replay
from moelane.pager.live.build import format_stats, store_factory
from moelane.pager.live.memory import parse_memory
from moelane.pager.live.recorder import header_from_lm
from moelane.pager.live.storage import ShardFiles, read_native
from moelane.pager.live.store import ExpertStore
from moelane.pager.trace import Segment, trace_from_segments
from revision import git_rev


def build_random(folder: Path) -> Path:
    """A random-weight qwen3_moe with 12 MoE layers x 64 experts (top-4) of 3 MiB each in bf16: 2.4 GB of experts."""
    if (folder / "config.json").exists():
        return folder
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=2048, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=12,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, num_experts=64, num_experts_per_tok=4,
        norm_topk_prob=True, max_position_embeddings=2048, tie_word_embeddings=False, torch_dtype="bfloat16",
    )  # fmt: skip
    torch.set_default_dtype(torch.bfloat16)
    model = Qwen3MoeForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), max_shard_size="1GB")
    write_tokenizer(folder, config.vocab_size)
    return folder


class Recorder:
    """Keeps every pass's routing as trace segments (for the replay)."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []

    def observe(self, record: RoutingRecord) -> None:
        ids = record.expert_ids.permute(1, 0, 2).numpy().copy()
        streams = np.zeros(ids.shape[0], np.int64)
        self.segments.append(Segment(len(self.segments), record.phase, ids, streams))


def generate(lm: moelane.LM, prompt: list[int], n_tokens: int, chunk: int) -> tuple[list[int], float, float]:
    """Greedy tokens, prefill seconds, decode tok/s (decode passes only)."""
    t0 = time.perf_counter()
    out: list[int] = []
    t_first = t0
    for token in lm.generate_ids(prompt, n_tokens, prefill_chunk=chunk, stop_ids=frozenset()):
        if not out:
            t_first = time.perf_counter()
        out.append(token)
    t_end = time.perf_counter()
    return out, t_first - t0, (len(out) - 1) / (t_end - t_first)


def shard_paths(lm: moelane.LM) -> list[str]:
    return sorted({ref.path for hs in lm.expert_handles.values() for h in hs for ref in h.tensors.values()})


def disk_bandwidth(lm: moelane.LM, n_threads: int, n_experts: int = 64) -> float:
    """Bytes/s of positioned whole-expert reads from disk (page cache dropped), `n_threads` in parallel."""
    files = ShardFiles()
    files.drop_page_cache(shard_paths(lm))
    handles = [h for hs in lm.expert_handles.values() for h in hs]
    picked = [handles[i] for i in np.random.default_rng(0).choice(len(handles), min(n_experts, len(handles)), False)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, n_threads)) as pool:
        n_bytes = sum(pool.map(lambda h: read_native(files, h).numel(), picked))
    seconds = time.perf_counter() - t0
    files.close()
    return n_bytes / seconds


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


def run_speed(args: argparse.Namespace) -> None:
    folder = build_random(Path(args.random)) if args.random else args.model
    dtype = getattr(torch, args.dtype)
    rng = np.random.default_rng(1)
    resident = moelane.load(folder, dtype)
    prompt = rng.integers(3, resident.vocab_size - 1, args.prompt_tokens).tolist()
    # one prefill chunk for every run (so the replayed trace is the one each store ran): small enough that a chunk's
    # experts fit the smallest pool (see ExpertStore.max_rows)
    n_per_layer, top_k = resident.args.num_experts, resident.args.num_experts_per_tok
    min_slots = min(args.shares) * n_per_layer * len(resident.moe_layers) // 100
    chunk = args.chunk if min_slots >= n_per_layer else min(args.chunk, max(1, min_slots // top_k))
    recorder = Recorder()
    generate(resident, prompt[:8], 4, chunk)  # warm-up
    resident.observers.append(recorder)
    want, _, base_tps = generate(resident, prompt, args.tokens, chunk)
    resident.observers.remove(recorder)
    header = header_from_lm(resident)
    n_experts_total = sum(len(hs) for hs in resident.expert_handles.values())
    bandwidth = disk_bandwidth(resident, args.io_threads)
    base = {"git": git_rev(), "model": str(folder), "dtype": args.dtype, "prompt_tokens": len(prompt), "chunk": chunk,
            "tokens": args.tokens, "policy": args.policy, "predictors": args.predictors}  # fmt: skip
    emit({**base, "run": "resident", "decode_tok_s": base_tps, "disk_bytes_s": bandwidth})
    resident_tps = base_tps
    del resident
    gc.collect()
    # The store at 100% with every expert of the run already resident (a second identical generation): the
    # all-resident speed through the same provider code, and the baseline of the ratios below.
    warm = moelane.load(folder, dtype, provider=store_factory(parse_memory("100%"), None, args.policy, "native"))
    generate(warm, prompt, args.tokens, chunk)
    _, _, base_tps = generate(warm, prompt, args.tokens, chunk)
    emit({**base, "run": "store_100_warm", "decode_tok_s": base_tps})
    warm.provider.close()  # type: ignore[attr-defined]
    del warm
    gc.collect()
    trace = trace_from_segments(header, recorder.segments)
    rows = []
    for share in args.shares:
        lm = moelane.load(folder, dtype, provider=store_factory(parse_memory(f"{share}%"), None, args.policy, "native"))
        store = lm.provider
        assert isinstance(store, ExpertStore)
        attached = store.attach(lm, lookahead=args.predictors, cooc=args.predictors)
        store.storage.files.drop_page_cache(shard_paths(lm))
        got, prefill_s, tps = generate(lm, prompt, args.tokens, chunk)
        attached.detach()
        cost = CostModel(bandwidth=bandwidth, latency=1e-4, compute_floor=1.0 / base_tps)
        predicted = replay(trace, make_policy(args.policy, header), store.n_slots, "slots", cost).to_dict()
        # The same replay at the speed this run's loads had (one load thread's view: exact where the computing thread
        # reads small experts itself, low where I/O threads load in parallel). The speed measured at the start is of
        # cold reads; the live "disk" level also meets pages the OS cached during the run.
        live = store.stats.load_speed("disk")
        live_cost = CostModel(bandwidth=live or bandwidth, latency=1e-4, compute_floor=1.0 / base_tps)
        predicted_live = replay(trace, make_policy(args.policy, header), store.n_slots, "slots", live_cost).to_dict()
        stats = store.stats.to_dict()
        row = {**base, "run": "store", "share": share, "slots": store.n_slots, "of": n_experts_total,
               "identical": got == want, "decode_tok_s": tps, "ratio_to_resident": tps / base_tps,
               "ratio_to_resident_provider": tps / resident_tps,
               "predicted_tok_s": predicted["tok_s_aggregate"], "live_load_bytes_s": live,
               "predicted_tok_s_live_speed": predicted_live["tok_s_aggregate"],
               "predicted_decode_hit_rate": predicted["decode_hit_rate"],
               "decode_hit_rate": stats["by_phase"].get("decode", {}).get("hit_rate"),
               "decode_stall_s": stats["by_phase"].get("decode", {}).get("stall_s"), "prefill_s": prefill_s,
               "stats": stats}  # fmt: skip
        emit(row)
        if args.verbose:
            print(format_stats(store), file=sys.stderr)
        rows.append(row)
        store.close()
        del lm, store
        gc.collect()
    again = moelane.load(folder, dtype)
    _, _, again_tps = generate(again, prompt, args.tokens, chunk)  # the baseline again: order and load effects
    emit({**base, "run": "resident_again", "decode_tok_s": again_tps})
    del again
    print(f"all-resident (ResidentProvider) decode {resident_tps:.2f} tok/s, again after the store runs "
          f"{again_tps:.2f}; store at 100% warm {base_tps:.2f} tok/s (the ratios' baseline); "
          f"disk {bandwidth / 1e6:.0f} MB/s", file=sys.stderr)  # fmt: skip
    print(
        f"{'share':>6}{'slots':>7}{'tok/s':>8}{'x res':>7}{'pred':>8}{'live MB/s':>10}{'pred live':>10}{'hit':>7}"
        f"{'pred hit':>9}  same",
        file=sys.stderr,
    )
    for r in rows:
        speed = r["live_load_bytes_s"] / 1e6 if r["live_load_bytes_s"] else float("nan")
        print(f"{r['share']:>5}%{r['slots']:>7}{r['decode_tok_s']:>8.2f}{r['ratio_to_resident']:>7.2f}"
              f"{r['predicted_tok_s']:>8.2f}{speed:>10.0f}{r['predicted_tok_s_live_speed']:>10.2f}"
              f"{r['decode_hit_rate'] or 0:>7.1%}{r['predicted_decode_hit_rate']:>9.1%}  {r['identical']}",
              file=sys.stderr)  # fmt: skip


def heldout_tokens(n: int) -> list[list[int]]:
    """`n`-token windows from each held-out domain of the default model's corpus (train/data/*.heldout.bin)."""
    data = Path(__file__).resolve().parents[1] / "train" / "data"
    windows = []
    for path in sorted(data.glob("*.heldout.bin")):
        ids = np.fromfile(path, dtype=np.uint16)
        for start in np.linspace(0, len(ids) - n - 1, 4).astype(int):
            windows.append(ids[start : start + n].astype(np.int64).tolist())
    return windows


def perplexity(lm: moelane.LM, windows: list[list[int]]) -> float:
    nll, count = 0.0, 0
    for w in windows:
        logits = lm.logits(w[:-1]).float()
        nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(w[1:]), reduction="sum"))
        count += len(w) - 1
    return math.exp(nll / count)


def run_perplexity(args: argparse.Namespace) -> None:
    windows = heldout_tokens(args.window)
    for tier in ("native", "int8", "int4"):
        lm = moelane.load(args.model, provider=store_factory(parse_memory("100%"), None, "planner", tier))
        store = lm.provider
        assert isinstance(store, ExpertStore)
        ppl = perplexity(lm, windows)
        handles = [h for hs in lm.expert_handles.values() for h in hs]
        stored = store.stats.bytes_read.get(("disk", tier), 0) / max(1, store.stats.reads.get(("disk", tier), 1))
        emit({"git": git_rev(), "run": "perplexity", "model": str(args.model or "default"), "tier": tier,
              "perplexity": ppl, "windows": len(windows), "window": args.window, "expert_bytes": stored,
              "expert_bytes_native": handles[0].nbytes, "saved": 1 - stored / handles[0].nbytes})  # fmt: skip
        store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the shipped model)")
    ap.add_argument("--random", metavar="DIR", help="build (once) and use a random qwen3_moe with ~2.4 GB of experts")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
    ap.add_argument("--shares", type=int, nargs="+", default=[100, 50, 25, 10])
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=64, help="prefill chunk (capped so a chunk's experts fit the pool)")
    ap.add_argument("--policy", default="planner", choices=("planner", "lru", "lfu"))
    ap.add_argument("--predictors", action="store_true", help="attach look-ahead and co-occurrence prefetch")
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--perplexity", action="store_true", help="held-out perplexity at native / int8 / int4")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.random else "float32")
    # Measured here: without this, runs were 10-25x slower at random (the ResidentProvider most often): denormal
    # arithmetic, apparently on uninitialised buffers holding freed bytes; every run of one invocation shares it.
    torch.set_flush_denormal(True)
    if args.perplexity:
        run_perplexity(args)
    else:
        run_speed(args)


if __name__ == "__main__":
    main()
