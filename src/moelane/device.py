"""Where a model computes: the one place that knows devices (with the expert store's `pager/live/transfer.py`).

`parse("cuda:1")` checks a `--device` value against what this machine has; `move(model, device)` puts a loaded
model's dense weights there (parameters, buffers, the kernels' pools, rotary tables). Model code stays device-generic:
it makes its index tensors on the device of the tensors they index (docs/accelerator.md).

Nothing here touches CUDA unless a CUDA device is asked for: a CPU run never initialises it (tested).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from moelane.errors import InputError
from moelane.kernels import Pool, serves

CPU = torch.device("cpu")


def parse(text: str | torch.device | None) -> torch.device:
    """A `--device` value ("cpu", "cuda", "cuda:N"; None: the CPU) as a device this machine has, else InputError in
    one line."""
    if text is None:
        return CPU
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError):
        raise InputError(f"--device must be cpu, cuda or cuda:N, got {text!r}") from None
    if device.type == "cpu":
        return CPU
    if device.type != "cuda":
        raise InputError(f"--device {text}: only cpu and cuda devices are supported")
    if not torch.cuda.is_available():
        built = "this PyTorch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise InputError(f"--device {text}: {built} (torch {torch.__version__})")
    index = 0 if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise InputError(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    device = torch.device("cuda", index)
    if not serves(device):  # (the device's weight products are Triton kernels: moelane.kernels.cuda)
        raise InputError(f"--device {text} needs Triton (pip install triton)")
    return device


def move(model: nn.Module, device: torch.device) -> None:
    """Put a loaded model's weights on `device`: its parameters and buffers, each projection's kernel pool (a plain
    attribute, `model/weights.py`) and tensors that modules hold in dataclasses (rotary frequencies)."""
    if device == CPU:
        return
    model.to(device)
    for module in model.modules():
        for name, value in list(vars(module).items()):
            moved = _moved(value, device)
            if moved is not value:
                object.__setattr__(module, name, moved)


def _moved(value: Any, device: torch.device) -> Any:
    if isinstance(value, Pool):
        return value.to(device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: v.to(device)
            for f in dataclasses.fields(value)
            if isinstance(v := getattr(value, f.name), torch.Tensor) and v.device != device
        }
        return dataclasses.replace(value, **changes) if changes else value
    return value


# What a device keeps free beyond its experts, when no --expert-memory says their budget: KV caches, activations,
# the compiled step's workspace. A tenth of the device, at least 1 GiB.
RESERVE_SHARE, RESERVE_MIN = 0.1, 1 << 30


def expert_room(device: torch.device) -> int:
    """Bytes of `device`'s memory the experts may take when no budget is given: what is free now (after the dense
    weights were moved there) less `RESERVE_SHARE` of the device (at least `RESERVE_MIN`)."""
    free, total = torch.cuda.mem_get_info(device)
    return max(0, int(free - max(total * RESERVE_SHARE, RESERVE_MIN)))


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timing); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
