"""Option checks that run while typer parses the command line, so a misuse stops before any work starts.

Each callback turns a bad value into `typer.BadParameter`: one line that says what to pass instead,
under typer's usage line, with exit status 2.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import typer

BACKEND_HELP = "spec, fast, fast-interpret, or module:factory"


def backend(name: str) -> str:
    """The backend must load now (the handle is built again, cheaply, when the command runs)."""
    from conformance.backends import BackendLoadError, load_backend

    try:
        load_backend(name)
    except BackendLoadError as e:
        raise typer.BadParameter(str(e)) from e
    return name


def _output(path: Path, what: str) -> None:
    if path.is_dir():
        raise typer.BadParameter(f"{path} is a directory: give a file path for {what}")


def figure(path: Path | None) -> Path | None:
    """A picture path whose suffix names a format matplotlib can write (`run.png`, `run.svg`, `run.pdf`, ...)."""
    if path is None:
        return None
    from matplotlib.backend_bases import FigureCanvasBase

    _output(path, "the picture")
    if path.suffix.lstrip(".").lower() not in FigureCanvasBase.get_supported_filetypes():
        raise typer.BadParameter(f"cannot tell the format of {path.name!r}: end it in .png, .svg, .pdf (or .jpg, .eps)")
    return path


def suffix(expected: str) -> Callable[[Path | None], Path | None]:
    """A callback for an output that has one format: the path must end in `.expected`."""

    def check(path: Path | None) -> Path | None:
        if path is None:
            return None
        if path.suffix.lower() != f".{expected}":
            raise typer.BadParameter(f"this option writes {expected.upper()}: give a path ending in .{expected}")
        _output(path, f"the {expected.upper()} picture")
        return path

    return check


def new_file(path: Path | None) -> Path | None:
    """A file slotmap creates: nothing (no file, no symlink) may hold the name yet, since it never replaces one."""
    if path is None:
        return None
    _output(path, "the file")
    if os.path.lexists(path):
        raise typer.BadParameter(f"{path} exists: give a new path (slotmap never replaces a file)")
    return path


def machine(name: str | None) -> str | None:
    if name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise typer.BadParameter(f"{name!r} is not a file name: use letters, digits, '.', '_' and '-'")
    return name


def positive(value: float | None) -> float | None:
    if value is not None and not value > 0:
        raise typer.BadParameter(f"must be more than 0 seconds, got {value}")
    return value


# `explain --profile` names -> spec.padding_profiles.PROFILES keys: the attention backends' own spellings
PROFILE_NAMES = {"flashattention": "flash_attn", "flashinfer": "flashinfer", "flashmla": "flashmla"}


def graph_sizes(text: str | None) -> str | None:
    """`--graphs 1,2,4,8`: capture sizes as spec's CapturedGraphs takes them (ascending, distinct, positive)."""
    if text is None:
        return None
    from spec.graphs import CapturedGraphs

    try:
        CapturedGraphs(sizes_of(text), max_num_reqs=1)  # its checks of the sizes, before any step runs
    except ValueError as e:
        raise typer.BadParameter(str(e).replace("CapturedGraphs.capture_sizes", "the sizes")) from None
    return text


def sizes_of(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise typer.BadParameter(f"{text!r}: give token counts separated by commas, e.g. 1,2,4,8,16") from None


def graph_mode(mode: str | None) -> str | None:
    from spec.graphs import GRAPH_MODES

    if mode is not None and mode not in GRAPH_MODES:
        raise typer.BadParameter(f"{mode!r} is not a cudagraph mode: one of {', '.join(GRAPH_MODES)}")
    return mode


def profile(name: str | None) -> str | None:
    if name is not None and name not in PROFILE_NAMES:
        raise typer.BadParameter(f"{name!r} is not a padding profile: one of {', '.join(PROFILE_NAMES)}")
    return name
