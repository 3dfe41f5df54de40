"""`trace record` end to end on the shipped default model (a real LM, its observer hook, chunked prefill)."""

import argparse
import json
from pathlib import Path

import numpy as np

from moelane.pager.commands import cmd_record
from moelane.pager.trace import read_trace


def test_record_two_requests_from_the_default_model(tmp_path: Path) -> None:
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
