"""Without `--expert-memory`, experts that do not fit in the memory still free are paged within it, with a warning,
instead of the process being killed for memory halfway through loading; experts that fit stay all resident."""

from __future__ import annotations

import logging
from typing import Any

import pytest

import moelane
from moelane.commands import main
from moelane.model.provider import ResidentProvider
from moelane.pager.live import ceiling as ceiling_module
from moelane.pager.live.build import fitting_factory
from moelane.pager.live.ceiling import HEADROOM
from moelane.pager.live.limits import MemoryLimit, ProcessMemory
from moelane.pager.live.store import ExpertStore, StoreError

EXPERT_BYTES = 6 * 32 * 3 * 192 * 96 * 4  # the shipped model's experts in float32 (6 MoE layers of 32)


def with_free(monkeypatch: pytest.MonkeyPatch, n_bytes: int) -> None:
    """Free memory of `n_bytes`, no limit, and nothing reserved besides (so budgets are plain to compute)."""
    monkeypatch.setattr(ceiling_module, "memory_limit", lambda: MemoryLimit(n_bytes, None, "free memory"))
    monkeypatch.setattr(ceiling_module, "process_memory", lambda: ProcessMemory(0, 0))
    monkeypatch.setattr(ceiling_module, "reserve", lambda footprint: 0)


def test_experts_that_fit_stay_resident_and_others_are_paged_within_the_free_memory(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with_free(monkeypatch, 2 * EXPERT_BYTES)
    assert isinstance(moelane.load(provider=fitting_factory()).provider, ResidentProvider)
    with_free(monkeypatch, EXPERT_BYTES // 2)
    with caplog.at_level(logging.WARNING):
        lm = moelane.load(provider=fitting_factory())
    store = lm.provider
    assert isinstance(store, ExpertStore)
    assert store.config.budget_bytes == int(EXPERT_BYTES // 2 * (1 - HEADROOM))
    assert "paging them within" in caplog.text and "--expert-memory" in caplog.text
    store.close()
    with_free(monkeypatch, 1000)
    with pytest.raises(StoreError, match="holds no expert"):
        moelane.load(provider=fitting_factory())


def test_run_pages_what_does_not_fit_and_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: Any, caplog: pytest.LogCaptureFixture
) -> None:
    argv = ["run", "--max-tokens", "24", "--compile", "off", "--stats", "def fibonacci(n):"]
    with_free(monkeypatch, 4 * EXPERT_BYTES)
    assert main(argv) == 0
    resident = capsys.readouterr()
    assert "not in use (all experts resident)" in resident.err and "paging" not in caplog.text
    with_free(monkeypatch, (16 << 20) + EXPERT_BYTES // 3)  # (the dense weights take ~14.4 MiB of it)
    with caplog.at_level(logging.WARNING):
        assert main(argv) == 0
    fitted = capsys.readouterr()
    assert fitted.out == resident.out  # the same reply, paged
    assert "paging them within" in caplog.text and "misses" in fitted.err
