"""The picture behind `slotmap explain --svg/--png`: one step's index spaces in one image.

Top: the state pool rows, and the batch with an arrow from each batch_idx to its req_state_idx
(index_mapping). Middle: the flat token strip, coloured by request, with query_start_loc boundaries.
Bottom, per KV group: the slots written this step, grouped by physical block, with an arrow from each
token to its slot and, under each slot, its offset, logical block and physical block. Drawn in "cell"
units (one token cell wide); text stays text in the SVG.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from slotmap.pictures.explanation import Explanation, TokenRow, group_label

if TYPE_CHECKING:
    from slotmap.pictures.mla import MlaExplanation
    from slotmap.pictures.ubatch import UbatchExplanation

INCH_PER_CELL = 0.42
CHAR = 0.17  # width of one 8pt monospace character, in cells
ROW = 0.8  # height of a table row, in cells
LEFT = 7.5  # room for the strip labels, in cells
GROUP_HEIGHT = 3.0 + 5 * ROW  # arrows, then the slot, offset, logical, physical and caption rows of one group
BLOCK_GAP = 0.6  # space between two physical blocks in a slot strip, in cells
PAD_HATCH = "////"  # padding tokens and padded request rows: hatched grey, never a request's colour
RC: dict[str, Any] = {"svg.fonttype": "none", "svg.hashsalt": "slotmap", "font.family": "monospace", "font.size": 8}


def save_picture(
    ex: Explanation,
    path: Path,
    fmt: str = "svg",
    max_tokens: int = 64,
    ubatch: UbatchExplanation | None = None,
    mla: MlaExplanation | None = None,
) -> None:
    """Writes the picture as `fmt` ("svg" or "png"). Only the first `max_tokens` tokens are drawn. With `ubatch`
    the token strip marks the two micro-batches; with `mla` the batch rows say which MLA path each takes."""
    with matplotlib.rc_context(RC):  # type: ignore[arg-type]  # matplotlib types rc keys as a Literal
        fig = draw(ex, max_tokens, ubatch, mla)
        metadata = {"Date": None} if fmt == "svg" else {}  # no date: regenerating an unchanged picture changes nothing
        fig.savefig(path, format=fmt, metadata=metadata, dpi=150)


def draw(
    ex: Explanation, max_tokens: int = 64, ubatch: UbatchExplanation | None = None, mla: MlaExplanation | None = None
) -> Figure:
    tokens = ex.tokens[:max_tokens]
    strips = [_slot_strip(tokens, g) for g in range(len(ex.groups))]
    table_width, table_height = _table_size(ex)
    table_height = max(table_height, ROW * (len(ex.batch_rows) + len(ex.padded_rows) + 1))
    strip_width = LEFT + max([len(tokens), *(width for _, width in strips)]) + 1
    width = max(table_width + 16, strip_width)
    gap = 1.5 + (1.2 if ubatch is not None else 0.0)  # the micro-batch spans sit above the token strip
    height = 1.5 + table_height + gap + 4 * ROW + len(ex.groups) * GROUP_HEIGHT

    fig = Figure(figsize=(width * INCH_PER_CELL, height * INCH_PER_CELL))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(-height, 0)
    ax.axis("off")
    shown = "" if len(tokens) == len(ex.tokens) else f" (first {len(tokens)} of {len(ex.tokens)} tokens)"
    ax.text(0.3, -0.7, (ex.title or "one step") + shown, fontsize=11, weight="bold", va="center")

    top = -1.5
    row_y = _draw_state_table(ax, ex, top)
    _draw_batch(ax, ex, row_y, x=table_width + 4, top=top)
    _draw_padded_rows(ax, ex, x=table_width + 4, top=top)
    if mla is not None:
        _draw_mla_paths(ax, ex, mla, x=table_width + 4 + 6.4, top=top)
    y = top - table_height - gap
    token_bottom = _draw_tokens(ax, ex, tokens, y)
    if ubatch is not None:
        _draw_ubatch(ax, ubatch, len(tokens), y, token_bottom)
    for g, (cells, _) in enumerate(strips):
        _draw_slots(ax, ex, tokens, g, cells, token_bottom, y=token_bottom - 3.0 - GROUP_HEIGHT * g)
    return fig


def _columns(ex: Explanation) -> list[tuple[str, list[str]]]:
    cols = [
        ("req_state_idx", [str(s.row) for s in ex.state_rows]),
        ("req_id", [s.req_id for s in ex.state_rows]),
        ("computed/known", [f"{s.num_computed_tokens}/{s.num_known_tokens}" for s in ex.state_rows]),
    ]
    for g in range(len(ex.groups)):
        cols.append((f"block_table[{g}]", [str(list(s.block_ids[g])) for s in ex.state_rows]))
    return cols


def _table_size(ex: Explanation) -> tuple[float, float]:
    widths = [CHAR * max(len(v) for v in (head, *values)) + 0.6 for head, values in _columns(ex)]
    return 0.3 + sum(widths), ROW * (len(ex.state_rows) + 1)


def _draw_state_table(ax: Axes, ex: Explanation, top: float) -> dict[int, float]:
    """Returns req_state_idx -> y of its row centre."""
    x = 0.3
    centre = {s.row: top - ROW * (i + 1.5) for i, s in enumerate(ex.state_rows)}
    for head, values in _columns(ex):
        w = CHAR * max(len(v) for v in (head, *values)) + 0.6
        ax.text(x + 0.3, top - ROW / 2, head, weight="bold", va="center")
        for s, value in zip(ex.state_rows, values, strict=True):
            ax.add_patch(Rectangle((x, centre[s.row] - ROW / 2), w, ROW, fc=ex.colour(s.req_id), alpha=0.25, lw=0))
            ax.text(x + 0.3, centre[s.row], value, va="center")
        x += w
    ax.text(0.3, top - ROW * (len(ex.state_rows) + 1) - 0.4, "request state pool (rows after apply)", style="italic")
    return centre


def _draw_batch(ax: Axes, ex: Explanation, row_y: dict[int, float], x: float, top: float) -> None:
    ax.text(x, top - ROW / 2, "batch_idx", weight="bold", va="center")
    for r in ex.batch_rows:
        y = top - ROW * (r.batch_idx + 1.5)
        ax.add_patch(Rectangle((x, y - ROW * 0.4), 5.0, ROW * 0.8, fc=ex.colour(r.req_id), alpha=0.6, lw=0))
        ax.text(x + 0.2, y, f"{r.batch_idx}: {r.req_id} ×{r.num_scheduled_tokens}", va="center")
        ax.annotate(
            "", xy=(x - 3.6, row_y[r.req_state_idx]), xytext=(x, y),
            arrowprops={"arrowstyle": "->", "color": ex.colour(r.req_id), "lw": 1.2},
        )  # fmt: skip
    rows = len(ex.batch_rows) + len(ex.padded_rows)
    ax.text(x, top - ROW * (rows + 1) - 0.4, "index_mapping: batch_idx → req_state_idx", style="italic")


def _draw_padded_rows(ax: Axes, ex: Explanation, x: float, top: float) -> None:
    """A FULL graph's request rows past the real ones: hatched, no arrow (index_mapping -1 names no row)."""
    for p in ex.padded_rows:
        y = top - ROW * (p.batch_idx + 1.5)
        ax.add_patch(Rectangle((x, y - ROW * 0.4), 6.2, ROW * 0.8, fc="white", ec="grey", hatch=PAD_HATCH, lw=0.5))
        zero = all(b == 0 for t in p.block_tables for b in t)
        label = f"{p.batch_idx}: pad → {p.req_state_idx}, seq_len {p.seq_len}" + (", blocks 0" if zero else "")
        ax.text(x + 0.2, y, label, va="center", fontsize=7, bbox={"fc": "white", "ec": "none", "pad": 0.5})
    if ex.descriptor is not None:
        d = ex.descriptor
        rows = len(ex.batch_rows) + len(ex.padded_rows)
        ax.text(
            x, top - ROW * (rows + 1) - 1.2,
            f"graph: {d.mode}, {d.num_tokens} tokens, {d.num_reqs} request rows, uniform {d.uniform}",
            style="italic",
        )  # fmt: skip


def _draw_mla_paths(ax: Axes, ex: Explanation, mla: MlaExplanation, x: float, top: float) -> None:
    """Beside each real batch row: the MLA kernel it runs (decode-first order, spec/mla_split.py)."""
    kernel_row = {b: new for new, b in enumerate(mla.order)}
    for r in ex.batch_rows:
        decode = kernel_row[r.batch_idx] < mla.split.num_decodes
        y = top - ROW * (r.batch_idx + 1.5)
        label, weight = ("MLA decode", "bold") if decode else ("MLA prefill", None)
        ax.text(x, y, label, va="center", fontsize=7, weight=weight)


def _draw_ubatch(ax: Axes, ux: UbatchExplanation, shown: int, y: float, bottom: float) -> None:
    """The split point on the token strip, each half's span and rows above it."""
    if ux.split_point <= shown:
        ax.plot([LEFT + ux.split_point] * 2, [y + 0.1, bottom - 0.4], color="crimson", lw=2.5, ls="--")
    for i, h in enumerate(ux.halves):
        left, right = LEFT + h.token_start, LEFT + min(h.token_stop, shown)
        if right <= left:
            continue
        arrow = {"arrowstyle": "<->", "color": "crimson"}
        ax.annotate("", xy=(left, y + 0.45), xytext=(right, y + 0.45), arrowprops=arrow)
        label = f"ubatch {i}: rows [{h.request_start}, {h.request_stop}), qsl {list(h.query_start_loc)}"
        ax.text((left + right) / 2, y + 0.85, label, ha="center", va="center", fontsize=7, color="crimson")


def _draw_tokens(ax: Axes, ex: Explanation, tokens: tuple[TokenRow, ...], y: float) -> float:
    """Draws the flat token strip from y down; returns the y of its bottom edge."""
    labels = ("query_start_loc", "flat idx", "position", "input_id")
    for i, label in enumerate(labels):
        ax.text(LEFT - 1.0, y - ROW * (i + 0.5), label, ha="right", va="center", weight="bold")
    for t in tokens:
        x = LEFT + t.flat_idx
        if t.req_id is None:  # padding: hatched, so it never reads as a request's token
            ax.add_patch(Rectangle((x, y - 4 * ROW), 1, 2 * ROW, fc="white", ec="grey", hatch=PAD_HATCH, lw=0.5))
            ax.text(x + 0.5, y - 4.5 * ROW, str(min(t.slots)), ha="center", va="center", fontsize=6, color="grey")
        else:
            ax.add_patch(Rectangle((x, y - 4 * ROW), 1, 2 * ROW, fc=ex.colour(t.req_id), alpha=0.6, ec="white"))
        ax.text(x + 0.5, y - 1.5 * ROW, str(t.flat_idx), ha="center", va="center")
        ax.text(x + 0.5, y - 2.5 * ROW, str(t.position), ha="center", va="center")
        ax.text(x + 0.5, y - 3.5 * ROW, str(t.input_id), ha="center", va="center", fontsize=7)
    pads = [t.flat_idx for t in tokens if t.req_id is None]
    if pads:
        ax.text(LEFT + pads[-1] + 1, y - 5.2 * ROW, "padding: position 0, input id 0, slot -1 (PAD)", ha="right",
                fontsize=7, color="grey", style="italic")  # fmt: skip
    for b, start in enumerate(ex.query_start_loc[: len(ex.batch_rows) + 1]):  # padded rows repeat the real count
        if start > len(tokens):
            break
        ax.plot([LEFT + start] * 2, [y - ROW, y - 4 * ROW], color="black", lw=1.5)
        ax.text(LEFT + start, y - 0.5 * ROW, f"[{b}]={start}", ha="center", va="center", fontsize=7)
    return y - 4 * ROW


def _slot_strip(tokens: tuple[TokenRow, ...], g: int) -> tuple[dict[int, float], float]:
    """Lays the step's written slots of group g out by slot, a gap between physical blocks.

    Returns (flat idx -> x of its slot cell, relative to LEFT; strip width in cells).
    """
    real = sorted((t.addresses[g].slot, t.addresses[g].physical_block, t.flat_idx) for t in tokens if t.addresses)
    cells: dict[int, float] = {}
    x, last_block = 0.0, None
    for _, block, flat_idx in real:
        if last_block is not None and block != last_block:
            x += BLOCK_GAP
        cells[flat_idx] = x
        x, last_block = x + 1, block
    return cells, x


def _draw_slots(
    ax: Axes,
    ex: Explanation,
    tokens: tuple[TokenRow, ...],
    g: int,
    cells: dict[int, float],  # flat idx -> x of its slot cell, relative to LEFT
    token_bottom: float,
    y: float,
) -> None:
    for i, label in enumerate((f"slot_mapping[{g}]", "offset", "logical block", "physical block")):
        ax.text(LEFT - 1.0, y - ROW * (i + 0.5), label, ha="right", va="center", weight="bold")
    ax.text(
        LEFT,
        y - 4.5 * ROW,
        f"{group_label(g, ex.groups[g])}: slot = physical block * block_size + offset",
        va="center",
        style="italic",
    )
    by_flat = {t.flat_idx: t for t in tokens}
    blocks: dict[int, list[float]] = {}
    for flat_idx, cx in cells.items():
        t = by_flat[flat_idx]
        a = t.addresses[g]
        x = LEFT + cx
        ax.add_patch(Rectangle((x, y - ROW), 1, ROW, fc=ex.colour(t.req_id), alpha=0.6, ec="white"))
        ax.text(x + 0.5, y - ROW / 2, str(a.slot), ha="center", va="center", fontsize=6)
        ax.text(x + 0.5, y - 1.5 * ROW, str(a.offset), ha="center", va="center", fontsize=7)
        ax.text(x + 0.5, y - 2.5 * ROW, str(a.logical_block), ha="center", va="center", fontsize=7)
        ax.annotate(
            "", xy=(x + 0.5, y), xytext=(LEFT + flat_idx + 0.5, token_bottom),
            arrowprops={"arrowstyle": "->", "color": ex.colour(t.req_id), "lw": 0.8, "alpha": 0.8},
        )  # fmt: skip
        blocks.setdefault(a.physical_block, []).append(x)
    for block, xs in blocks.items():
        left, right = min(xs), max(xs) + 1
        ax.plot([left, right], [y - 3 * ROW - 0.1] * 2, color="black", lw=1)
        ax.text((left + right) / 2, y - 3.5 * ROW, str(block), ha="center", va="center", fontsize=7)
