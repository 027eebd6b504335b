"""fast offers spec's interface: the same public names, the same objects for shared types, the same signatures.

Documented differences, and only these:
- fast.RequestStatePool.__init__ takes an extra, defaulted `device` parameter.
- array annotations name the backend's array type: np.ndarray in spec, torch.Tensor in fast.
tests/typecheck_backends.py has mypy check both modules against the spec.Backend Protocol.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import fast
import spec

IMPLEMENTED = {
    "RequestStatePool",
    "write_kv",
    "paged_attention",
    "write_mla_kv",
    "mla_decode_attention",
    "mla_prefill_attention",
    "sparse_slot_mapping",
    "sparse_paged_attention",
    "sparse_mla_attention",
}  # fast's own; everything else is spec's object


def _normalised(sig: inspect.Signature, drop: tuple[str, ...] = ()) -> list[tuple[Any, ...]]:
    def ann(a: Any) -> str:
        text = a if isinstance(a, str) else repr(a)
        return text.replace("np.ndarray", "Array").replace("torch.Tensor", "Array")

    params = [(p.name, p.kind, p.default, ann(p.annotation)) for p in sig.parameters.values() if p.name not in drop]
    return [*params, ("->", ann(sig.return_annotation))]


def test_fast_exports_spec_public_names() -> None:
    assert set(fast.__all__) == set(spec.__all__)
    for name in fast.__all__:
        assert hasattr(fast, name), name


@pytest.mark.parametrize("name", sorted(set(spec.__all__) - IMPLEMENTED))
def test_shared_names_are_spec_objects(name: str) -> None:
    assert getattr(fast, name) is getattr(spec, name)


@pytest.mark.parametrize(
    "name",
    [
        "write_kv",
        "paged_attention",
        "write_mla_kv",
        "mla_decode_attention",
        "mla_prefill_attention",
        "sparse_slot_mapping",
        "sparse_paged_attention",
        "sparse_mla_attention",
    ],
)
def test_kernel_signatures_match(name: str) -> None:
    assert _normalised(inspect.signature(getattr(fast, name))) == _normalised(inspect.signature(getattr(spec, name)))


def _public_methods(cls: type) -> set[str]:
    return {n for n, v in vars(cls).items() if callable(v) and (not n.startswith("_") or n == "__init__")}


def test_pool_methods_and_signatures_match() -> None:
    spec_cls, fast_cls = spec.RequestStatePool, fast.RequestStatePool
    assert _public_methods(fast_cls) == _public_methods(spec_cls)
    for name in sorted(_public_methods(spec_cls)):
        drop = ("device",) if name == "__init__" else ()
        got = _normalised(inspect.signature(getattr(fast_cls, name)), drop)
        assert got == _normalised(inspect.signature(getattr(spec_cls, name))), name
    device = inspect.signature(fast_cls.__init__).parameters["device"]
    assert device.default == "cpu"  # the one extra parameter is optional, so spec's calls work unchanged


def test_mypy_checks_the_backend_protocol_file() -> None:
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    mypy_files = re.search(r"\[tool\.mypy\][^\[]*?\nfiles = \[([^\]]*)\]", pyproject)
    assert mypy_files is not None and '"tests/typecheck_backends.py"' in mypy_files.group(1)
