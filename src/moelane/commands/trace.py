"""The `trace` subcommand: `moelane trace record | analyze | replay | synth`.

`add_parser(subparsers)` registers it; every handler takes the parsed args and returns an exit code; bad input
raises `MoelaneError`. `moelane run --trace FILE` uses `recorder.open_recorder(path, lm)`.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moelane.commands.common import (
    MemoryFlag,
    check_output,
    in_flags,
    progress,
    say_written,
    set_threads,
    signals_held,
    terminated_as_interrupt,
)
from moelane.errors import InputError
from moelane.pager.lab.analyze import analyze
from moelane.pager.lab.policies import make_policy
from moelane.pager.lab.replay import DEFAULT_BANDWIDTH, DEFAULT_COMPUTE_FLOOR, DEFAULT_LATENCY, CostModel, replay
from moelane.pager.lab.sweep import default_capacities, sweep
from moelane.pager.live.memory import format_bytes
from moelane.pager.trace import MAX_EXPERTS, Trace, read_trace

log = logging.getLogger(__name__)
SWEEP_POLICIES = ("lru", "lfu", "recent-k", "belady", "ema:0.85", "bandit", "planner", "planner:hard", "planner:score")
AHEAD_POLICIES = ("lru+ahead", "planner+ahead", "planner:score+ahead")  # swept too when the trace has the look-ahead


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("trace", help="record, analyse and replay routing traces")
    sub = p.add_subparsers(dest="trace_command", metavar="COMMAND", required=True)

    rec = sub.add_parser("record", help="record routing traces of prompts run through a model",
                         description="Run each request of a JSONL file through a model (greedy or sampled, EOS "
                         "ignored) and write which experts every token routed to, layer by layer, to a trace file "
                         "(with the next layer's look-ahead predictions where the model's routers allow).")  # fmt: skip
    rec.add_argument("--prompts", required=True, metavar="FILE", help='JSONL, one request a line: {"prompt": ...} '
                     'with optional "max_tokens", "prefill_chunk" and "temperature" overriding the flags')  # fmt: skip
    rec.add_argument("--out", required=True, metavar="FILE", help="trace file to write")
    rec.add_argument("--model", default=None, metavar="PATH",
                     help="model folder or GGUF file (default: the shipped default model)")  # fmt: skip
    rec.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per request (default 64)")
    rec.add_argument("--prefill-chunk", type=int, default=64, help="prompt tokens per prefill pass (default 64)")
    rec.add_argument("--temperature", type=float, default=0.0,
                     help="0: greedy (default); else sampled, request i with seed --seed + i")  # fmt: skip
    rec.add_argument("--seed", type=int, default=0, help="sampling seed of the first request (default 0)")
    rec.add_argument("--threads", type=int, metavar="N", help="compute threads (default: every core; "
                     "OMP_NUM_THREADS if set)")  # fmt: skip
    rec.set_defaults(func=cmd_record)

    an = sub.add_parser("analyze", help="coverage of decode experts by prefill, recency, frequency, oracles",
                        description="How well sets known in advance (the prefill's experts, recent tokens', the "
                        "most used) cover the experts each decode token routes to, per request and overall; the "
                        "co-occurrence and look-ahead predictors' recall; per-layer expert usage.")  # fmt: skip
    an.add_argument("file", metavar="FILE", help="trace file (.trc)")
    an.add_argument("--json", action="store_true", help="print the report as one JSON object")
    an.add_argument("--plot", metavar="OUT.png", help="also draw the coverage to OUT.png (needs matplotlib)")
    an.add_argument("--html", metavar="OUT.html",
                    help="also write the dashboard's pager views of the trace to OUT.html, one self-contained page: "
                    "the planner replayed over it (hit rates, stall and bytes per token, the decay bandit, the plan, "
                    "the pool's experts by layer)")  # fmt: skip
    an.add_argument("--pool", type=float, default=0.5, metavar="F",
                    help="the replay's pool for --html, as a fraction of all experts (default 0.5)")  # fmt: skip
    an.set_defaults(func=cmd_analyze)

    rp = sub.add_parser("replay", help="replay residency policies over a trace",
                        description="Simulate an expert pool of a given size under each policy over a trace: hit "
                        "rates, bytes fetched per token, stall time and tok/s predicted by a simple cost model "
                        "(storage bandwidth, latency per batched fetch, compute per token).")  # fmt: skip
    rp.add_argument("file", metavar="FILE", help="trace file (.trc)")
    rp.add_argument(
        "--policy",
        action="append",
        help="lru, lfu, recent-k[:K], belady, ema:D, bandit, planner[:score][:hard][:nowarm]; append +ahead to "
        "prefetch the look-ahead's predictions that pay for their load, by the live store's rule (+ahead:all: every "
        "prediction; traces recorded with it); repeat the flag for several",
    )
    size = rp.add_mutually_exclusive_group()
    size.add_argument("--slots", type=int, help="pool size in experts")
    size.add_argument("--budget", metavar="X", type=MemoryFlag("--budget"), help="pool size in bytes (512MiB, 2GiB) "
                      "or a share of all expert bytes (25%%), experts at their tier's size")  # fmt: skip
    size.add_argument("--fraction", type=float, help="pool as a fraction of all experts")
    size.add_argument("--sweep", action="store_true", help="hit rate over pool sizes for every policy")
    rp.add_argument("--plan-out", metavar="FILE", help="planner: write each published plan to FILE (atomically)")
    rp.add_argument("--json", action="store_true", help="print one JSON object per policy and pool size")
    rp.add_argument("--plot", metavar="OUT.png", help="also draw the rows to OUT.png (needs matplotlib)")
    rp.add_argument("--bandwidth", type=float, default=DEFAULT_BANDWIDTH,
                    help=f"storage bytes/s (default {DEFAULT_BANDWIDTH:g})")  # fmt: skip
    rp.add_argument("--latency", type=float, default=DEFAULT_LATENCY,
                    help=f"seconds per batched fetch (default {DEFAULT_LATENCY:g})")  # fmt: skip
    rp.add_argument("--compute-floor", type=float, default=DEFAULT_COMPUTE_FLOOR,
                    help=f"seconds of compute per token (default {DEFAULT_COMPUTE_FLOOR:g})")  # fmt: skip
    rp.set_defaults(func=cmd_replay)

    sy = sub.add_parser("synth", help="write a synthetic trace",
                        description="Write a trace of made-up requests: experts drawn with Zipf popularity, a bonus "
                        "for the previous token's experts, optional topic shifts; for trying policies without a "
                        "model.")  # fmt: skip
    sy.add_argument("--out", required=True, metavar="FILE", help="trace file to write")
    for name, default, least, what in SYNTH_INTS:
        sy.add_argument(f"--{name}", type=int, default=default, help=f"{what} (default {default}; >= {least})")
    sy.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of expert popularity (default 1; >= 0)")
    sy.add_argument("--locality", type=float, default=2.0,
                    help="score bonus for the experts the previous token used (default 2; >= 0)")  # fmt: skip
    sy.set_defaults(func=cmd_synth)


# `trace synth` integer flags: name, default, least value, meaning
SYNTH_INTS = (
    ("layers", 8, 1, "MoE layers"), ("experts", 32, 1, f"experts per layer, at most {MAX_EXPERTS}"),
    ("top-k", 4, 1, "experts per token and layer, at most --experts"), ("requests", 4, 1, "requests"),
    ("prefill", 256, 0, "prompt tokens per request"), ("chunk", 64, 1, "prompt tokens per prefill pass"),
    ("decode", 128, 0, "generated tokens per request"), ("shift-every", 0, 0, "tokens between topic shifts, 0: none"),
    ("seed", 0, 0, "random seed"),
)  # fmt: skip


def _load(path: str) -> Trace:
    if Path(path).is_dir():
        raise InputError(f"{path} is a folder, not a trace file")
    if not Path(path).is_file():
        raise InputError(f"no such trace file: {path}")
    try:
        trace = read_trace(path)
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror or e}") from None
    if trace.n_segments == 0:
        raise InputError(f"{path}: the trace holds no whole segment (nothing was recorded, or it was cut short)")
    return trace


def _check_plot(path: str | None) -> None:
    """Before any work: --plot needs matplotlib and a place to write."""
    if path is not None:
        from moelane.pager.lab.plots import _pyplot

        check_output(path, "--plot")
        _pyplot()


def cmd_record(args: argparse.Namespace) -> int:
    import moelane
    from moelane.model.sampling import SamplingParams
    from moelane.pager.live.recorder import TraceRecorder, open_recorder

    temperature, seed = getattr(args, "temperature", 0.0), getattr(args, "seed", 0)
    defaults = {"max_tokens": args.max_tokens, "prefill_chunk": args.prefill_chunk, "temperature": temperature}
    _check_request(defaults, lambda key: "--" + key.replace("_", "-"))  # the flags, then each line, before loading
    requests = _read_prompts(args.prompts, defaults)
    check_output(args.out, "--out")
    set_threads(args)
    lm = moelane.load(args.model, "auto", progress=True)  # as run and serve compute by default
    prompts = _encode_prompts(lm, args.prompts, requests)  # (every prompt fits, before anything is recorded)
    # Every token a pass routes: each prompt's, then each reply token's but the last (the first comes from the
    # prefill's logits, the last is never fed back).
    total = sum(len(ids) + max(0, min(req["max_tokens"], lm.max_context - len(ids)) - 1)
                for (_, req), ids in zip(requests, prompts, strict=True))  # fmt: skip
    done, counter = 0, PassCounter()
    recorder: TraceRecorder | None = None
    with terminated_as_interrupt():
        try:
            with open_recorder(args.out, lm, model=args.model or "default") as recorder, \
                    progress(total, "recording", "tok") as counter.bar:  # fmt: skip
                lm.observers.append(counter)  # (after the recorder: a pass is counted once it is written)
                try:
                    for i, ((_, req), ids) in enumerate(zip(requests, prompts, strict=True)):
                        recorder.stream = i
                        n, chunk, t = req["max_tokens"], req["prefill_chunk"], req["temperature"]
                        params = SamplingParams(t, 0.95, 0, seed + i) if t else SamplingParams()
                        sum(1 for _ in lm.generate_ids(ids, n, params, prefill_chunk=chunk, stop_ids=frozenset()))
                        done = i + 1
                finally:
                    lm.observers.remove(counter)
        except BaseException:  # (Ctrl-C or SIGTERM, or a failure: what was recorded stays, and the user is told so)
            if recorder is not None and recorder.n_segments:
                log.warning("recording stopped after %d of %d requests: %s keeps the %d segments recorded so far",
                            done, len(requests), args.out, recorder.n_segments)  # fmt: skip
            raise
    say_written(args.out, len(requests), recorder.n_segments, counter.tokens)
    return 0


class PassCounter:
    """An observer of a model's passes that counts their tokens and moves a progress bar by them."""

    def __init__(self) -> None:
        self.bar: Any = None
        self.tokens = 0

    def observe(self, record: Any) -> None:
        n = int(record.expert_ids.shape[1])  # ([layers, tokens, top-k])
        self.tokens += n
        with signals_held():  # (a bar cut mid-line by Ctrl-C would not be cleared)
            self.bar.update(n)


def _encode_prompts(lm: Any, path: str, requests: list[tuple[int, dict[str, Any]]]) -> list[list[int]]:
    """Each request's prompt ids, or InputError naming the line of one that does not fit the model's context. A
    reply the context cuts short is said once."""
    from moelane.model.lm import token_id_list

    out, cut = [], 0
    for no, req in requests:
        try:
            ids = lm.tokenizer.encode_prompt(req["prompt"], lm.max_context)
            token_id_list(ids, lm.vocab_size, lm.max_context)
        except InputError as e:
            raise InputError(f"{path} line {no}: {e}") from None
        cut += len(ids) + req["max_tokens"] > lm.max_context
        out.append(ids)
    if cut:
        log.warning("%d of %d requests record fewer tokens than max_tokens: their prompts leave less of the model's "
                    "context of %d", cut, len(requests), lm.max_context)  # fmt: skip
    return out


def _read_prompts(path: str, defaults: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """The requests of a JSONL file with their line numbers, each with every setting (the flags' `defaults` where a
    line has none)."""
    if Path(path).is_dir():
        raise InputError(f"--prompts {path} is a folder; give a JSONL file")
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read prompts from {path}: {getattr(e, 'strerror', None) or e}") from None
    requests = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            req = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path} line {no}: not JSON ({e})") from None
        if not isinstance(req, dict) or not isinstance(req.get("prompt"), str) or not req["prompt"]:
            raise InputError(f'{path} line {no}: must be a JSON object with a non-empty "prompt" string')
        requests.append((no, _check_request({**defaults, **req}, functools.partial("{} line {}: {}".format, path, no))))
    if not requests:
        raise InputError(f"{path} holds no request (one JSON object a line)")
    return requests


def _check_request(req: dict[str, Any], name: Callable[[str], str]) -> dict[str, Any]:
    """`req` if its settings can be run, else InputError naming the setting as `name(key)` says it."""
    for key in ("max_tokens", "prefill_chunk"):
        if isinstance(n := req[key], bool) or not isinstance(n, int) or n < 1:
            raise InputError(f"{name(key)} must be an integer >= 1, got {n!r}")
    if isinstance(t := req["temperature"], bool) or not isinstance(t, int | float) or not (math.isfinite(t) and t >= 0):
        raise InputError(f"{name('temperature')} must be a finite number >= 0, got {t!r}")
    return req


def cmd_analyze(args: argparse.Namespace) -> int:
    _check_plot(args.plot)
    if args.html:
        check_output(args.html, "--html")
        if not 0 < args.pool <= 1:
            raise InputError(f"--pool must be in (0, 1], got {args.pool}")
    trace = _load(args.file)
    if args.html:
        write_html(trace, args.file, args.pool, args.html)
    report = analyze(trace)
    if args.plot:
        from moelane.pager.lab.plots import plot_analysis

        plot_analysis(report, args.plot)
    if args.json:
        json.dump(report, sys.stdout)
        sys.stdout.write("\n")
        return 0
    sys.stdout.write(format_analysis(report))
    return 0


def write_html(trace: Trace, name: str, pool: float, out: str) -> None:
    """The dashboard's pager views of `trace` (the planner replayed with a pool of `pool` of its experts) as one
    self-contained page at `out`."""
    from moelane.pager.lab.report import trace_views
    from moelane.server.dashboard import report_html

    capacity = max(1, round(pool * trace.header.n_total))
    page = report_html(trace_views(trace, capacity), f"moelane trace {Path(name).name}")
    Path(out).write_text(page, encoding="utf-8")
    log.info("wrote the trace's pager views to %s (pool of %d of %d experts)", out, capacity, trace.header.n_total)


def format_analysis(report: dict[str, Any]) -> str:
    o = report["overall"]
    lines = [
        f"{o['n_requests']} requests, {o['n_decode_tokens']} decode tokens",
        f"{'set':<16}{'coverage':>10}{'size':>10}",
    ]
    for name, v in o["coverage"].items():
        lines.append(f"{name:<16}{v['coverage']:>10.1%}{v['size']:>10.1f}")
    for name, key in (("co-occurrence", "predictors"), ("look-ahead", "lookahead")):
        if (p := o.get(key)) is not None:
            lines.append(
                f"{name} predictor: repeat recall {p['repeat_recall']:.1%}, delta recall {p['delta_recall']:.1%}, "
                f"schedulable coverage {p['schedulable_coverage']:.1%}"
            )
    for r in report["requests"]:
        c = r["coverage"]
        lines.append(
            f"stream {r['stream']}: {r['n_prefill_tokens']} prefill / {r['n_decode_tokens']} decode tokens; union "
            f"{c['prefill_union']['coverage']:.1%}, tail {c['prefill_tail']['coverage']:.1%}, recency "
            f"{c['decode_recency']['coverage']:.1%}, last1 {c['last_1']['coverage']:.1%}"
        )
    return "\n".join(lines) + "\n"


def _capacity(args: argparse.Namespace, trace: Trace) -> tuple[int, str]:
    h = trace.header
    if args.slots is not None:
        if not 1 <= args.slots <= h.n_total:
            raise InputError(f"--slots must be from 1 to the trace's {h.n_total} experts, got {args.slots}")
        return args.slots, "slots"
    if args.budget is not None:
        budget = args.budget.resolve(h.n_total * h.expert_bytes)
        if budget < h.expert_bytes:
            raise InputError(f"--budget of {budget} bytes holds no expert ({h.expert_bytes} bytes each)")
        return budget, "bytes"
    if args.fraction is not None:
        if not 0 < args.fraction <= 1:
            raise InputError(f"--fraction must be in (0, 1], got {args.fraction}")
        return max(1, round(args.fraction * trace.header.n_total)), "slots"
    raise InputError("give a pool size: --slots N, --budget BYTES or --fraction F (or --sweep)")


def cmd_replay(args: argparse.Namespace) -> int:
    with in_flags(frozenset({"bandwidth", "latency", "compute_floor"})):
        cost = CostModel(args.bandwidth, args.latency, args.compute_floor)
    if args.plan_out:
        if not all(p.startswith("planner") for p in args.policy or ["planner"]) or args.sweep:
            raise InputError("--plan-out writes the planner's plans: give it with planner policies only, no --sweep")
        check_output(args.plan_out, "--plan-out")
    _check_plot(args.plot)
    trace = _load(args.file)
    if args.sweep:
        default = SWEEP_POLICIES + (AHEAD_POLICIES if trace.lookahead is not None else ())
        rows = sweep(trace, list(args.policy or default), default_capacities(trace), cost)
    else:
        capacity, unit = _capacity(args, trace)
        specs = args.policy or ["planner"]
        share = capacity / (trace.header.n_total * (trace.header.expert_bytes if unit == "bytes" else 1))
        rows = [{**replay(trace, make_policy(p, plan_path=args.plan_out), capacity, unit, cost).to_dict(),
                 "fraction": share} for p in specs]  # fmt: skip
    if args.plot:
        from moelane.pager.lab.plots import plot_sweep

        plot_sweep(rows, args.plot)
    if args.json:
        for row in rows:
            sys.stdout.write(json.dumps(row) + "\n")
        return 0
    sys.stdout.write(format_rows(rows, trace.header.expert_bytes))
    return 0


def format_rows(rows: list[dict[str, Any]], expert_bytes: int) -> str:
    """The replay's rows as a table; the pool in slots (experts) and in bytes (experts at their full size), whichever
    of them it was given in."""
    head = (f"{'policy':<22}{'pool:slots':>11}{'pool:bytes':>11}{'hit(dec)':>10}{'hit(pre)':>10}{'MB/tok':>9}"
            f"{'stall ms':>10}{'tok/s':>8}")  # fmt: skip
    out = [head]
    for r in rows:
        n = max(1, r["decode"]["n_tokens"])
        slots, size = r["capacity"], r["capacity"] * expert_bytes
        if r["unit"] == "bytes":
            slots, size = r["capacity"] // expert_bytes, r["capacity"]
        out.append(
            f"{r['policy']:<22}{slots:>11}{format_bytes(size).replace(' ', ''):>11}{rate(r['decode']):>10}"
            f"{rate(r['prefill']):>10}{r['decode_bytes_per_token'] / 1e6:>9.2f}"
            f"{r['decode']['stall_s'] / n * 1e3:>10.2f}{r['tok_s_aggregate']:>8.1f}"
        )
    return "\n".join(out) + "\n"


def rate(phase: dict[str, Any]) -> str:
    """A phase's hit rate for the table; "-" where it had no accesses (a trace without prefill)."""
    return f"{phase['hit_rate']:.1%}" if phase["accesses"] else "-"


def cmd_synth(args: argparse.Namespace) -> int:
    from moelane.pager.lab.synth import SynthConfig, synth_segments
    from moelane.pager.trace import TraceWriter

    for name, _, least, _ in SYNTH_INTS:
        if (value := getattr(args, name.replace("-", "_"))) < least:
            raise InputError(f"--{name} must be >= {least}, got {value}")
    if args.experts > MAX_EXPERTS:
        raise InputError(f"--experts must be at most {MAX_EXPERTS} (a trace stores 16-bit ids), got {args.experts}")
    if args.top_k > args.experts:
        raise InputError(f"--top-k must be at most --experts ({args.experts}), got {args.top_k}")
    with in_flags(frozenset({"skew", "locality"})):
        cfg = SynthConfig(
            n_layers=args.layers, n_experts=args.experts, top_k=args.top_k, n_requests=args.requests,
            prefill_tokens=args.prefill, prefill_chunk=args.chunk, decode_tokens=args.decode, skew=args.skew,
            locality=args.locality, shift_every=args.shift_every, seed=args.seed,
        )  # fmt: skip
    check_output(args.out, "--out")
    written, tokens, done = 0, 0, 0
    total = cfg.n_requests * (cfg.prefill_tokens + cfg.decode_tokens)
    with terminated_as_interrupt():
        try:
            with TraceWriter(args.out, cfg.header()) as writer, progress(total, "writing", "tok") as bar:
                for seg in synth_segments(cfg):
                    done = int(seg.stream_ids[0])  # (the requests before this segment's are whole)
                    with signals_held():  # (a segment and its count together; the bar never cut mid-line)
                        writer.write_segment(seg.expert_ids, seg.weights, seg.phase, seg.stream_ids)
                        written, tokens = written + 1, tokens + seg.n_tokens
                        bar.update(seg.n_tokens)
        except BaseException:  # (Ctrl-C or SIGTERM, or a failure: what was written stays, and the user is told so)
            if written:
                log.warning("writing stopped after %d of %d requests: %s keeps the %d segments written so far",
                            done, cfg.n_requests, args.out, written)  # fmt: skip
            raise
    say_written(args.out, cfg.n_requests, written, tokens)
    return 0
