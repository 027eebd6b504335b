"""The one way the suite says "these batches differ": field by field, integers exactly, dtype and shape included.

Batches are compared in BackendHandle.batch_to_numpy's form (every BatchInputs field in NumPy or Python
form, the draft fields None in a step without drafts). Each difference is one line naming the field
(`slot_mappings[1]`, `draft_token_ids`) and, for arrays, how many entries differ and the first few: a
padded array can be thousands long. The shadow checker words its per-request details with the same
`entries_difference`, naming the entries (`its token 3`) and the reference (`spec`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

SHOWN = 8  # differing entries listed per array


def batch_differences(want: Mapping[str, Any], got: Mapping[str, Any]) -> list[str]:
    """One line per field that `got` does not match (empty: the batches agree)."""
    problems = [f"{name}: not a field of the expected batch" for name in got if name not in want]
    for name, w in want.items():
        if name not in got:
            problems.append(f"{name}: missing")
            continue
        g = got[name]
        if w is None or g is None:  # a draft field of a step without drafts
            if (w is None) != (g is None):
                problems.append(f"{name}: {_brief(g)}, expected {_brief(w)}")
        elif isinstance(w, tuple) and name != "req_ids":  # per KV group
            if len(w) != len(g):
                problems.append(f"{name}: {len(g)} groups, expected {len(w)}")
            problems += [_group_difference(f"{name}[{i}]", a, b) for i, (a, b) in enumerate(zip(w, g, strict=False))]
        elif isinstance(w, np.ndarray):
            problems.append(array_difference(name, w, g))
        elif w != g:
            problems.append(f"{name}: {g!r}, expected {w!r}")
    return [p for p in problems if p]


def _group_difference(name: str, want: np.ndarray | None, got: Any) -> str:
    """One group's array; None where the field has no array for that group (the mamba fields' other groups)."""
    if want is None or got is None:
        return "" if want is None and got is None else f"{name}: {_brief(got)}, expected {_brief(want)}"
    return array_difference(name, want, got)


def differing_fields(want: Mapping[str, Any], got: Mapping[str, Any]) -> list[str]:
    """The names of the fields batch_differences reports."""
    return sorted({line.split(":")[0].split("[")[0] for line in batch_differences(want, got)})


def array_difference(name: str, want: np.ndarray, got: Any) -> str:
    """ "" if `got` equals `want` exactly (dtype, shape, values), else one line saying how it differs."""
    got = np.asarray(got)
    if got.dtype != want.dtype:
        return f"{name}: dtype {got.dtype}, expected {want.dtype}"
    detail = entries_difference(want, got)
    return f"{name}: {detail}" if detail else ""


def entries_difference(want: np.ndarray, got: np.ndarray, entry: str = "", reference: str = "expected") -> str:
    """ "" if shapes and values agree, else how: both shapes and heads, or how many entries differ and the first few.

    `entry` names an entry in the report (`its token` -> `its token 3: got 5, spec 4`; "" -> `(3,): ...`).
    """
    if got.shape != want.shape:
        return f"shape {got.shape} {_head(got)}, {reference} {want.shape} {_head(want)}"
    where = np.argwhere(got != want).tolist()
    if not where:
        return ""

    def at(i: list[int]) -> str:
        return f"{entry} {', '.join(map(str, i))}" if entry else str(tuple(i))

    shown = "; ".join(f"{at(i)}: got {got[tuple(i)]}, {reference} {want[tuple(i)]}" for i in where[:SHOWN])
    more = f" (and {len(where) - SHOWN} more)" if len(where) > SHOWN else ""
    return f"{len(where)} of {want.size} entries differ: {shown}{more}"


def copy_batch(batch: Mapping[str, Any]) -> dict[str, Any]:
    """A batch in NumPy form that a later prepare cannot change (a backend may reuse its buffers)."""
    copied = {}
    for name, value in batch.items():
        if isinstance(value, tuple) and name != "req_ids":
            value = tuple(None if a is None else np.array(a) for a in value)  # None: no array for that group
        elif isinstance(value, np.ndarray):
            value = np.array(value)
        copied[name] = value
    return copied


def _brief(value: Any) -> str:
    return "None" if value is None else f"{np.asarray(value).size} entries"


def _head(x: np.ndarray) -> str:
    flat = x.reshape(-1).tolist()
    return str(flat[: 2 * SHOWN])[:-1] + (", ...]" if len(flat) > 2 * SHOWN else "]")
