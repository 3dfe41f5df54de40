"""The command line against bad and odd input: one line on stderr naming the problem (and the flag), exit code 2, no
traceback, no output file clobbered; and `--help` that explains every flag. Most cases are refused before a model
loads; the rest load the shipped model."""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import struct
from pathlib import Path

import pytest

from moelane.assets import default_model_path
from moelane.commands import build_parser, main
from moelane.commands.run import read_prompt
from moelane.pager.trace import TraceWriter, read_trace, write_trace

from .pager.helpers import small_trace

TRACE = Path(__file__).parent / "fixtures" / "traces" / "default.trc"


def cli_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one error line of a refused command (argparse's errors included)."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    lines = [line.rsplit("\r", 1)[-1] for line in err.split("\n")]  # (a progress bar redraws itself with \r)
    lines = [line for line in lines if line.strip()]
    assert code == 2 and len(lines) == 1 and ": error: " in lines[0] and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A folder of links to the shipped model's files, to break one at a time."""
    folder = tmp_path / "model"
    folder.mkdir()
    for f in default_model_path().iterdir():
        (folder / f.name).symlink_to(f)
    return folder


# ---- argparse's own errors ------------------------------------------------------------------------------------


def test_parser_errors_are_one_line_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--max-tokens: invalid int value: 'abc'" in cli_error(["run", "--max-tokens", "abc", "hi"], capsys)
    assert "required: COMMAND" in cli_error(["trace"], capsys)  # (was the internal name trace_command)
    assert "not allowed with argument --sweep" in cli_error(
        ["trace", "replay", str(TRACE), "--sweep", "--slots", "9"], capsys
    )
    assert "prompt of several words goes in quotes" in cli_error(["run", "hi", "there"], capsys)
    assert "quotes" not in cli_error(["trace", "synth", "--out", "x.trc", "extra"], capsys)
    # --eager is --compile off: with --compile as well, one of them would be dropped without a word
    both = ["run", "--compile", "on", "--eager", "hi"]
    assert "--eager: not allowed with argument --compile" in cli_error(both, capsys)
    assert "--compile: not allowed with argument --eager" in cli_error(["serve", "--eager", "--compile", "on"], capsys)


def test_every_flag_is_explained_by_help() -> None:
    parser = build_parser()
    commands = {"run": None, "bench": None, "trace": ("record", "analyze", "replay", "synth")}
    top = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, subs in commands.items():
        parsers = [top.choices[name]]
        if subs:
            inner = next(a for a in parsers[0]._actions if isinstance(a, argparse._SubParsersAction))
            parsers = [inner.choices[s] for s in subs]
        for p in parsers:
            for action in p._actions:
                assert action.help, f"{p.prog} {action.option_strings or action.dest} has no help"


# ---- run ------------------------------------------------------------------------------------------------------


def test_run_refuses_impossible_settings_before_loading(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "--threads must be at most" in cli_error(["run", "--threads", "100000", "hi"], capsys)  # (was a segfault)
    assert "--temperature must be a finite number" in cli_error(["run", "--temperature", "inf", "hi"], capsys)
    assert "--seed must be a 64-bit integer" in cli_error(["run", "--seed", str(2**64), "hi"], capsys)  # (wrapped)
    assert "--pager-policy" in cli_error(["run", "--pager-policy", "lru", "hi"], capsys)  # (was silently ignored)
    assert "no such folder" in cli_error(["run", "--trace", str(tmp_path / "no" / "t.trc"), "hi"], capsys)
    assert "is a folder" in cli_error(["run", "--trace", str(tmp_path), "hi"], capsys)


def test_run_keeps_an_earlier_trace_when_it_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.trc"
    trace.write_text("an earlier trace")
    assert "empty prompt" in cli_error(["run", "--trace", str(trace), "--max-tokens", "2", ""], capsys)
    assert trace.read_text() == "an earlier trace" and os.listdir(tmp_path) == ["t.trc"]


def test_run_says_it_waits_for_a_prompt_typed_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    class Terminal(io.TextIOWrapper):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stdin", Terminal(io.BytesIO("déjà vu".encode())))
    assert read_prompt("-") == "déjà vu" and "reading the prompt from standard input" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"piped")))
    assert read_prompt("-") == "piped" and capsys.readouterr().err == ""


def test_broken_model_folders_are_one_line(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = ["run", "--model", str(model), "--max-tokens", "2", "hi"]
    (model / "tokenizer_config.json").unlink()
    (model / "tokenizer_config.json").write_text("[]")
    assert "tokenizer_config.json must hold a JSON object" in cli_error(run, capsys)
    (model / "tokenizer_config.json").write_text("{}")
    (model / "model.safetensors").unlink()
    (model / "model.safetensors").mkdir()
    assert "no *.safetensors weights" in cli_error(run, capsys)
    file = tmp_path / "file"
    file.write_text("")
    assert "is a file, not a folder" in cli_error(["run", "--model", str(file), "hi"], capsys)


def test_eos_ids_that_are_not_ids_are_one_line(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").unlink()
    (model / "config.json").write_text(json.dumps({**config, "eos_token_id": ["x"]}))
    (model / "generation_config.json").unlink()
    assert "eos_token_id must be" in cli_error(["run", "--model", str(model), "hi"], capsys)


# ---- trace ----------------------------------------------------------------------------------------------------


def test_trace_files_that_hold_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "is a folder" in cli_error(["trace", "analyze", str(tmp_path)], capsys)
    data = TRACE.read_bytes()
    header_only = tmp_path / "h.trc"
    header_only.write_bytes(data[: 12 + struct.unpack("<I", data[8:12])[0]])
    for argv in (["analyze"], ["replay", "--sweep"], ["replay", "--slots", "100000"]):  # (replay said 100% hits)
        cmd, *flags = argv
        assert "holds no whole segment" in cli_error(["trace", cmd, str(header_only), *flags], capsys)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--bandwidth", "nan"], "--bandwidth must be a finite number > 0"),
        (["--latency", "nan"], "--latency must be a finite number >= 0"),
        (["--compute-floor", "inf"], "--compute-floor must be a finite number >= 0"),
        (["--policy", "recent-k:-1"], "recent-k:K takes K >= 1"),
        (["--plan-out", "/nonexistent/p.json"], "--plan-out /nonexistent/p.json: no such folder"),
    ],
)
def test_replay_refuses_settings_that_give_nan_or_crash(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in cli_error(["trace", "replay", str(TRACE), "--fraction", "0.5", *flags], capsys)


@pytest.mark.parametrize(
    ("line", "flags", "message"),
    [
        ('{"prompt": "hi", "max_tokens": "x"}', [], "line 1: max_tokens must be an integer >= 1, got 'x'"),
        ('{"prompt": "hi", "temperature": -1}', [], "line 1: temperature must be a finite number >= 0"),
        ('{"prompt": "hi", "prefill_chunk": 0}', [], "line 1: prefill_chunk must be an integer >= 1"),
        ('{"prompt": ""}', [], 'line 1: must be a JSON object with a non-empty "prompt"'),
        ("{bad", [], "line 1: not JSON"),
        ('{"prompt": "hi"}', ["--prefill-chunk", "-1"], "--prefill-chunk must be an integer >= 1"),
        ('{"prompt": "hi"}', ["--temperature", "nan"], "--temperature must be a finite number >= 0"),
        ('{"prompt": "hi"}', ["--out", "/nonexistent/t.trc"], "--out /nonexistent/t.trc: no such folder"),
        ('{"prompt": "hi"}', ["--threads", "0"], "--threads must be at least 1"),
    ],
)
def test_record_checks_every_request_before_loading(
    line: str, flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(line + "\n")
    out = tmp_path / "t.trc"
    out.write_text("an earlier trace")
    assert message in cli_error(["trace", "record", "--prompts", str(prompts), "--out", str(out), *flags], capsys)
    assert out.read_text() == "an earlier trace"


def test_record_refuses_prompts_that_are_not_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'\xff\xfe{"prompt": "hi"}\n')
    out = str(tmp_path / "t.trc")
    assert "cannot read prompts" in cli_error(["trace", "record", "--prompts", str(prompts), "--out", out], capsys)
    assert "is a folder" in cli_error(["trace", "record", "--prompts", str(tmp_path), "--out", out], capsys)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--seed", "-1"], "--seed must be >= 0"),
        (["--skew", "nan"], "--skew must be a finite number >= 0"),
        (["--locality", "inf"], "--locality must be a finite number >= 0"),
        (["--layers", "0"], "--layers must be >= 1"),
        (["--top-k", "99"], "--top-k must be at most --experts (32)"),
    ],
)
def test_synth_names_the_flag(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in cli_error(["trace", "synth", "--out", str(tmp_path / "s.trc"), *flags], capsys)


def test_synth_into_a_folder_or_nowhere(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "is a folder" in cli_error(["trace", "synth", "--out", str(tmp_path)], capsys)
    assert "no such folder" in cli_error(["trace", "synth", "--out", str(tmp_path / "no" / "s.trc")], capsys)


def test_a_trace_writer_that_fails_before_recording_leaves_the_earlier_file(tmp_path: Path) -> None:
    """A run that fails before its first segment leaves an earlier trace as it was; one that fails later keeps what
    it recorded (as a crash would: the trace reads back to its last whole segment)."""
    path = tmp_path / "t.trc"
    write_trace(path, small_trace(0))
    before = path.read_bytes()
    t = small_trace(1)
    with pytest.raises(RuntimeError), TraceWriter(path, t.header):
        raise RuntimeError("the run failed")
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["t.trc"]
    with pytest.raises(RuntimeError), TraceWriter(path, t.header) as w:
        seg = t.segment(0)
        w.write_segment(seg.expert_ids, seg.weights, seg.phase, seg.stream_ids)
        raise RuntimeError("the run failed")
    assert read_trace(path).n_segments == 1
    with TraceWriter(path, t.header):
        pass
    assert read_trace(path).n_segments == 0


def test_the_shipped_model_is_said_to_be_a_demo_where_a_newcomer_looks(capsys: pytest.CaptureFixture[str]) -> None:
    """`moelane --help`, `moelane run --help`, and a --chat run of it: a demo that continues code, not a chat model,
    and how to run a real one."""
    for argv in ([], ["run"]):
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
        said = " ".join(capsys.readouterr().out.split())
        assert "demo" in said and "not a chat model" in said
    assert "def fibonacci(n):" in said and "--model" in said
    assert main(["run", "--chat", "--max-tokens", "2", "hello"]) == 0
    lines = [line.rsplit("\r", 1)[-1] for line in capsys.readouterr().err.split("\n")]  # (after a loading bar)
    note = next(line for line in lines if line.strip())
    assert "demo" in note and "does not chat" in note and "--model" in note
    assert main(["run", "--max-tokens", "2", "def fibonacci(n):"]) == 0
    assert "demo" not in capsys.readouterr().err  # (a prompt it continues well: no note)


# ---- bench ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--streams", "99999"], "--streams must be at most 256"),  # (was a traceback after loading)
        (["--streams", "2", "--compile"], "--compile compiles the one-stream decode step"),  # (was ignored)
        (["--drafter", "copy"], "--drafter applies to the lanes engine"),  # (was ignored)
        (["--rounds", "0"], "--rounds must be >= 1, got 0"),
    ],
)
def test_bench_refuses_settings_it_would_crash_on_or_ignore(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in cli_error(["bench", *flags], capsys)


def test_bench_refuses_more_tokens_than_the_context_holds(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--tokens must be at most" in cli_error(["bench", "--tokens", "99999999", "--rounds", "1"], capsys)


def test_bench_prints_a_table_and_json_lines_with_json(capsys: pytest.CaptureFixture[str]) -> None:
    """By default a table a person reads (a line of what was measured, each round, their medians); with --json, one
    JSON object a line (each round, then the summary)."""
    assert main(["bench", "--tokens", "4", "--rounds", "2"]) == 0
    said, head, *rounds, median = capsys.readouterr().out.splitlines()
    assert "1 stream" in said and "4 tokens each" in said and "eager" in said
    assert head.split() == ["round", "prefill", "tok/s", "decode", "tok/s"]
    assert [r.split()[0] for r in rounds] == ["1", "2"] and median.split()[0] == "median"
    assert all(float(x) > 0 for r in [*rounds, median] for x in r.split()[1:])
    assert main(["bench", "--tokens", "4", "--rounds", "2", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [x.get("round") for x in lines] == [0, 1, None] and lines[-1]["summary"] is True
    assert set(lines[-1]["median"]) == {"prefill_tok_s", "decode_tok_s"} and lines[-1]["tokens"] == 4


def test_a_decode_step_that_cannot_compile_runs_eagerly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """`run --compile on` where compiling fails (no C++ compiler, a shape the compiler cannot lower): one line says
    so, and the reply comes eagerly, the same tokens, exit 0; no traceback."""
    from moelane.model.lm import LM

    args = ["run", "--max-tokens", "6", "--temperature", "0", "def add(a, b):"]
    assert main([*args, "--eager"]) == 0
    eager = capsys.readouterr().out

    def broken(self: LM, rows: list) -> list:
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore")

    monkeypatch.setattr(LM, "_decode", broken)
    with caplog.at_level(logging.WARNING):
        assert main([*args, "--compile", "on"]) == 0
    out, err = capsys.readouterr()
    assert out == eager and "Traceback" not in err
    assert "running eagerly: compiling the decode step failed (InvalidCxxCompiler" in caplog.text
    assert "more" not in caplog.text


def test_run_drafts_by_default_and_replies_the_same(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`run` drafts with copy unless told otherwise (none with --trace, which records one token a step); the reply
    is the one-token decode's, greedy and seeded."""
    import moelane.commands.run

    used: list[str] = []
    real = moelane.commands.run.generate
    monkeypatch.setattr(moelane.commands.run, "generate", lambda lm, ids, args, params: used.append(args.drafter)
                        or real(lm, ids, args, params))  # fmt: skip
    for extra in ([], ["--temperature", "0.8", "--seed", "5"]):
        args = ["run", "--max-tokens", "40", *extra, "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):"]
        assert main(args) == 0
        drafted = capsys.readouterr().out
        assert main([*args, "--drafter", "none"]) == 0
        assert capsys.readouterr().out == drafted
    assert main(["run", "--max-tokens", "4", "--trace", str(tmp_path / "t.trc"), "hi"]) == 0
    assert used == ["copy", "none", "copy", "none", "none"]


# ---- found by trying the command line as a new user would (2026-12-03) ----------------------------------------


def test_unknown_options_point_at_their_commands_help(capsys: pytest.CaptureFixture[str]) -> None:
    line = cli_error(["run", "--foo", "hi"], capsys)
    assert line.startswith("moelane run: error: unrecognized arguments: --foo") and "(see moelane run --help)" in line
    assert "quotes" not in line  # (the hint is for words of a prompt, not for options)
    assert "(see moelane trace synth --help)" in cli_error(["trace", "synth", "--out", "x.trc", "--bar"], capsys)
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("moelane ")
    args = build_parser().parse_args(["run", "-v", "hi"])  # -v after the command, as before it
    assert args.verbose and args.prompt == "hi"
    assert not build_parser().parse_args(["run", "hi"]).verbose


def test_output_that_cannot_be_written_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    class Full(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(28, "No space left on device")  # (as `> /dev/full` does)

    monkeypatch.setattr("sys.stdout", Full())
    assert "cannot write the output: No space left on device" in cli_error(["run", "--max-tokens", "2", "hi"], capsys)
    monkeypatch.setattr("sys.stdout", None)  # (started with standard output closed: `>&-`)
    assert "standard output is closed" in cli_error(["run", "--max-tokens", "2", "hi"], capsys)


def test_run_says_when_the_context_cuts_the_reply(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    from moelane.model.tokenizer import MAX_CHARS_PER_TOKEN

    prompt = "x " * 2000  # 2,001 tokens of the shipped model's 2,048
    with caplog.at_level(logging.WARNING, logger="moelane"):
        assert main(["run", "--drafter", "none", "--max-tokens", "100", prompt]) == 0
    assert "the reply can have at most 47 tokens, not --max-tokens 100" in caplog.text
    assert "47 new tokens (context full)" in capsys.readouterr().err
    assert main(["run", "--max-tokens", "3", "hi"]) == 0 and "3 new tokens (--max-tokens)" in capsys.readouterr().err
    # a prompt of megabytes is refused from its head, not after a minute of tokenising
    huge = "abc " * (2048 * MAX_CHARS_PER_TOKEN)
    assert "tokens in its first 65536 characters alone" in cli_error(["run", huge], capsys)
    assert "--expert-memory: not a memory size: ''" in cli_error(["run", "--expert-memory", "", "hi"], capsys)
    assert "--host-memory: not a memory size: '1X'" in cli_error(["run", "--host-memory", "1X", "hi"], capsys)


def test_a_memory_size_is_refused_in_one_line_however_it_is_written(capsys: pytest.CaptureFixture[str]) -> None:
    """A size that starts with a minus is its flag's value, refused as such (argparse alone took it for an option and
    said the flag had no value); before the model loads."""
    want = "moelane: error: --expert-memory: not a memory size: '-5%' (use e.g. 512MiB, 2GiB, 1.5GB, 300000000 or 25%)"
    assert cli_error(["run", "--expert-memory", "-5%", "hi"], capsys) == want
    assert cli_error(["run", "--expert-memory=-5%", "hi"], capsys) == want
    assert "--host-memory: not a memory size: '-1GiB'" in cli_error(["bench", "--host-memory", "-1GiB"], capsys)
    assert "--budget: not a memory size: '-5%'" in cli_error(["trace", "replay", str(TRACE), "--budget", "-5%"], capsys)
    assert "--expert-memory: expected one argument" in cli_error(["run", "--expert-memory", "-v", "hi"], capsys)


def test_a_pool_too_small_for_one_token_is_one_line_and_no_warning(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """The shipped model routes each token to 4 of 32 experts in each of 6 MoE layers: 1% holds one expert, 2.1%
    the four one token needs (and no more than one row's, which a warning says)."""
    with caplog.at_level(logging.WARNING):
        line = cli_error(["run", "--expert-memory", "1%", "--max-tokens", "2", "hi"], capsys)
    assert line.startswith("moelane: error: --expert-memory 1% holds 1 expert, but a token routes to 4 at once")
    assert line.endswith("(2.1%)") and not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert main(["run", "--expert-memory", "2.1%", "--max-tokens", "2", "hi"]) == 0


def test_traces_of_more_experts_than_their_ids_hold_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from moelane.pager.trace import TraceHeader

    synth = ["trace", "synth", "--out", str(tmp_path / "s.trc"), "--experts", "70000"]
    assert "--experts must be at most 65536" in cli_error(synth, capsys)  # (ids past 65535 wrapped round)
    with pytest.raises(ValueError, match="at most 65536"):
        TraceHeader(n_layers=1, n_experts=70000, top_k=1, tiers=(("native", 1),))


def test_analyze_leaves_out_a_predictor_too_big_for_memory(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import moelane.pager.lab.analyze

    assert main(["trace", "analyze", "--json", str(TRACE)]) == 0
    assert json.loads(capsys.readouterr().out)["overall"]["predictors"] is not None
    monkeypatch.setattr(moelane.pager.lab.analyze, "COOCCURRENCE_BYTES", 1000)  # (70,000 experts would want 292 GiB)
    assert main(["trace", "analyze", "--json", str(TRACE)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["overall"]["predictors"] is None and all(r["predictors"] is None for r in report["requests"])
    assert main(["trace", "analyze", str(TRACE)]) == 0 and "co-occurrence" not in capsys.readouterr().out


def test_replay_pool_sizes_as_run_takes_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    header = read_trace(TRACE).header
    total = header.n_total * header.expert_bytes
    rows = {}
    for budget in ("25%", str(total // 4), f"{total / 4 / 2**20}MiB"):
        assert main(["trace", "replay", str(TRACE), "--budget", budget, "--policy", "lru", "--json"]) == 0
        rows[budget] = json.loads(capsys.readouterr().out)
    assert len({r["capacity"] for r in rows.values()}) == 1 and rows["25%"]["capacity"] == total // 4
    assert "--budget: not a memory size" in cli_error(["trace", "replay", str(TRACE), "--budget", "abc"], capsys)
    too_many = ["trace", "replay", str(TRACE), "--slots", str(header.n_total + 1)]
    assert f"--slots must be from 1 to the trace's {header.n_total} experts" in cli_error(too_many, capsys)
    lru = ["trace", "replay", str(TRACE), "--slots", "9", "--policy", "lru", "--plan-out", str(tmp_path / "p.json")]
    assert "--plan-out writes the planner's plans" in cli_error(lru, capsys)  # (was silently not written)


def test_replay_of_a_trace_without_prefill_shows_no_prefill_hit_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = str(tmp_path / "s.trc")
    assert main(["trace", "synth", "--out", trace, "--prefill", "0", "--decode", "8", "--requests", "1"]) == 0
    assert main(["trace", "replay", trace, "--slots", "40", "--policy", "lru"]) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[:2] == ["lru", "40"] and row[4] == "-"  # (was 100.0% of nothing)


def test_replay_shows_the_pool_in_slots_and_bytes_however_it_was_given(capsys: pytest.CaptureFixture[str]) -> None:
    """The pool's columns say their units, and the same pool given as --slots or as --budget reads the same."""
    from moelane.pager.live.memory import format_bytes

    size = 40 * read_trace(TRACE).header.expert_bytes
    rows = []
    for flags in (["--slots", "40"], ["--budget", str(size)], ["--budget", f"{size / 2**20}MiB"]):
        assert main(["trace", "replay", str(TRACE), "--policy", "lru", *flags]) == 0
        head, row = capsys.readouterr().out.splitlines()
        assert "slots" in head and "bytes" in head
        rows.append(row.split())
    assert rows[0][:3] == ["lru", "40", format_bytes(size).replace(" ", "")] and rows[0] == rows[1] == rows[2]


def test_record_refuses_a_prompt_too_long_before_recording(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n\n" + json.dumps({"prompt": "x " * 3000}) + "\n")
    out = tmp_path / "t.trc"
    out.write_text("an earlier trace")
    argv = ["trace", "record", "--prompts", str(prompts), "--out", str(out), "--max-tokens", "2"]
    assert f"{prompts} line 3: prompt of 3001 tokens does not fit the context of 2048" in cli_error(argv, capsys)
    assert out.read_text() == "an earlier trace"


def test_run_holds_the_reply_to_a_json_schema(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--json-schema` (text, or a file) holds the shipped model's reply to JSON the schema accepts; schemas that
    are not JSON objects are refused before loading, and ones the grammar cannot use once it has loaded."""
    schema = {"type": "object", "properties": {"ok": {"enum": [True, False]}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    for given in (json.dumps(schema), str(path)):
        assert main(["run", "--max-tokens", "64", "--json-schema", given, "Is it on?"]) == 0
        reply = json.loads(capsys.readouterr().out)
        assert reply in ({"ok": True}, {"ok": False})
    assert "before the JSON was complete" not in caplog.text
    assert main(["run", "--max-tokens", "64", "--json", "--seed", "1", "--temperature", "1", "Data:"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("{")  # (64 tokens may cut a free object short: it is JSON up to there)
    assert "neither" in cli_error(["run", "--json-schema", "{not json", "hi"], capsys)
    assert "neither" in cli_error(["run", "--json-schema", str(tmp_path / "missing.json"), "hi"], capsys)
    assert "must be a JSON object" in cli_error(["run", "--json-schema", "[1]", "hi"], capsys)
    assert "--json-schema: the JSON schema cannot be used" in cli_error(["run", "--json-schema", "false", "hi"], capsys)


def test_run_says_when_max_tokens_cuts_a_reply_held_to_json(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    with caplog.at_level(logging.WARNING, logger="moelane"):
        assert main(["run", "--json", "--max-tokens", "8", "Data:"]) == 0
    out, err = capsys.readouterr()
    with pytest.raises(ValueError):
        json.loads(out)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said == ["reply cut at --max-tokens before the JSON was complete"]
    assert "8 new tokens (--max-tokens)" in err
