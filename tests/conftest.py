"""Fixtures the tests share: `mode` runs a test once in each of fast's CPU modes; `one_torch_thread` keeps
a test on one intra-op thread (the tiny model's: more only spin against other work on a shared CI machine)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from conformance.differential import one_torch_thread as _one_thread
from fast.runtime import HAVE_TRITON, interpret


@pytest.fixture(params=["host", pytest.param("interpret", marks=pytest.mark.interpret)])
def mode(request: pytest.FixtureRequest) -> Iterator[str]:
    """Host mode (no Triton), then the kernels through Triton's interpreter, on CPU tensors."""
    if request.param == "interpret" and not HAVE_TRITON:
        pytest.skip("Triton is not installed on this platform")
    with interpret(request.param == "interpret"):
        yield request.param


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    with _one_thread():
        yield
