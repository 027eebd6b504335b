"""`slotmap demo`: the articles' worked example, drawn with `explain`'s tables and read out as the articles do."""

from __future__ import annotations

from rich.console import Console

from slotmap.pictures.explanation import address_path, explain_step
from slotmap.pictures.steps import StepView
from slotmap.pictures.terminal import render

INTRO = (
    "The articles' example: request A holds state row 6 with blocks [81, 44] and 16 tokens computed; "
    "request B holds row 7 with blocks [37, 12] and 31 tokens computed. This step schedules B for 1 token "
    "and A for 8."
)


def render_step(view: StepView, console: Console) -> None:
    ex = explain_step(view)
    console.print(INTRO)
    render(ex, console)
    first = ex.tokens[0]
    console.print(
        f"The articles' address example, flat token 0 (request {first.req_id}): "
        f"position → (logical block, offset) → physical block → slot = {address_path(first, 0)}"
    )
