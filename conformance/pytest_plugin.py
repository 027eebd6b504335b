"""pytest plugin of the conformance suite: `--backend`, the `backend` fixture and Hypothesis profiles.

Active only where asked: this project's pyproject.toml loads it (`addopts = "-p conformance.pytest_plugin"`);
another project that wants to run the suite against its backend passes `-p conformance.pytest_plugin`
itself. slotmap registers no pytest entry point, so installing it adds nothing to unrelated test runs.

Also `--conformance-scale` (multiplies the differential suite's per-backend example budgets), the
`one_torch_thread` fixture, and a terminal summary of how many scheduler steps and requests the
differential suite compared.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from conformance.backends import BackendHandle, canonical_name, load_backend

settings.register_profile(
    "ci", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.register_profile("thorough", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backend",
        action="append",
        default=None,
        help="backend under test: spec, fast, fast-interpret or module:factory (repeatable; default: all built-in)",
    )
    parser.addoption(
        "--conformance-scale",
        type=float,
        default=1.0,
        help="multiply the differential suite's per-backend example budgets (on top of the Hypothesis profile)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "not_on_backends(*names, reason): a whole-workload test that these backends do not run (e.g. the "
        "Triton interpreter, ~1000x slower than compiled); they are covered by the suite's smaller tests",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames:
        # `fast` under SLOTMAP_TRITON_INTERPRET is `fast-interpret`: run it once, and under its real name
        asked = metafunc.config.getoption("--backend") or _default_backends()
        names = list(dict.fromkeys(canonical_name(n) for n in asked))
        excluded = {n for mark in metafunc.definition.iter_markers("not_on_backends") for n in mark.args}
        metafunc.parametrize("backend", [n for n in names if n not in excluded], indirect=True, scope="session")


def _default_backends() -> list[str]:
    try:
        import fast  # noqa: F401
    except ImportError:
        return ["spec"]
    return ["spec", "fast", "fast-interpret"]


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest) -> BackendHandle:
    return load_backend(request.param)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One intra-op torch thread for the test (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`)."""
    from conformance.differential import one_torch_thread as one_thread  # lazily: the plugin loads before torch

    with one_thread():
        yield


@pytest.fixture(scope="session")
def conformance_scale(request: pytest.FixtureRequest) -> float:
    return float(request.config.getoption("--conformance-scale"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    differential = sys.modules.get("conformance.differential")  # only if the differential suite ran
    counts = getattr(differential, "COUNTS", None)
    if not counts or not counts.get("steps"):
        return
    per_backend = ", ".join(
        f"{key[len('steps[') : -1]}: {n}" for key, n in sorted(counts.items()) if key.startswith("steps[")
    )
    terminalreporter.write_sep("-", "conformance")
    terminalreporter.write_line(
        f"compared {counts['steps']} scheduler steps ({per_backend}), {counts['requests']} requests, "
        f"{counts['invalid']} invalid outputs rejected identically"
    )
