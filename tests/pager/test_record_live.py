"""`trace record` end to end on the shipped default model (a real LM, its observer hook, chunked prefill)."""

import argparse
import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

import moelane
import moelane.commands.trace as trace_commands
from moelane.assets import default_model_path
from moelane.commands.common import Terminated
from moelane.commands.trace import cmd_record
from moelane.pager.live.memory import format_bytes
from moelane.pager.trace import read_trace

from .test_commands import Bar


def test_record_two_requests_from_the_default_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The trace, a progress bar that moves by each pass's tokens, and a last line that says what was written."""
    monkeypatch.setattr(trace_commands, "progress", Bar)
    Bar.made.clear()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n", "max_tokens": 5})
        + "\n"
        + json.dumps({"prompt": "HAMLET.\nTo be, or not to be, that is the question:\n", "max_tokens": 4})
        + "\n"
    )
    out = tmp_path / "t.trc"
    args = argparse.Namespace(prompts=str(prompts), out=str(out), model=None, max_tokens=8, prefill_chunk=8)
    assert cmd_record(args) == 0
    t = read_trace(out)
    assert t.header.n_layers == 6 and t.header.n_experts == 32 and t.header.top_k == 4
    assert sorted(set(t.stream_ids.tolist())) == [0, 1]
    for sid, n_decode in ((0, 4), (1, 3)):  # the first reply token comes from the prefill's logits
        phases = [t.seg_phase[s] for s in range(t.n_segments) if t.stream_ids[t.seg_offsets[s]] == sid]
        assert phases.count("decode") == n_decode and phases[0] == "prefill"
        assert max(int(t.seg_offsets[s + 1] - t.seg_offsets[s]) for s in range(t.n_segments)) <= 8
    assert np.allclose(t.weights.sum(axis=2), 1.0, atol=0.02)  # norm_topk_prob: gate weights sum to 1
    (bar,) = Bar.made
    sizes = [int(t.seg_offsets[s + 1] - t.seg_offsets[s]) for s in range(t.n_segments)]
    assert bar.unit == "tok" and bar.steps == sizes and bar.total == sum(sizes) == t.n_tokens
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"wrote {out}: 2 requests, {t.n_segments} segments, {t.n_tokens} tokens, {format_bytes(out.stat().st_size)}"
    )


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_a_recording_stopped_midway_keeps_its_requests_and_says_so(
    stop: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Ctrl-C or SIGTERM in the second request: the first one's segments stay, readable, and the user is told what
    was kept, in the same words."""
    from moelane.model.lm import LM

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "max_tokens": 3}) + "\n" for p in ("def a():", "def b():")))
    generate, calls = LM.generate_ids, []

    def pressed(self: LM, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 2:
            if stop == "ctrl-c":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGTERM)  # (taken here, in the main thread, at the next bytecode)
        return generate(self, *args, **kwargs)  # type: ignore[arg-type]

    def untaken(*_: object) -> None:
        raise AssertionError("the SIGTERM reached the test's own handler: trace record did not take it")

    monkeypatch.setattr(LM, "generate_ids", pressed)
    previous = signal.signal(signal.SIGTERM, untaken)
    out = tmp_path / "t.trc"
    args = argparse.Namespace(prompts=str(prompts), out=str(out), model=None, max_tokens=8, prefill_chunk=8)
    try:
        with pytest.raises(KeyboardInterrupt) as e:
            cmd_record(args)
        assert isinstance(e.value, Terminated) is (stop == "sigterm")
        assert signal.getsignal(signal.SIGTERM) is untaken  # (put back as it was)
    finally:
        signal.signal(signal.SIGTERM, previous)
    t = read_trace(out)
    assert t.n_segments == 3 and set(t.stream_ids.tolist()) == {0}  # (a prefill and two decode steps)
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert said == [f"recording stopped after 1 of 2 requests: {out} keeps the 3 segments recorded so far"]


def test_recorded_lookahead_is_the_next_routers_top_k_as_transformers_computes_it(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    prompt = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": prompt, "max_tokens": 6}) + "\n")
    out = tmp_path / "t.trc"
    args = argparse.Namespace(prompts=str(prompts), out=str(out), model=None, max_tokens=6, prefill_chunk=8)
    assert cmd_record(args) == 0
    t = read_trace(out)
    assert t.lookahead is not None and t.lookahead.shape == (t.n_tokens, 5, 4)

    lm = moelane.load()
    ids = lm.tokenizer.encode(prompt)
    fed = ids + list(lm.generate_ids(ids, 6, stop_ids=frozenset()))[: t.n_tokens - len(ids)]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        default_model_path(), local_files_only=True, dtype=torch.float32
    )
    layers = model.model.layers
    inputs: dict[int, torch.Tensor] = {}
    for i in range(len(layers) - 1):
        layers[i].mlp.register_forward_pre_hook(
            lambda m, a, i=i: inputs.__setitem__(i, a[0].reshape(-1, a[0].shape[-1]))
        )
    with torch.no_grad():
        model(torch.tensor([fed]))
    agree = total = 0
    for i in range(len(layers) - 1):
        ref = torch.topk(inputs[i] @ layers[i + 1].mlp.gate.weight.T, 4, dim=-1).indices.numpy()
        for row, want in zip(t.lookahead[:, i], ref, strict=True):
            agree += set(row.tolist()) == set(want.tolist())
            total += 1
    assert agree >= 0.98 * total  # exact but for near-ties of fp32 rounding (chunked prefill vs one pass)
