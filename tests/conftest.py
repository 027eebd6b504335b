"""Fixtures the tests share: `mode` runs a test once in each of fast's CPU modes. (`one_torch_thread`, which keeps
a test on one intra-op thread, comes from conformance/pytest_plugin.py, loaded for every test run here.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fast.runtime import HAVE_TRITON, interpret


@pytest.fixture(params=["host", pytest.param("interpret", marks=pytest.mark.interpret)])
def mode(request: pytest.FixtureRequest) -> Iterator[str]:
    """Host mode (no Triton), then the kernels through Triton's interpreter, on CPU tensors."""
    if request.param == "interpret" and not HAVE_TRITON:
        pytest.skip("Triton is not installed on this platform")
    with interpret(request.param == "interpret"):
        yield request.param
