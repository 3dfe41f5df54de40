"""What the ranks of one run must agree on, and the first thing two ranks disagree on.

A rank computes its experts' outputs for rank 0, which sums them into tokens: the ranks must hold the same model
(its config, its experts' shapes, and a digest of its first expert's weights, which tells two checkpoints of one
architecture apart), compute in the same dtype, and run the same kernels (the C++ extension and its fallback round
differently). Budgets may differ: each host pages its own share under its own memory.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from moelane import kernels
from moelane.model.checkpoint import ExpertHandle, read_expert
from moelane.model.config import Config


def fingerprint(config: Config, handles: dict[int, list[ExpertHandle]], dtype: torch.dtype,
                default_tier: str) -> dict[str, str]:  # fmt: skip
    """This rank's view of the run, as text by name (in the order a difference is looked for)."""
    layers = sorted(handles)
    first = handles[layers[0]][0] if layers and handles[layers[0]] else None
    out = {"torch": torch.__version__, "kernels": kernels.available().backend}
    out |= {f"config.{f.name}": repr(getattr(config, f.name)) for f in dataclasses.fields(config)}
    out |= {
        "compute dtype": str(dtype).removeprefix("torch."),
        "default tier": default_tier,
        "MoE layers": repr(layers),
        "experts a layer": repr(sorted({len(hs) for hs in handles.values()})),
        "expert dims": repr(first.dims if first else None),
        "expert layout": first.layout if first else "none",
        "first expert": digest(first, dtype) if first else "none",
    }
    return out


def digest(handle: ExpertHandle, dtype: torch.dtype) -> str:
    """A short digest of one expert's weights as computed with (in `dtype`)."""
    h = hashlib.sha256()
    for w in read_expert(handle, dtype):
        h.update(w.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def difference(ours: dict[str, str], theirs: dict[str, str], rank: int) -> str | None:
    """None where rank `rank`'s fingerprint (`theirs`) equals rank 0's (`ours`), else one line naming the first
    difference."""
    for name in dict.fromkeys([*ours, *theirs]):
        mine, other = ours.get(name, "(absent)"), theirs.get(name, "(absent)")
        if mine != other:
            return (
                f"rank {rank} was started with a different model or settings: {name} is {other} there, {mine} on rank 0"
            )
    return None
