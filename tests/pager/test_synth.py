import numpy as np

from moelane.pager.lab.analyze import analyze
from moelane.pager.lab.synth import SynthConfig, synth_trace


def test_deterministic_shapes_and_distinct_experts() -> None:
    cfg = SynthConfig(
        n_layers=4, n_experts=16, top_k=3, n_requests=2, prefill_tokens=10, prefill_chunk=4, decode_tokens=5
    )
    a, b = synth_trace(cfg), synth_trace(cfg)
    assert np.array_equal(a.expert_ids, b.expert_ids)
    assert a.expert_ids.shape == (30, 4, 3)
    assert a.seg_phase == ("prefill",) * 3 + ("decode",) * 5 + ("prefill",) * 3 + ("decode",) * 5
    srt = np.sort(a.expert_ids, axis=2)
    assert (np.diff(srt, axis=2) > 0).all()
    assert np.allclose(a.weights.sum(axis=2), 1.0, atol=1e-5)


def test_locality_and_skew_knobs_move_coverage() -> None:
    base = dict(n_layers=4, n_experts=32, top_k=4, n_requests=2, prefill_tokens=64, decode_tokens=64)
    lo = analyze(synth_trace(SynthConfig(**base, locality=0.0)))["overall"]["coverage"]  # type: ignore[arg-type]
    hi = analyze(synth_trace(SynthConfig(**base, locality=4.0)))["overall"]["coverage"]  # type: ignore[arg-type]
    assert hi["last_1"]["coverage"] > lo["last_1"]["coverage"] + 0.2
    flat = analyze(synth_trace(SynthConfig(**base, skew=0.0, locality=0.0)))["overall"]["coverage"]  # type: ignore[arg-type]
    assert lo["freq_top_k"]["coverage"] > flat["freq_top_k"]["coverage"]
