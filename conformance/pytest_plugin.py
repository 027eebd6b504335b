"""pytest plugin (registered through the `pytest11` entry point): `--backend` and Hypothesis profiles."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from conformance.backends import BackendHandle, load_backend

settings.register_profile(
    "ci", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.register_profile(
    "thorough", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backend",
        action="append",
        default=None,
        help="backend under test: spec, fast, fast-interpret or module:factory (repeatable; default: all built-in)",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames:
        names = metafunc.config.getoption("--backend") or _default_backends()
        metafunc.parametrize("backend", names, indirect=True, scope="session")


def _default_backends() -> list[str]:
    try:
        import fast  # noqa: F401
    except ImportError:
        return ["spec"]
    return ["spec", "fast", "fast-interpret"]


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest) -> BackendHandle:
    return load_backend(request.param)
