"""Where spec refuses: every raise of a ScheduleError in spec's checks, found by reading spec's source.

A *site* is one `raise SomeError(...)` (or one call of a check's local `fail(...)` helper) in the files
of SITE_FILES, named by its file, its function and the source text of the call. conformance/rules.py
lists a rule for every site; `sites()` is how its test finds a site the list lacks, and
`site_of(exc)` maps a raised error back to its site, so a run of the generators can say which sites its
invalid outputs reached.
"""

from __future__ import annotations

import ast
import traceback
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import spec

SPEC_DIR = Path(spec.__file__).resolve().parent
# the files whose raises are acceptance rules
SITE_FILES = (
    "validate.py",
    "group_rules.py",
    "drafts.py",
    "pool.py",
    "mrope.py",
    "cross_attention.py",
    "mamba.py",
    "async_steps.py",
)


@dataclass(frozen=True)
class Site:
    file: str  # relative to spec/
    function: str
    line: int
    source: str  # the call's source text, e.g. 'BlockIdError(s.req_id, f"block_ids[{g}]", ...)'


@cache
def sites() -> tuple[Site, ...]:
    """Every refusal site of SITE_FILES: raises of *Error calls, and calls of a local `fail` helper."""
    found = []
    for name in SITE_FILES:
        text = (SPEC_DIR / name).read_text()
        for function in ast.walk(ast.parse(text)):
            if not isinstance(function, ast.FunctionDef) or function.name == "fail":
                continue
            for node in _own_nodes(function):
                call = _refusal_call(node)
                if call is not None:
                    source = ast.get_source_segment(text, call) or ""
                    found.append(Site(name, function.name, call.lineno, " ".join(source.split())))
    return tuple(sorted(set(found), key=lambda s: (s.file, s.line)))


def _own_nodes(function: ast.FunctionDef) -> list[ast.AST]:
    """The nodes of `function`'s body, not of functions defined inside it (those are walked on their own)."""
    out: list[ast.AST] = []
    todo: list[ast.AST] = [n for n in function.body if not isinstance(n, ast.FunctionDef)]
    while todo:
        node = todo.pop()
        out.append(node)
        todo.extend(n for n in ast.iter_child_nodes(node) if not isinstance(n, ast.FunctionDef))
    return out


def _refusal_call(node: ast.AST) -> ast.Call | None:
    if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name):
        return node.exc if node.exc.func.id.endswith("Error") else None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "fail":
        return node
    return None


def site_of(exc: BaseException) -> Site | None:
    """The site that raised `exc`: the innermost frame in SITE_FILES (a `fail` helper's caller for a fail)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).parent == SPEC_DIR]
    frames = [f for f in frames if Path(f.filename).name in SITE_FILES]
    if not frames:
        return None
    frame = frames[-2] if frames[-1].name == "fail" and len(frames) > 1 else frames[-1]
    by_line = {(s.file, s.line): s for s in sites()}
    return by_line.get((Path(frame.filename).name, frame.lineno or 0)) or _enclosing(frame)


def _enclosing(frame: traceback.FrameSummary) -> Site | None:
    """A call spanning several lines: the site of that function whose call starts last before the frame's line."""
    name, line = Path(frame.filename).name, frame.lineno or 0
    before = [s for s in sites() if s.file == name and s.function == frame.name and s.line <= line]
    return max(before, key=lambda s: s.line) if before else None
