"""The tiny random qwen3_moe every distributed test runs (10 experts a layer, top-3, 2 MoE layers), built once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers import random_model


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_model("qwen3_moe", tmp_path_factory.mktemp("dist") / "tiny")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """The reference runs on one compute thread, as each rank does: on a busy machine, a team of threads per process
    waits on each other far longer than the work takes (4 tiny replies: 0.3 s on one thread, 8 s on two)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
