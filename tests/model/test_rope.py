"""Rotary turns from tables (`model/rope.py`): a position's cos and sin are the same bits whatever else is in the
pass, eager or compiled, and as close to the true angles as the references' fp32 angles allow, or closer."""

from __future__ import annotations

import pytest
import torch

from moelane.model.rope import FINE, Rope


def reference(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rotary cos and sin: the angle rounded to fp32, then its cos and sin."""
    angles = positions.float()[:, None] * inv_freq[None]
    angles = torch.cat([angles, angles], -1)
    return angles.cos(), angles.sin()


def yarn_rope() -> tuple[Rope, torch.Tensor]:
    rope = Rope.build({"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
                      64, 8192)  # fmt: skip
    return rope, torch.randint(0, 8192, (203,), generator=torch.Generator().manual_seed(0))


PARTS = ((0, 203), (5, 1), (17, 9), (40, 33), (100, 2))


def test_turns_are_the_same_bits_in_any_pass() -> None:
    rope, positions = yarn_rope()
    cos, sin = rope.cos_sin(positions, torch.float32)
    for start, n in PARTS:
        got_cos, got_sin = rope.cos_sin(positions[start : start + n], torch.float32)
        assert torch.equal(got_cos, cos[start : start + n]) and torch.equal(got_sin, sin[start : start + n])


@pytest.mark.slow
def test_compiled_turns_are_the_eager_bits() -> None:
    """An Inductor-compiled call (dynamic row count) gives each row the eager bits, whatever its pass. (A compiled
    `sin` is vectorised in one kernel and scalar in another, which round apart: on an AVX2 CPU the two-pool decode step
    gave rows other bits than the one-pool step while the turns were computed in the step.)"""
    rope, positions = yarn_rope()
    cos, sin = rope.cos_sin(positions, torch.float32)
    compiled = torch.compile(lambda p: rope.cos_sin(p, torch.float32), dynamic=True, fullgraph=True)
    for start, n in PARTS:
        got_cos, got_sin = compiled(positions[start : start + n])
        assert torch.equal(got_cos, cos[start : start + n]) and torch.equal(got_sin, sin[start : start + n])


def test_turns_match_the_references_below_fine_and_the_true_angles_beyond() -> None:
    """Below FINE the references' numbers exactly; at every position of a 131,072 context within 4e-5 of float64's
    cos and sin (fp32 angles, as transformers computes them, are off by up to 4e-3 there)."""
    rope = Rope.build({"rope_theta": 5e5, "rope_type": "default"}, 64, 131072)
    positions = torch.arange(131072)
    cos, sin = rope.cos_sin(positions, torch.float32)
    want_cos, want_sin = reference(positions[:FINE], rope.inv_freq)
    assert torch.equal(cos[:FINE], want_cos) and torch.equal(sin[:FINE], want_sin)
    angles = positions.double()[:, None] * rope.inv_freq.double()[None]
    angles = torch.cat([angles, angles], -1)
    assert (cos.double() - angles.cos()).abs().max() < 4e-5 and (sin.double() - angles.sin()).abs().max() < 4e-5


def test_turns_carry_the_attention_factor_and_the_dtype() -> None:
    rope = Rope.build({"rope_theta": 1e4, "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512},
                      32, 4096)  # fmt: skip
    assert rope.attention_factor > 1
    positions = torch.tensor([0, 3, 700, 1500, 4095])
    cos, sin = rope.cos_sin(positions, torch.bfloat16)
    want_cos, want_sin = reference(positions, rope.inv_freq)
    assert cos.dtype == sin.dtype == torch.bfloat16
    torch.testing.assert_close(cos.float(), (want_cos * rope.attention_factor).bfloat16().float(), rtol=0, atol=1e-2)
    torch.testing.assert_close(sin.float(), (want_sin * rope.attention_factor).bfloat16().float(), rtol=0, atol=1e-2)
