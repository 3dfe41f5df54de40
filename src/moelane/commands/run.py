"""`moelane run`: one prompt's reply, streamed to stdout (its reasoning, where the model writes some, to stderr), with
a summary line of tokens and speeds on stderr. One-token steps, or the lanes engine with one stream when drafting.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from moelane.commands.common import add_model_args, check_output, in_flags, load_model, paged
from moelane.errors import InputError, MoelaneError

log = logging.getLogger("moelane")

# Measured on the shipped model (2 cores): eager decode 93-151 tok/s, compiled 480-770, warm-up 10 s (cached) to 60 s
# (cold): compiling pays from about a thousand tokens.
COMPILE_PAYS_TOKENS = 1024
DEMO = "14M-parameter demo model"


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("run", help="generate a reply to one prompt, streamed to stdout (without --model: a demo "
                       "model that continues code, not a chat model)",
                       description="Generate a reply to PROMPT and stream it to stdout; a summary line (tokens, "
                       "prefill and decode speed) goes to stderr. Without --model it runs the shipped model: a "
                       f"{DEMO}, there to show the engine at work, not a chat model. It continues code well (it was "
                       "trained on Python's standard library, Shakespeare and Vim's help): try "
                       "'def fibonacci(n):'. For real replies give --model a Hugging Face MoE folder (Qwen3-30B-A3B, "
                       "say).")  # fmt: skip
    p.add_argument("prompt", metavar="PROMPT", help="the prompt text ('-' reads it from stdin)")
    add_model_args(p)
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default 0: off)")
    p.add_argument("--seed", type=int, help="seed for sampling (default: random)")
    p.add_argument("--presence-penalty", type=float, default=0.0, metavar="X",
                   help="subtract X (-2..2) from the logit of each token the reply holds (default 0)")  # fmt: skip
    p.add_argument("--frequency-penalty", type=float, default=0.0, metavar="X",
                   help="subtract X (-2..2) once per time the reply holds a token (default 0)")  # fmt: skip
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS (-100..100) to the logit of token ID; -100 bans it (repeatable)")  # fmt: skip
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop before this text (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template (a reply with "
                   "reasoning, as gpt-oss, Qwen3 and DeepSeek-R1 write: the answer on stdout, the reasoning on "
                   "stderr)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="hold the reply to JSON, token by token: a JSON object (with "
                   "--chat the model answers at once, without reasoning first)")  # fmt: skip
    p.add_argument("--json-schema", metavar="SCHEMA", help="hold the reply to JSON that this JSON schema accepts: "
                   "the schema's text, or a file that holds it (implies --json)")  # fmt: skip
    how = p.add_mutually_exclusive_group()
    how.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                     help="compile the decode step with torch.compile: decode runs several times faster after a "
                     f"warm-up of 10-40 s (graphs are cached for later runs); auto: on for --max-tokens >= "
                     f"{COMPILE_PAYS_TOKENS} with all experts resident, where the warm-up pays (default)")  # fmt: skip
    how.add_argument("--eager", dest="compile", action="store_const", const="off",
                     help="run every pass eagerly, never compiled (for debugging; same as --compile off)")  # fmt: skip
    p.add_argument("--drafter", choices=("auto", "none", "copy", "model"), default="auto",
                   help="draft tokens and verify them several at a time, through the lanes engine with one stream "
                   "(the reply is the same, token for token): copy drafts from the prompt and the reply so far "
                   "(edits, quotes, code, a reply that repeats itself; often 2-3x faster there), model from the "
                   "shipped draft model (compiled unless --eager), none one token a step. Default auto: copy, or "
                   "none with --trace")  # fmt: skip
    p.add_argument("--trace", metavar="FILE", help="record the routing trace of this run to FILE")
    p.add_argument("--stats", action="store_true", help="print the expert pager's statistics to stderr")
    p.set_defaults(func=cmd_run)


def read_prompt(arg: str) -> str:
    """The prompt text: the argument, or standard input for '-'. Bytes that are not UTF-8 (which Python hands over
    as lone surrogates) become U+FFFD, as a text editor would show them."""
    if arg == "-":
        if sys.stdin.isatty():  # (else the wait for typed text would look like a hang)
            print("reading the prompt from standard input; end it with Ctrl-D", file=sys.stderr, flush=True)
        return sys.stdin.buffer.read().decode("utf-8", "replace")
    try:
        return arg.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # a surrogate that no byte stands for: the tokenizer says so
        return arg


def json_schema(arg: str | None) -> dict[str, object] | bool | None:
    """`--json-schema`'s schema: the JSON text given, or that of the file it names."""
    if arg is None:
        return None
    text = arg
    if not arg.lstrip().startswith("{") and Path(arg).is_file():
        try:
            text = Path(arg).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"--json-schema: cannot read {arg}: {e}") from None
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise InputError(f"--json-schema takes a JSON schema or a file that holds one; this is neither: {e}") from None
    if not isinstance(schema, dict | bool):
        raise InputError(f"--json-schema must be a JSON object (or true or false), got {type(schema).__name__}")
    return schema


def logit_bias(entries: list[str]) -> tuple[tuple[int, float], ...]:
    """`--logit-bias ID=BIAS` entries as (token id, bias) pairs."""
    pairs = []
    for entry in entries:
        token, _, bias = entry.partition("=")  # (no "=": an empty bias, refused)
        try:
            pairs.append((int(token), float(bias)))
        except ValueError:
            raise InputError(f"--logit-bias takes ID=BIAS (a token id and a number), got {entry!r}") from None
    return tuple(pairs)


RUN_FLAGS = frozenset({"temperature", "top_p", "top_k", "logit_bias", "presence_penalty", "frequency_penalty"})


def cmd_run(args: argparse.Namespace) -> int:
    from moelane.model.lm import sampling_params

    prompt = read_prompt(args.prompt)
    if args.max_tokens < 1:  # (before the model loads)
        raise InputError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.seed is not None and not -(2**63) <= args.seed < 2**63:  # (as the server: OpenAI's int64 seeds)
        raise InputError(f"--seed must be a 64-bit integer, from -2**63 to 2**63 - 1, got {args.seed}")
    if args.drafter == "auto":  # drafts verified by the model cost little where none lands, and often pay
        args.drafter = "none" if args.trace else "copy"
    if args.trace:
        if args.drafter != "none":  # (drafted rows that are rejected would be in it as tokens)
            raise InputError("--trace records one token a step: it does not apply with --drafter")
        check_output(args.trace, "--trace")
    with in_flags(RUN_FLAGS):
        params = sampling_params(args.temperature, args.top_p, args.top_k, args.seed,
                                 logit_bias=logit_bias(args.logit_bias), presence_penalty=args.presence_penalty,
                                 frequency_penalty=args.frequency_penalty)  # fmt: skip
    args.schema = json_schema(args.json_schema)
    if args.json_schema is not None:
        args.json = True
    lm = load_model(args, compile=args.compile == "on")  # (a store's hooks are set up for a compiled step)
    try:
        return run_loaded(lm, args, prompt, params)
    finally:
        lm.close()  # an expert store's threads end before the interpreter does (else it may abort at exit)


def run_loaded(lm, args: argparse.Namespace, prompt: str, params) -> int:  # type: ignore[no-untyped-def]
    from moelane.model.reasoning import ANSWER, REASONING, Channels, Openings, answer_opening, splitter_for
    from moelane.model.tokenizer import Detokenizer, StopFilter

    with in_flags(RUN_FLAGS):
        params.check_vocab(lm.vocab_size)
    opening = ""  # what a chat prompt ends with for the reply to be the answer at once (JSON: no reasoning first)
    if args.chat:
        if args.model is None:  # (its chat replies read as noise: say why before them)
            print(f"note: the shipped model is a {DEMO} that continues code and plays; it does not chat. Give --model "
                  "a real model's folder for answers.", file=sys.stderr, flush=True)  # fmt: skip
        prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        opening = answer_opening(lm.tokenizer, prompt) if args.json else ""
    if args.json:
        params = dataclasses.replace(params, grammar=reply_grammar(lm, args.schema))
    prompt_ids = lm.tokenizer.encode_prompt(prompt + opening, lm.max_context)
    room = lm.max_context - len(prompt_ids)  # (none: the model refuses the prompt, in one line)
    if 0 < room < args.max_tokens:
        log.warning("the reply can have at most %d tokens, not --max-tokens %d: the prompt's %d tokens leave that "
                    "much of the model's context of %d", room, args.max_tokens, len(prompt_ids),
                    lm.max_context)  # fmt: skip
    # auto: compile where it pays, for all-resident experts; the reply the context leaves room for decides, not
    # what was asked
    long_reply = min(args.max_tokens, room) >= COMPILE_PAYS_TOKENS
    if args.compile == "auto" and long_reply and not paged(lm):
        lm.enable_compile()
    if lm.compile_enabled:
        print("compiling the decode step (the first run takes a while; later runs use the cache)...",
              file=sys.stderr, flush=True)  # fmt: skip
        lm.warm_up(len(prompt_ids), args.max_tokens)
    detok, stops = Detokenizer(lm.tokenizer), StopFilter(args.stop)
    # a chat reply with reasoning (gpt-oss's channels, <think> tags): the answer on stdout, the reasoning on stderr
    # (without the whitespace that opens each part, as the server sends them)
    splitter, thoughts = splitter_for(lm.tokenizer, prompt_ids) if args.chat else None, Detokenizer(lm.tokenizer)
    if isinstance(splitter, Channels):  # harmony's: the opening starts the reply's answer message
        for token in lm.tokenizer.encode(opening):
            splitter.push(token)
    openings = Openings()

    def answer(text: str) -> str:
        return text if splitter is None else openings.trim(ANSWER, text)

    thought = False
    tokens = generate(lm, prompt_ids, args, params)
    t0 = time.perf_counter()
    t_first, disk_first = 0.0, 0
    reply: list[int] = []
    with contextlib.ExitStack() as stack:
        if args.trace:
            stack.enter_context(open_trace(args.trace, lm))
        for token in tokens:
            if not reply:
                t_first, disk_first = time.perf_counter(), disk_read(lm)
            reply.append(token)
            part = ANSWER if splitter is None else splitter.push(token)
            if part != ANSWER:
                if part is not None:
                    thought = True
                    sys.stderr.write(openings.trim(REASONING, thoughts.push([token])))
                    sys.stderr.flush()
                continue
            sys.stdout.write(stops.push(answer(detok.push([token]))))
            sys.stdout.flush()
            if stops.stopped:
                break
        if thought:
            sys.stderr.write(openings.trim(REASONING, thoughts.flush()) + "\n")
        sys.stdout.write(stops.push(answer(detok.flush())) + stops.flush() + "\n")  # a cut-off character: U+FFFD
    t_end = time.perf_counter()
    n_new = len(reply)
    prefill = len(prompt_ids) / (t_first - t0) if n_new else 0.0
    decode = (n_new - 1) / (t_end - t_first) if n_new > 1 else 0.0
    why = ended(stops.stopped, n_new, args.max_tokens, room)
    if params.grammar is not None and why in CUT and not params.grammar.complete(reply):
        log.warning("reply cut %s before the JSON was complete", CUT[why])
    print(f"prompt {len(prompt_ids)} tokens, {n_new} new tokens ({why}), prefill {prefill:.1f} tok/s, "
          f"decode {decode:.1f} tok/s", file=sys.stderr)  # fmt: skip
    if args.stats:
        print_stats(lm, (disk_read(lm) - disk_first, max(0, n_new - 1)))
    return 0


def reply_grammar(lm, schema: dict[str, object] | bool | None):  # type: ignore[no-untyped-def]
    """What `--json` holds the reply to: JSON that `schema` accepts (None: any JSON object)."""
    from moelane.model.grammar import Grammar, json_grammar

    try:
        text = json_grammar(schema)
    except InputError as e:
        raise InputError(f"--json-schema: {e}") from None
    return Grammar.for_lm(lm, text)


# the summary's reasons that cut a reply short, as the line that says a reply held to JSON was cut says them
CUT = {"--max-tokens": "at --max-tokens", "context full": "at the end of the model's context"}


def ended(stopped: bool, n_new: int, max_tokens: int, room: int) -> str:
    """Why the reply ended, in the summary line's words."""
    if stopped:
        return "stop text"
    if n_new >= room:
        return "context full"
    return "--max-tokens" if n_new >= max_tokens else "end of text"


def generate(lm, prompt_ids: list[int], args: argparse.Namespace, params) -> Iterator[int]:  # type: ignore[no-untyped-def]
    """The reply's tokens as they come: one-token steps, or (`--drafter`) rounds of the lanes engine with one stream,
    which verify drafts several at a time and commit the very same tokens. The engine (its price calibration, a
    draft model's compiling) is set up here, before the first token is asked for."""
    if args.drafter == "none":
        return lm.generate_ids(prompt_ids, args.max_tokens, params)  # type: ignore[no-any-return]
    from moelane.lanes.config import EngineConfig
    from moelane.lanes.engine import Engine
    from moelane.lanes.request import submit_kwargs

    config = EngineConfig(drafter=args.drafter, max_streams=1, prefill_chunk=lm.prefill_chunk,
                          compile_draft=args.compile != "off")  # fmt: skip
    if config.drafter == "model" and config.compile_draft:
        print("compiling the draft model's decode step (the first run takes a while; later runs use the cache)...",
              file=sys.stderr, flush=True)  # fmt: skip
    engine = Engine(lm, config)
    # A failed round is logged with its traceback for a server's operator; here the error is said once, by `rounds`.
    logging.getLogger("moelane.lanes.engine").setLevel(logging.DEBUG if args.verbose else logging.CRITICAL)
    stream = engine.submit(prompt_ids, args.max_tokens, **submit_kwargs(params))
    return rounds(engine, stream)


def rounds(engine, stream) -> Iterator[int]:  # type: ignore[no-untyped-def]
    """`stream`'s tokens as the engine's rounds commit them (this thread runs the rounds)."""
    seen = 0
    while engine.step():
        while seen < len(stream.token_ids):
            seen += 1
            yield stream.token_ids[seen - 1]
    if isinstance(stream.error, MoelaneError):
        raise stream.error
    if stream.error is not None:
        raise MoelaneError(f"generation failed: {stream.error}")


def open_trace(path: str, lm):  # type: ignore[no-untyped-def]
    from moelane.pager.live.recorder import open_recorder

    return open_recorder(path, lm)


def print_stats(lm, decoded: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    """`--stats`: the memory limit and budget, the pager's counters, and `decoded` (disk bytes read after the first
    token, tokens after it)."""
    from moelane.pager.live.build import format_stats

    describe = getattr(lm.provider, "describe", None)  # (a distributed run's: its ranks, then rank 0's own store)
    print(describe() if describe is not None else format_stats(lm.provider, lm.memory, decoded), file=sys.stderr)


def disk_read(lm) -> int:  # type: ignore[no-untyped-def]
    """Bytes the model's expert store has read from disk so far."""
    from moelane.pager.live.build import disk_bytes

    return disk_bytes(lm.provider)
