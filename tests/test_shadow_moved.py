"""The shadow checker moved from conformance/ to its own package: the old import paths still work for a release,
and say where it went."""

from __future__ import annotations

import importlib
import sys

import pytest

import shadow
import shadow.vllm_attach


@pytest.mark.parametrize(
    ("old", "new", "name"),
    [
        ("conformance.shadow", shadow, "ShadowChecker"),
        ("conformance.vllm_attach", shadow.vllm_attach, "attach"),
    ],
)
def test_the_old_import_path_warns_and_gives_the_same_objects(old: str, new: object, name: str) -> None:
    sys.modules.pop(old, None)  # a module warns when it is first imported
    with pytest.warns(DeprecationWarning, match="moved"):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(new, name)
    assert set(module.__all__) <= set(dir(new))
