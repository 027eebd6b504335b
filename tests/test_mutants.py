"""The mutation harness's list stays true to the code: every planted text still occurs once where it is planted."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mutants import MUTANTS, Mutant

ROOT = Path(__file__).resolve().parent.parent


def test_mutant_names_are_unique() -> None:
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_each_mutant_still_applies(mutant: Mutant) -> None:
    text = (ROOT / mutant.path).read_text()
    assert text.count(mutant.old) == 1, f"{mutant.name}: its text occurs {text.count(mutant.old)} times"
    assert mutant.old != mutant.new
    for test in mutant.tests:
        assert (ROOT / test.split("::")[0]).is_file(), test
