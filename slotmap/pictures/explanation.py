"""`slotmap explain`: one engine step laid out in the four index spaces, from a backend's own values.

    req_state_idx (pool rows) <- index_mapping -- batch_idx -- query_start_loc --> flat token index
    flat token index -> position -> (logical block, offset) -> physical block -> slot, per KV group

`explain_step` turns a `StepView` into an `Explanation` (plain rows of numbers): `slotmap.pictures.terminal`
prints it as rich tables, `slotmap.pictures.drawing` draws the same rows. Every number shown is the
backend's output except the two the chain defines by arithmetic, divmod(position, block_size), and the
check physical block * block_size + offset, shown in red wherever it disagrees with the backend's slot.
"""

from __future__ import annotations

from dataclasses import dataclass

from slotmap.pictures.steps import StepView
from spec.graphs import BatchDescriptor
from spec.types import PAD_SLOT_ID

# One colour per request (matplotlib's tab10), shared by the terminal and the pictures.
PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)  # fmt: skip
PAD_COLOUR = "#c7c7c7"


@dataclass(frozen=True)
class StateRow:
    row: int  # req_state_idx
    req_id: str
    num_computed_tokens: int
    num_known_tokens: int  # prompt + sampled so far
    block_ids: tuple[tuple[int, ...], ...]  # per group: the table's filled entries (0 = null block)
    batch_idx: int | None  # None: holds a row but is not scheduled this step


@dataclass(frozen=True)
class BatchRow:
    batch_idx: int
    req_id: str
    req_state_idx: int  # index_mapping[batch_idx]
    num_scheduled_tokens: int
    token_start: int  # query_start_loc[batch_idx]
    token_end: int  # query_start_loc[batch_idx + 1]
    seq_len: int
    num_drafts: int = 0  # its last num_drafts tokens are drafts (speculative decoding)
    is_prefilling: bool | None = None  # row_classes: some of its tokens are prompt tokens (None: no classes)
    is_decode: bool | None = None  # row_classes: not prefilling and at most 1 + K tokens


@dataclass(frozen=True)
class PaddedRow:
    """A request row a FULL graph replays past the real ones (spec/padding.py): it names no request."""

    batch_idx: int  # in [num_reqs, num_reqs_padded)
    req_state_idx: int  # index_mapping[batch_idx], NO_REQUEST (-1)
    num_scheduled_tokens: int  # 0
    token_start: int  # query_start_loc[batch_idx]: the real token count
    token_end: int  # query_start_loc[batch_idx + 1]: the same (a query of length 0)
    seq_len: int  # the padding profile's value
    block_tables: tuple[tuple[int, ...], ...]  # per group: block_tables[g][batch_idx], every entry the null block


@dataclass(frozen=True)
class Address:
    """One real token's path through one KV group's block table."""

    logical_block: int  # position // block_size
    offset: int  # position % block_size
    physical_block: int  # block_tables[g][batch_idx, logical_block], as the backend gathered it
    slot: int  # slot_mappings[g][flat index], as the backend computed it
    block_size: int
    writes: bool = True  # False in a cross_attention group: decoder tokens write none of its slots (PAD_SLOT_ID)

    @property
    def consistent(self) -> bool:
        return self.slot == (self.physical_block * self.block_size + self.offset if self.writes else PAD_SLOT_ID)


@dataclass(frozen=True)
class TokenRow:
    flat_idx: int
    batch_idx: int | None  # None for padding
    req_id: str | None  # None for padding
    position: int
    input_id: int
    addresses: tuple[Address, ...]  # per group; empty for padding
    slots: tuple[int, ...]  # per group: the backend's slot_mappings[g][flat_idx] (PAD_SLOT_ID for padding)
    is_draft: bool = False  # a draft token: past the request's known tokens, not one of them until accepted
    logits_row: int | None = None  # its row in logits[logits_indices], None where no logits are taken
    verifies: str = ""  # what the logits at this token decide: "draft 0", ..., "bonus", "sample"


@dataclass(frozen=True)
class GroupInfo:
    block_size: int
    sliding_window: int | None
    kind: str = "attention"  # spec.types.GROUP_KINDS
    kv_lora_rank: int = 0  # an mla group's latent part of each slot's vector (0 for other kinds)
    qk_rope_head_dim: int = 0  # an mla group's RoPE key part of each slot's vector


@dataclass(frozen=True)
class Explanation:
    title: str
    groups: tuple[GroupInfo, ...]
    state_rows: tuple[StateRow, ...]
    batch_rows: tuple[BatchRow, ...]
    query_start_loc: tuple[int, ...]  # [num_reqs + 1]
    tokens: tuple[TokenRow, ...]  # [num_tokens_padded]
    colours: dict[str, str]  # req_id -> colour
    logits_indices: tuple[int, ...] = ()  # [num_reqs + num_drafts] flat token indices whose logits are sampled
    has_drafts: bool = False
    padded_rows: tuple[PaddedRow, ...] = ()  # [num_reqs_padded - num_reqs] the graph's request rows past the real
    descriptor: BatchDescriptor | None = None  # the graph the batch replays; None: prepared without graphs
    num_tokens: int = 0  # real tokens: the rest of `tokens` are padding

    def colour(self, req_id: str | None) -> str:
        return PAD_COLOUR if req_id is None else self.colours[req_id]


def explain_step(view: StepView) -> Explanation:
    batch, groups = view.batch, view.config.kv_groups
    req_ids: tuple[str, ...] = batch["req_ids"]
    index_mapping = batch["index_mapping"].tolist()  # batch_idx -> req_state_idx
    qsl = [int(x) for x in batch["query_start_loc"].tolist()]
    batch_of = {r: b for b, r in enumerate(req_ids)}
    state_rows = tuple(
        StateRow(s.row, s.req_id, s.num_computed_tokens, len(s.token_ids), s.block_ids, batch_of.get(s.req_id))
        for s in view.snapshot
    )
    has_drafts = batch.get("num_draft_tokens") is not None
    num_drafts = [int(k) for k in batch["num_draft_tokens"]] if has_drafts else [0] * len(req_ids)
    prefilling, decode = batch.get("row_classes.is_prefilling"), batch.get("row_classes.is_decode")
    batch_rows = tuple(
        BatchRow(
            b, r, int(index_mapping[b]), int(batch["num_scheduled_tokens"][b]), qsl[b], qsl[b + 1],
            int(batch["seq_lens"][b]), num_drafts[b],
            None if prefilling is None else bool(prefilling[b]), None if decode is None else bool(decode[b]),
        )
        for b, r in enumerate(req_ids)
    )  # fmt: skip
    padded_rows = tuple(
        PaddedRow(
            b, int(index_mapping[b]), int(batch["num_scheduled_tokens"][b]), qsl[b], qsl[b + 1],
            int(batch["seq_lens"][b]), tuple(tuple(int(x) for x in t[b]) for t in batch["block_tables"]),
        )
        for b in range(len(req_ids), len(index_mapping))
    )  # fmt: skip
    logits_indices = [int(i) for i in batch["logits_indices"]]
    logits_row = {flat: row for row, flat in enumerate(logits_indices)}  # flat token index -> logits row
    owner = [b for b in range(len(req_ids)) for _ in range(qsl[b], qsl[b + 1])]  # flat token index -> batch_idx
    tokens = []
    for t in range(int(batch["num_tokens_padded"])):
        position, input_id = int(batch["positions"][t]), int(batch["input_ids"][t])
        slots = tuple(int(s[t]) for s in batch["slot_mappings"])
        if t >= len(owner):
            tokens.append(TokenRow(t, None, None, position, input_id, (), slots))
            continue
        b = owner[t]
        addresses = []
        for g, group in enumerate(groups):
            logical, offset = divmod(position, group.block_size)
            physical = int(batch["block_tables"][g][b, logical])
            # the encoder's slots are slotmap/pictures/cross.py's; a mamba group's states slotmap/pictures/mamba.py's
            writes = group.kind not in ("cross_attention", "mamba")
            addresses.append(Address(logical, offset, physical, slots[g], group.block_size, writes))
        from_end = qsl[b + 1] - t  # 1 for the request's last token
        is_draft = from_end <= num_drafts[b]
        verifies = ""
        if t in logits_row:
            index = num_drafts[b] + 1 - from_end  # among the request's 1 + k logits rows
            verifies = f"draft {index}" if index < num_drafts[b] else ("bonus" if num_drafts[b] else "sample")
        tokens.append(
            TokenRow(t, b, req_ids[b], position, input_id, tuple(addresses), slots, is_draft, logits_row.get(t),
                     verifies)
        )  # fmt: skip
    by_colour = [*req_ids, *(s.req_id for s in state_rows if s.batch_idx is None)]  # the batch gets the first colours
    colours = {r: PALETTE[i % len(PALETTE)] for i, r in enumerate(by_colour)}
    return Explanation(
        view.title,
        tuple(GroupInfo(g.block_size, g.sliding_window, g.kind, g.kv_lora_rank, g.qk_rope_head_dim) for g in groups),
        state_rows,
        batch_rows,
        tuple(qsl),
        tuple(tokens),
        colours,
        tuple(logits_indices),
        has_drafts,
        padded_rows,
        batch.get("descriptor"),
        int(batch["num_tokens"]),
    )


def group_label(g: int, group: GroupInfo) -> str:
    window = "" if group.sliding_window is None else f", window {group.sliding_window}"
    latent = ""
    if group.kv_lora_rank:  # an mla group: a slot holds one latent vector, not per-head keys and values
        latent = f", latent {group.kv_lora_rank} + rope {group.qk_rope_head_dim} per slot"
    return f"group {g} (block_size {group.block_size}{window}{latent})"


def address_path(token: TokenRow, g: int) -> str:
    """'position → (logical block, offset) → physical block → slot', the chain of one group."""
    if not token.addresses:
        return f"padding → {token.slots[g]}"
    a = token.addresses[g]
    return f"{token.position} → ({a.logical_block}, {a.offset}) → {a.physical_block} → {a.slot}"
