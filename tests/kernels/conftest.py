"""Fixtures for the kernel tests: the extension built once per session, both implementations, random pools."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from moelane import kernels


@pytest.fixture(scope="session")
def extension() -> kernels.Availability:
    """The extension, built (or loaded from the cache) once per session; fails with the build error if it cannot."""
    kernels.use_fallback(False)
    found = kernels.ensure_built()
    if found.backend == "fallback":
        pytest.fail(f"the extension did not build: {found.error}")
    return found


@pytest.fixture(params=["extension", "fallback"])
def impl(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a test on the extension, then on the forced fallback."""
    request.getfixturevalue("extension")
    kernels.use_fallback(request.param == "fallback")
    try:
        yield request.param
    finally:
        kernels.use_fallback(False)


@pytest.fixture
def threads() -> Iterator[None]:
    """Restores torch's thread count after a test that changes it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
