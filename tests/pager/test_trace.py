import os
from pathlib import Path

import numpy as np
import pytest

from moelane.pager.lab.synth import SynthConfig, synth_trace
from moelane.pager.trace import TraceError, TraceHeader, TraceWriter, read_trace, write_trace

from .helpers import small_trace, with_lookahead


def test_roundtrip_keeps_ids_phases_streams_and_weights(tmp_path: Path) -> None:
    t = small_trace()
    write_trace(tmp_path / "t.trc", t)
    r = read_trace(tmp_path / "t.trc")
    assert r.header == t.header
    assert np.array_equal(r.expert_ids, t.expert_ids)
    assert np.array_equal(r.seg_offsets, t.seg_offsets)
    assert r.seg_phase == t.seg_phase
    assert np.array_equal(r.stream_ids, t.stream_ids)
    assert np.abs(r.weights - t.weights).max() <= 0.5 / 255 * t.weights.max() + 1e-6


def test_roundtrip_keeps_the_lookahead_and_drops_it_when_a_segment_lacks_it(tmp_path: Path) -> None:
    t = with_lookahead(small_trace(), np.random.default_rng(0))
    write_trace(tmp_path / "t.trc", t)
    r = read_trace(tmp_path / "t.trc")
    assert r.lookahead is not None and t.lookahead is not None
    assert np.array_equal(r.lookahead, t.lookahead) and np.array_equal(r.expert_ids, t.expert_ids)
    assert np.abs(r.weights - t.weights).max() <= 0.5 / 255 * t.weights.max() + 1e-6
    with TraceWriter(tmp_path / "m.trc", t.header) as w:
        for s in range(t.n_segments):
            seg = t.segment(s)
            w.write_segment(seg.expert_ids, seg.weights, seg.phase, seg.stream_ids, seg.lookahead if s else None)
    mixed = read_trace(tmp_path / "m.trc")
    assert mixed.lookahead is None and mixed.segment(1).lookahead is None
    assert np.array_equal(mixed.expert_ids, t.expert_ids)
    with TraceWriter(tmp_path / "bad.trc", t.header) as w, pytest.raises(ValueError, match="lookahead"):
        w.write_segment(t.expert_ids[:1], None, "decode", None, t.expert_ids[:1])  # L layers, not L - 1


def test_many_experts_use_wide_ids(tmp_path: Path) -> None:
    t = synth_trace(SynthConfig(n_layers=2, n_experts=300, top_k=3, n_requests=1, prefill_tokens=4, decode_tokens=3))
    write_trace(tmp_path / "w.trc", t)
    assert np.array_equal(read_trace(tmp_path / "w.trc").expert_ids, t.expert_ids)
    assert t.expert_ids.max() > 255


def test_cut_short_reads_back_to_last_whole_segment(tmp_path: Path) -> None:
    t = small_trace()
    path = tmp_path / "t.trc"
    write_trace(path, t)
    data = path.read_bytes()
    ends = []  # file size after each whole segment: write a prefix of segments to find them
    for n in range(t.n_segments + 1):
        p = tmp_path / f"p{n}.trc"
        with TraceWriter(p, t.header) as w:
            for s in range(n):
                seg = t.segment(s)
                w.write_segment(seg.expert_ids, seg.weights, seg.phase, seg.stream_ids)
        ends.append(p.stat().st_size)
    rng = np.random.default_rng(0)
    for cut in sorted(set(rng.integers(ends[0], len(data), 25).tolist()) | {ends[3], ends[3] + 1, ends[3] - 1}):
        path.write_bytes(data[:cut])
        whole = max(i for i, e in enumerate(ends) if e <= cut)
        r = read_trace(path)
        assert r.n_segments == whole
        assert np.array_equal(r.expert_ids, t.expert_ids[: t.seg_offsets[whole]])


def test_corrupt_record_stops_there(tmp_path: Path) -> None:
    t = small_trace()
    path = tmp_path / "t.trc"
    write_trace(path, t)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # inside the last segment's payload
    path.write_bytes(bytes(data))
    assert read_trace(path).n_segments == t.n_segments - 1


def test_not_a_trace(tmp_path: Path) -> None:
    p = tmp_path / "x.trc"
    p.write_bytes(b"hello world, not a trace")
    with pytest.raises(TraceError):
        read_trace(p)


def test_writer_validates_shape(tmp_path: Path) -> None:
    h = TraceHeader(2, 4, 2, (("bf16", 8),))
    with TraceWriter(tmp_path / "t.trc", h) as w, pytest.raises(ValueError):
        w.write_segment(np.zeros((1, 3, 2), np.uint8), None, "decode")


def test_compact_bytes_per_routing_entry(tmp_path: Path) -> None:
    # 100k tokens x 48 layers x top-8 = 38.4M entries must stay well under 100 MB: under 2 bytes per entry here
    t = synth_trace(
        SynthConfig(n_layers=48, n_experts=128, top_k=8, n_requests=1, prefill_tokens=256, decode_tokens=256)
    )
    write_trace(tmp_path / "c.trc", t)
    per_entry = os.path.getsize(tmp_path / "c.trc") / t.expert_ids.size
    assert per_entry < 2.0
