"""`slotmap explain --mla [--topk K]`: a step of an MLA model (spec/mla_cache.py, mla_split.py, sparse_topk.py).

An mla group's slots are an attention group's; what a slot holds differs: one vector per token,
kv_lora_rank latent elements then qk_rope_head_dim RoPE-key elements, no head axis, no value cache
(`mla_cache_shape`). Shown: the latent blocks the step writes (which slots of each, one vector each); the
MLA decode/prefill split (spec/mla_split.py: a decode is a row that is not prefilling with at most 1 + K
tokens; the kernels take the batch decode-first, so the rows are shown in decode_first_order); and with
`topk` one query's sparse selection: K positions drawn (seeded) from its causal range [0, p], their slots
by sparse_slot_mapping, beside the row's table entry each goes through.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rich.console import Console
from rich.table import Table

from slotmap.pictures.steps import StepView, spec_inputs
from spec.mla_cache import mla_cache_shape
from spec.mla_split import MlaBatchSplit, decode_first_order, mla_decode_rows, split_mla_batch
from spec.sparse_topk import sparse_slot_mapping


@dataclass(frozen=True)
class LatentBlock:
    block: int  # physical block id of the mla group
    req_id: str  # the request whose tokens this step writes into it
    offsets: tuple[int, ...]  # the offsets written this step, one latent vector each
    slots: tuple[int, ...]  # block * block_size + offset, as the backend's slot_mappings say


@dataclass(frozen=True)
class Selection:
    """One query's top-k selection and the slots sparse_slot_mapping gives them."""

    flat_idx: int  # the query token
    req_id: str
    position: int  # the query's position: its causal range is [0, position]
    positions: tuple[int, ...]  # [top_k] the selected positions, -1 for an unused entry
    slots: tuple[int, ...]  # [top_k] their slots (-1 for none)


@dataclass(frozen=True)
class MlaExplanation:
    group: int
    block_size: int
    kv_lora_rank: int
    rope_dim: int
    cache_shape: tuple[int, int, int]  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    blocks: tuple[LatentBlock, ...]  # the latent blocks the step writes, in flat token order
    threshold: int  # 1 + K: the longest query a decode row runs
    is_decode: tuple[bool, ...]  # [num_reqs] batch order
    order: tuple[int, ...]  # [num_reqs] decode-first batch_idx -> batch_idx
    split: MlaBatchSplit  # over the decode-first order
    req_ids: tuple[str, ...]  # [num_reqs] batch order
    query_lens: tuple[int, ...]  # [num_reqs] batch order
    selection: Selection | None = None


def explain_mla(view: StepView, topk: int = 0) -> MlaExplanation | None:
    """The step's MLA view, or None for a model without an mla group. With `topk` > 0 the batch's last real token
    selects min(topk, position + 1) positions of its causal range, drawn by a generator seeded by the view's seed."""
    mla = [g for g, group in enumerate(view.config.kv_groups) if group.kind == "mla"]
    if not mla:
        return None
    g = mla[0]
    group, batch = view.config.kv_groups[g], view.batch
    req_ids: tuple[str, ...] = batch["req_ids"]
    num_reqs = len(req_ids)
    lens = np.asarray(batch["num_scheduled_tokens"][:num_reqs], np.int64)  # [num_reqs] padded rows left out
    prefilling = np.asarray(batch["row_classes.is_prefilling"], bool)  # [num_reqs]
    threshold = int(batch["row_classes.decode_query_len"])
    order = decode_first_order(lens, prefilling, threshold)  # [num_reqs] new batch_idx -> batch_idx
    split = split_mla_batch(lens[order], prefilling[order], threshold)
    return MlaExplanation(
        g,
        group.block_size,
        group.kv_lora_rank,
        group.qk_rope_head_dim,
        mla_cache_shape(group),
        _latent_blocks(view, g),
        threshold,
        tuple(bool(x) for x in mla_decode_rows(lens, prefilling, threshold)),
        tuple(int(x) for x in order),
        split,
        req_ids,
        tuple(int(x) for x in lens),
        _selection(view, g, topk) if topk > 0 else None,
    )


def _latent_blocks(view: StepView, g: int) -> tuple[LatentBlock, ...]:
    batch, bs = view.batch, view.config.kv_groups[g].block_size
    qsl, req_ids = batch["query_start_loc"], batch["req_ids"]
    written: dict[tuple[str, int], list[tuple[int, int]]] = {}  # (req_id, block) -> [(offset, slot)]
    for b, req_id in enumerate(req_ids):
        for t in range(int(qsl[b]), int(qsl[b + 1])):
            logical, offset = divmod(int(batch["positions"][t]), bs)
            block = int(batch["block_tables"][g][b, logical])
            written.setdefault((req_id, block), []).append((offset, int(batch["slot_mappings"][g][t])))
    return tuple(
        LatentBlock(block, req_id, tuple(o for o, _ in entries), tuple(s for _, s in entries))
        for (req_id, block), entries in written.items()
    )


def _selection(view: StepView, g: int, topk: int) -> Selection | None:
    batch = view.batch
    num_tokens = int(batch["num_tokens"])
    if num_tokens == 0:
        return None
    t = num_tokens - 1
    p = int(batch["positions"][t])
    rng = np.random.default_rng(view.seed)
    chosen = np.sort(rng.choice(p + 1, size=min(topk, p + 1), replace=False))
    indices = np.full((int(batch["num_tokens_padded"]), topk), -1, np.int64)  # [T, top_k] only token t selects
    indices[t, : chosen.size] = chosen
    slots = sparse_slot_mapping(spec_inputs(view), view.config, indices, g)  # [T, top_k]
    req_ids = batch["req_ids"]
    b = int(np.searchsorted(batch["query_start_loc"][1 : len(req_ids) + 1], t, side="right"))
    return Selection(t, req_ids[b], p, tuple(int(x) for x in indices[t]), tuple(int(x) for x in slots[t]))


def render_mla(mx: MlaExplanation, console: Console) -> None:
    console.rule(f"MLA, KV group {mx.group}: one latent vector per slot (spec/mla_cache.py)")
    width = mx.kv_lora_rank + mx.rope_dim
    console.print(
        f"cache [num_blocks, block_size, kv_lora_rank + rope] = {list(mx.cache_shape)}: each slot holds one vector of "
        f"{width} = kv_c [{mx.kv_lora_rank}] (the latent, not rotated) | k_pe [{mx.rope_dim}] (the RoPE key part); "
        "no head axis, no value cache",
        markup=False,
    )
    blocks = Table(title="latent blocks written this step")
    for col in ("physical block", "req_id", "offsets", "slots", "vectors written"):
        blocks.add_column(col, justify="right")
    for lb in mx.blocks:
        blocks.add_row(
            str(lb.block), lb.req_id, _span(lb.offsets), _span(lb.slots),
            f"{len(lb.offsets)} × [{mx.kv_lora_rank} | {mx.rope_dim}]",
        )  # fmt: skip
    console.print(blocks)
    split = Table(
        title=f"MLA decode/prefill split, decode-first order (a decode: not prefilling, <= {mx.threshold} tokens)"
    )
    for col in ("kernel row", "batch_idx", "req_id", "query len", "path"):
        split.add_column(col, justify="right")
    for new, b in enumerate(mx.order):
        path = "decode (absorbed)" if new < mx.split.num_decodes else "prefill"
        split.add_row(str(new), str(b), mx.req_ids[b], str(mx.query_lens[b]), path)
    console.print(split)
    s = mx.split
    console.print(
        f"num_decodes {s.num_decodes} ({s.num_decode_tokens} tokens), num_prefills {s.num_prefills} "
        f"({s.num_prefill_tokens} tokens); decode_first_order = {list(mx.order)}",
        markup=False,
    )
    if mx.selection is not None:
        sel = mx.selection
        table = Table(
            title=f"sparse top-{len(sel.positions)}: flat token {sel.flat_idx} ({sel.req_id}, position {sel.position}) "
            f"selects from its causal range [0, {sel.position}]"
        )
        for col in ("entry", "position", "→ (logical, offset)", "→ slot (sparse_slot_mapping)"):
            table.add_column(col, justify="right")
        for j, (pos, slot) in enumerate(zip(sel.positions, sel.slots, strict=True)):
            address = "" if pos < 0 else str(divmod(pos, mx.block_size))
            table.add_row(str(j), str(pos), address, str(slot))
        console.print(table)


def _span(values: tuple[int, ...]) -> str:
    """Consecutive values as 'first..last', others as a list."""
    if len(values) > 1 and list(values) == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}..{values[-1]}"
    return str(list(values))
