"""Regenerate the pager's fixture traces and the tables of docs/pager-results.md.

    OMP_NUM_THREADS=1 .venv/bin/python bench/pager_results.py --record [--model PATH]   # re-record the fixtures
    OMP_NUM_THREADS=1 .venv/bin/python bench/pager_results.py                           # tables from the fixtures

Records tests/fixtures/traces/default.trc from the prompts in tests/fixtures/traces/prompts.jsonl (code, prose, play
interleaved; prefill in chunks of 64 as the engine does; 96 tokens each, sampled at temperature 0.8, top-p 0.95 with
a fixed seed per request: greedy decoding of a small model loops, which would flatter every recency policy), then
writes the generated section of docs/pager-results.md (between the GENERATED markers) and prints JSON lines with
config and git revision.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from moelane.pager.lab.analyze import analyze
from moelane.pager.lab.policies import make_policy
from moelane.pager.lab.replay import CostModel, ReplayResult, replay
from moelane.pager.lab.sweep import lru_sweep, max_step_size
from moelane.pager.lab.synth import SynthConfig, synth_trace
from moelane.pager.scoreboard import ARMS, DecayBandit
from moelane.pager.trace import Trace, read_trace, token_flat_ids
from revision import git_rev

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "traces"
DOC = ROOT / "docs" / "pager-results.md"
BEGIN, END = "<!-- BEGIN GENERATED (bench/pager_results.py) -->", "<!-- END GENERATED -->"
POLICIES = ("lru", "lfu", "recent-k", "ema:0.85", "bandit", "planner", "planner:hard", "planner:nowarm",
            "planner:score", "planner:score:hard", "planner:score:nowarm", "lru+ahead", "planner+ahead",
            "planner:hard+ahead", "planner:score+ahead", "belady")  # fmt: skip
FRACTIONS = (0.2, 0.25, 0.35, 0.5, 0.75)
PRICE_FRACTIONS = (0.25, 0.5, 0.75)
INFLATED_BYTES = 9_437_184  # the inflated model's expert: 3 x 192 x 8192 bf16
INFLATED_FLOOR = 1 / 45  # its bf16 decode, s/token, one client (docs/server.md)
SOURCE = {"prefill_union": "66%", "decode_recency": "58%", "prefill_tail": "47%", "stable": "1.4%",
          "freq_top_k": "2.8%", "last_1": "41%", "last_2": "51%", "last_4": "59%"}  # fmt: skip


def record(model: str | None, out: Path) -> None:
    from moelane.commands.trace import cmd_record

    args = argparse.Namespace(prompts=str(FIXTURES / "prompts.jsonl"), out=str(out), model=model, max_tokens=96,
                              prefill_chunk=64, temperature=0.8, seed=0)  # fmt: skip
    cmd_record(args)


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def coverage_table(report: dict[str, Any]) -> list[str]:
    cov = report["overall"]["coverage"]
    lines = ["| set | coverage (ours) | size (ours, experts) | source |", "|---|---|---|---|"]
    for name, v in cov.items():
        lines.append(f"| {name} | {pct(v['coverage'])} | {v['size']:.1f} | {SOURCE.get(name, '-')} |")
    lines += ["", "| predictor | recall (layers >= 1) | repeat recall | delta recall | schedulable coverage |",
              "|---|---|---|---|---|"]  # fmt: skip
    names = {"predictors": "co-occurrence (noisy-OR, top-k extra per layer)", "lookahead": "next-layer look-ahead"}
    for key, name in names.items():
        if (p := report["overall"].get(key)) is not None:
            recall = pct(p["recall"]) if "recall" in p else "-"
            lines.append(f"| {name} | {recall} | {pct(p['repeat_recall'])} | {pct(p['delta_recall'])} | "
                         f"{pct(p['schedulable_coverage'])} |")  # fmt: skip
    return lines


def run_policy(trace: Trace, spec: str, slots: int, cost: CostModel) -> ReplayResult:
    if spec == "lru":
        return lru_sweep(trace, [slots], cost)[0]
    return replay(trace, make_policy(spec), slots, "slots", cost)


def policy_table(trace: Trace, cost: CostModel) -> tuple[list[str], dict[tuple[str, float], ReplayResult]]:
    m = trace.header.n_total
    results: dict[tuple[str, float], ReplayResult] = {}
    head = "| policy | " + " | ".join(f"{f:.0%} ({round(f * m)})" for f in FRACTIONS) + " |"
    lines = ["Decode hit rate (predicted tok/s) by pool size, as a share of all experts (slots):", "", head,
             "|---" * (len(FRACTIONS) + 1) + "|"]  # fmt: skip
    floor = max_step_size(trace)
    for spec in POLICIES:
        if spec.endswith("+ahead") and trace.lookahead is None:
            continue
        cells = []
        for f in FRACTIONS:
            if round(f * m) < floor:  # a step must fit whole
                cells.append("n/a")
                continue
            r = run_policy(trace, spec, max(1, round(f * m)), cost)
            results[(spec, f)] = r
            d = r.to_dict()
            cells.append(f"{pct(d['decode_hit_rate'])} ({d['tok_s_aggregate']:.0f})")
        lines.append(f"| {spec} | " + " | ".join(cells) + " |")
    return lines, results


def with_expert_bytes(trace: Trace, nbytes: int) -> Trace:
    """`trace` as if its experts were `nbytes` at tier 0 (every tier scaled alike)."""
    h = trace.header
    tiers = tuple((name, round(b * nbytes / h.expert_bytes)) for name, b in h.tiers)
    return dataclasses.replace(trace, header=dataclasses.replace(h, tiers=tiers))


def price_table(trace: Trace, cost: CostModel) -> tuple[list[str], list[dict[str, Any]]]:
    """lru+ahead with the live store's admission rule and without (+ahead:all), at the trace's expert size and at the
    inflated model's."""
    m = trace.header.n_total
    lines = ["| experts | pool | look-ahead loads | loads issued | wasted | decode hit rate | predicted tok/s | "
             "threshold at the end |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    rows = []
    inflated = dataclasses.replace(cost, compute_floor=INFLATED_FLOOR)
    sizes = ((trace, cost), (with_expert_bytes(trace, INFLATED_BYTES), inflated))
    for sized, sized_cost in sizes:
        for f in PRICE_FRACTIONS:
            for spec, rule in (("lru+ahead", "that pay"), ("lru+ahead:all", "all")):
                policy = make_policy(spec)
                r = replay(sized, policy, round(f * m), "slots", sized_cost)
                d, least = r.to_dict(), policy.sim.ahead.threshold()
                rows.append({"policy": spec, "fraction": f, "expert_bytes": sized.header.expert_bytes,
                             "threshold": least, **d})  # fmt: skip
                lines.append(f"| {sized.header.expert_bytes / 1e6:.2f} MB | {f:.0%} ({round(f * m)}) | {rule} | "
                             f"{r.decode.prefetched} | {r.decode.prefetch_wasted} | {pct(d['decode_hit_rate'])} | "
                             f"{d['tok_s_aggregate']:.1f} | {least:.2f} |")  # fmt: skip
    return lines, rows


def first_tokens_hit(r: ReplayResult, n: int = 32) -> float:
    sel = r.token_pos < n
    return float(r.token_hits[sel].sum() / max(1, r.token_accesses[sel].sum()))


def warm_table(results: dict[tuple[str, float], ReplayResult]) -> list[str]:
    names = ("planner", "planner:nowarm", "planner:hard", "planner:score", "planner:score:nowarm", "lru")
    lines = ["| pool | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for f in FRACTIONS:
        if ("planner", f) not in results:
            continue
        row = [first_tokens_hit(results[(p, f)]) for p in names]
        lines.append(f"| {f:.0%} | " + " | ".join(pct(x) for x in row) + " |")
    return lines


def bandit_prediction(trace: Trace, fraction: float) -> dict[str, float]:
    """Prediction hit rate on decode tokens: the online bandit (serving arm) against every fixed arm."""
    h = trace.header
    bandit = DecayBandit(h.n_total)
    budget = max(1, round(fraction * h.n_total))
    online, fixed, n = 0.0, np.zeros(len(ARMS)), 0
    for seg in trace.segments():
        flat = token_flat_ids(seg.expert_ids, h.n_experts).reshape(seg.n_tokens, -1)
        serving = bandit.best_arm
        bandit.observe(flat, budget)
        if seg.phase == "decode":
            online += bandit.last_hits[serving]
            fixed += bandit.last_hits
            n += 1
    out = {"online_bandit": online / max(1, n)}
    out.update({f"d={d:g}": float(x / max(1, n)) for d, x in zip(ARMS, fixed, strict=True)})
    return out


def bandit_table(traces: dict[str, Trace]) -> list[str]:
    lines = ["| trace | pool | online bandit | best fixed arm | d=0 (pure recency) |", "|---|---|---|---|---|"]
    for name, trace in traces.items():
        for f in (0.25, 0.5):
            b = bandit_prediction(trace, f)
            fixed = {k: v for k, v in b.items() if k.startswith("d=")}
            best = max(fixed, key=lambda k: fixed[k])
            lines.append(f"| {name} | {f:.0%} | {pct(b['online_bandit'])} | {pct(fixed[best])} ({best}) | "
                         f"{pct(fixed['d=0'])} |")  # fmt: skip
    return lines


def phase_shift_trace(model: Trace) -> Trace:
    h = model.header
    cfg = SynthConfig(n_layers=h.n_layers, n_experts=h.n_experts, top_k=h.top_k, n_requests=4, prefill_tokens=256,
                      prefill_chunk=64, decode_tokens=512, shift_every=96, locality=1.5, seed=7)  # fmt: skip
    return synth_trace(cfg)


def write_doc(sections: list[str]) -> None:
    text = DOC.read_text() if DOC.exists() else f"# Pager results\n\n{BEGIN}\n{END}\n"
    a, b = text.index(BEGIN) + len(BEGIN), text.index(END)
    DOC.write_text(text[:a] + "\n" + "\n".join(sections) + "\n" + text[b:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--trace", default=str(FIXTURES / "default.trc"))
    a = ap.parse_args()
    if a.record:
        record(a.model, Path(a.trace))
    trace = read_trace(a.trace)
    cost = CostModel()
    report = analyze(trace)
    table, results = policy_table(trace, cost)
    shift = phase_shift_trace(trace)
    h = trace.header
    meta = (f"Trace `{Path(a.trace).name}` ({h.model}): {report['overall']['n_requests']} requests, "
            f"{trace.n_tokens} tokens ({report['overall']['n_decode_tokens']} decode), {h.n_layers} MoE layers x "
            f"{h.n_experts} experts, top-{h.top_k}, {h.expert_bytes} bytes per expert; git {git_rev()}. Cost model: "
            f"{cost.bandwidth / 1e9:.2f} GB/s, {cost.latency * 1e6:.0f} us per batched fetch, compute floor "
            f"{cost.compute_floor * 1e3:.2f} ms/token.")  # fmt: skip
    warm_title = "### Warm start: decode hit rate over the first 32 decode tokens of each request"
    bandit_title = "### Decay bandit: prediction hit rate of the top-`pool` experts (decode)"
    price_title = "### Cost-aware look-ahead: the live store's admission rule, at two expert sizes"
    price_lines, price_rows = price_table(trace, cost)
    traces = {"default model": trace, "synthetic, phase shift every 96 tokens": shift}
    sections = [meta, "", "### Coverage", "", *coverage_table(report), "", "### Policies by pool size", "", *table,
                "", warm_title, "", *warm_table(results), "", bandit_title, "", *bandit_table(traces), "",
                price_title, "", *price_lines]  # fmt: skip
    write_doc(sections)
    for (spec, f), r in results.items():
        print(json.dumps({"git": git_rev(), "trace": a.trace, "policy": spec, "fraction": f, **r.to_dict()}))
    for row in price_rows:
        print(json.dumps({"git": git_rev(), "trace": a.trace, "table": "price", **row}))


if __name__ == "__main__":
    main()
