"""Rotary position embeddings: the frequencies of each scaling scheme (default, linear, yarn, llama3, longrope,
dynamic), and the rotations of queries and keys in Llama's halves layout or over interleaved pairs.

`Rope.cos_sin(positions)` gives each row its own angles from its absolute position, so a row's numbers do not depend on
the other rows of the pass, nor on how its sequence was split into passes (LongRoPE included). It computes no cosine or
sine: a compiled graph's vectorised `sin` and its scalar one differ in the last bit, and which of the two a row takes
depends on the kernel that holds it (docs/batch-invariance.md). Each position's turns come from two tables made once,
by the angle-sum rule, with exact multiplies and adds only (`turn_tables`).

Shape alphabet: N rows, D rotary dims.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from moelane.errors import ModelLoadError


def rope_parameters(config: dict[str, Any], default_theta: float = 10000.0) -> dict[str, Any]:
    """rope_theta and scaling, wherever the config keeps them (top level, `rope_parameters`, `rope_scaling`);
    `default_theta` where none says (the family's transformers default: Mixtral's is 1e6)."""
    params: dict[str, Any] = {"rope_theta": config.get("rope_theta") or default_theta, "rope_type": "default"}
    for key in ("rope_parameters", "rope_scaling"):
        extra = config.get(key)
        if isinstance(extra, dict):
            params.update(extra)
    if "type" in params and params.get("rope_type", "default") == "default":
        params["rope_type"] = params["type"]
    if params["rope_type"] in ("llama3", "yarn", "longrope") and config.get("original_max_position_embeddings"):
        # A top-level length (Phi-3's place for it) wins over the scaling's own, as transformers reads it.
        params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    return params


@dataclass(frozen=True, slots=True)
class Rope:
    """Rotary embedding: inverse frequencies and the attention scale factor a scaling scheme asks for. LongRoPE has
    two sets, chosen per position: from position `long_from` on, `long_inv_freq` and `long_attention_factor`."""

    inv_freq: torch.Tensor  # [D/2]
    attention_factor: float
    long_inv_freq: torch.Tensor | None = None  # [D/2]
    long_attention_factor: float = 1.0
    long_from: int = 0
    # [sets, FINE + coarse rows, 2, D/2]: per frequency set (LongRoPE's long set second) the cos and sin of positions
    # 0 .. FINE - 1, then of multiples of FINE up to the context (`turn_tables`); made by `build`.
    tables: torch.Tensor | None = None

    @classmethod
    def build(cls, params: dict[str, Any], dim: int, max_positions: int) -> Rope:
        base = float(params["rope_theta"])
        kind = params.get("rope_type", "default")
        if base <= 1 or (kind != "default" and float(params.get("factor") or 1.0) <= 0):
            raise ModelLoadError(f"bad rope parameters: rope_theta {base} (must be > 1), factor {params.get('factor')}")
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        factor = 1.0
        if kind == "linear":
            inv = inv / float(params["factor"])
        elif kind == "yarn":
            inv, factor = yarn(inv, params, dim, base, max_positions)
        elif kind == "llama3":
            inv = llama3(inv, params, max_positions)
        elif kind == "longrope":
            short, factor, long, long_factor, long_from = longrope(params, dim, base, max_positions)
            tables = torch.stack([turn_tables(short, max_positions), turn_tables(long, max_positions)])
            return cls(short, factor, long, long_factor, long_from, tables)
        elif kind not in ("default", "dynamic"):  # (dynamic NTK changes nothing within `max_positions`, the context)
            raise ModelLoadError(f"unsupported rope scaling {kind!r} (supported: default, linear, yarn, llama3, "
                                 "longrope, dynamic)")  # fmt: skip
        return cls(inv, factor, tables=turn_tables(inv, max_positions)[None])

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [N, D] of positions [N] (each frequency twice: halves layout), times the attention factor."""
        assert self.tables is not None, "a Rope is made by Rope.build"
        fine, coarse = positions % FINE, FINE + positions // FINE
        scale: float | torch.Tensor
        if self.long_inv_freq is None:
            near, far, scale = self.tables[0, fine], self.tables[0, coarse], self.attention_factor  # [N, 2, D/2]
        else:  # LongRoPE: each position its own set (a tensor choice: compiles whole)
            long = positions >= self.long_from
            near, far = self.tables[long.long(), fine], self.tables[long.long(), coarse]
            scale = torch.where(long, self.long_attention_factor, self.attention_factor)[:, None]
        # cos(a + b) = cos a cos b - sin a sin b, sin(a + b) = sin a cos b + cos a sin b: exact below FINE, where the
        # far turn is (1, 0); multiplies and adds round the same on every path (Inductor does not contract them).
        cos = far[:, 0] * near[:, 0] - far[:, 1] * near[:, 1]
        sin = far[:, 1] * near[:, 0] + far[:, 0] * near[:, 1]
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        return (cos * scale).to(dtype), (sin * scale).to(dtype)


# Positions below FINE read their turn from the table as it is; beyond, a coarse turn (a multiple of FINE) and a fine
# one combine. Tables of FINE + context // FINE + 1 rows: 1,065 at a 40,960 context, 11,265 at 10M.
FINE = 1024


def turn_tables(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """[FINE + max_positions // FINE + 1, 2, D/2]: the fp32 cos and sin of positions 0 .. FINE - 1 at `inv_freq`, as
    the references compute them (the angle rounded to fp32 first), then of positions 0, FINE, 2 FINE, ... up to
    `max_positions`, computed in float64 (angles in the thousands of radians keep their precision)."""
    fine = torch.arange(FINE).float()[:, None] * inv_freq.float()[None, :]
    coarse = torch.arange(0, max_positions + FINE, FINE, dtype=torch.float64)[:, None] * inv_freq.double()[None, :]
    rows = [torch.stack([fine.cos(), fine.sin()], dim=1), torch.stack([coarse.cos(), coarse.sin()], dim=1).float()]
    return torch.cat(rows)


def longrope(
    params: dict[str, Any], dim: int, base: float, max_positions: int
) -> tuple[torch.Tensor, float, torch.Tensor, float, int]:
    """LongRoPE (Phi-3, Phi-3.5-MoE): each frequency divided by its own factor, `short_factor` below
    `original_max_position_embeddings` and `long_factor` from there on; one attention factor for both, the config's
    or sqrt(1 + log(factor) / log(original)), `factor` defaulting to the context's growth. -> `Rope`'s fields.

    transformers switches every position of a pass to the long factors once the pass reaches past the original
    length, which a KV cache, whose keys were turned by the short ones, cannot follow (vLLM switches a whole batch
    when any of its positions is past it, so a row depends on its batch); here each position has its own set, so a
    row's numbers depend neither on its batch nor on how its sequence was split into passes: the same numbers as
    transformers while a sequence stays below the switch."""
    original = int(params.get("original_max_position_embeddings") or max_positions)
    factors = []
    for key in ("short_factor", "long_factor"):
        values = params.get(key)
        if not isinstance(values, list) or len(values) != dim // 2 or not all(positive(v) for v in values):
            raise ModelLoadError(f"longrope needs {key}: {dim // 2} positive numbers (rotary dims / 2), got {values}")
        factors.append(torch.tensor(values, dtype=torch.float32))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    short, long = (1.0 / (f * base**shape) for f in factors)
    factor = float(params.get("factor") or max_positions / original)
    if params.get("attention_factor") is not None:
        attention = float(params["attention_factor"])
    else:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return short, attention, long, attention, original


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and value > 0


def yarn(
    inv: torch.Tensor, params: dict[str, Any], dim: int, base: float, max_positions: int
) -> tuple[torch.Tensor, float]:
    original = int(params.get("original_max_position_embeddings") or max_positions)
    factor = float(params.get("factor") or max_positions / original)  # none: the context's growth, as transformers
    beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if params.get("attention_factor") is not None:
        attention = float(params["attention_factor"])
    elif params.get("mscale") and params.get("mscale_all_dim"):
        attention = mscale(factor, float(params["mscale"])) / mscale(factor, float(params["mscale_all_dim"]))
    else:
        attention = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = (inv / factor) * (1 - extrapolation) + inv * extrapolation
    return inv, attention


def llama3(inv: torch.Tensor, params: dict[str, Any], max_positions: int) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    factor, low, high = float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"])
    original = float(params.get("original_max_position_embeddings") or max_positions)
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > original / low, inv / factor, inv)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D]; cos/sin [N, D]."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding over interleaved pairs (x0, x1), (x2, x3), ... of x [N, heads, R], in the dtype of cos.

    The pairs are regrouped as halves first (evens, then odds) and rotated Llama-style; queries and keys both come out
    in that order, which leaves their dot products unchanged."""
    halves = x.to(cos.dtype).view(*x.shape[:-1], -1, 2).transpose(-1, -2).flatten(-2)
    return apply_rope(halves, cos, sin).to(x.dtype)


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama-style rotary embedding of x [N, heads, R] in the dtype of cos, rounded back to x's."""
    return apply_rope(x.to(cos.dtype), cos, sin).to(x.dtype)


class Fp32Rope(Rope):
    """Rotary cos/sin in fp32 whatever the model's dtype: for references that rotate in fp32 and round once."""

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return super().cos_sin(positions, torch.float32)
