"""The interface's data types: configuration, the scheduler's decision, and the batch it becomes.

Every backend consumes and produces these. Arrays are NumPy in `spec` and torch tensors in `fast`;
the shapes and integer dtypes below are part of the contract and identical in both.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

import numpy as np

R = TypeVar("R")  # a feature's batch record type (BatchInputs.feature)

PAD_SLOT_ID = -1  # slot of a padding token: write_kv skips it
NULL_BLOCK_ID = 0  # block 0 of every group never holds real KV

# Integer dtypes of BatchInputs (names understood by both NumPy and torch).
INDEX_DTYPE = "int32"  # index_mapping, num_scheduled_tokens, query_start_loc, seq_lens, logits_indices
BLOCK_ID_DTYPE = "int32"  # block tables: block ids are < num_blocks < 2**31
TOKEN_DTYPE = "int64"  # positions, input_ids, draft_token_ids
SLOT_DTYPE = "int64"  # slot mappings: num_blocks * block_size may exceed 2**31
# The pool's stored token ids, as vLLM's token_ids_cpu: half the bytes of int64, so a step's reads stay in
# cache. WorkerConfig.vocab_size <= MAX_VOCAB_SIZE guarantees every valid id fits.
TOKEN_STORAGE_DTYPE = "int32"
MAX_VOCAB_SIZE = 2**31
# A rejection sampler's padding: record_sampled's [num_reqs, max_k + 1] form ends each row's tokens with it.
PLACEHOLDER_TOKEN_ID = -1
# What a KV cache group holds (KVCacheGroup.kind): KV per token of the request's own sequence; one recurrent
# state per request (a Mamba layer's, spec/mamba.py); the encoder's KV, read by cross-attention
# (spec/cross_attention.py); one latent vector per token, shared by every head (multi-head latent attention,
# spec/mla_cache.py): its slots are an attention group's.
GROUP_KINDS = ("attention", "mamba", "cross_attention", "mla")


def check_encoder_config(groups: Sequence[KVCacheGroup], max_encoder_len: int) -> None:
    """A cross_attention group and max_encoder_len come together; one such group, beside the decoder's own."""
    cross = [g for g in groups if isinstance(g, KVCacheGroup) and g.kind == "cross_attention"]
    if max_encoder_len < 0:
        raise ValueError(f"WorkerConfig.max_encoder_len must be >= 0, got {max_encoder_len}")
    if len(cross) > 1:
        raise ValueError(f"WorkerConfig.kv_groups: one cross_attention group at most, got {len(cross)}")
    if cross and max_encoder_len < 1:
        raise ValueError("WorkerConfig.max_encoder_len must be >= 1 with a cross_attention group")
    if max_encoder_len and not cross:
        raise ValueError(f"WorkerConfig.max_encoder_len={max_encoder_len} needs a cross_attention group")
    if cross and len(cross) == len(groups):
        raise ValueError("WorkerConfig.kv_groups: a cross_attention group needs the decoder's own group beside it")


def is_integral(value: object) -> bool:
    """An integer of any integer type (Python or NumPy), but not a bool: the input policy for counts and sizes."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _require_ints(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not is_integral(value):
            raise ValueError(f"{type(obj).__name__}.{name} must be an integer, got {value!r}")


def check_latent_widths(group: KVCacheGroup) -> None:
    """An mla group's widths: kv_lora_rank >= 1, qk_rope_head_dim even (RoPE rotates pairs) and >= 0 (0: a NoPE
    latent, which vLLM allows); no window (vLLM 0.32's SlidingWindowMLASpec is not modelled). Other kinds: 0."""
    _require_ints(group, "kv_lora_rank", "qk_rope_head_dim")
    if group.kind != "mla":
        if group.kv_lora_rank or group.qk_rope_head_dim:
            raise ValueError(f"KVCacheGroup.kv_lora_rank and qk_rope_head_dim are 0 unless kind='mla': {group}")
        return
    if group.sliding_window is not None:
        raise ValueError(f"KVCacheGroup: an mla group has no sliding window (got {group.sliding_window})")
    if group.kv_lora_rank < 1:
        raise ValueError(f"KVCacheGroup.kv_lora_rank must be >= 1 for an mla group, got {group.kv_lora_rank}")
    if group.qk_rope_head_dim < 0 or group.qk_rope_head_dim % 2:
        raise ValueError(
            f"KVCacheGroup.qk_rope_head_dim must be even and >= 0 (RoPE rotates pairs), got {group.qk_rope_head_dim}"
        )


@dataclass(frozen=True)
class KVCacheGroup:
    block_size: int  # tokens per block
    num_blocks: int  # physical blocks, including the null block 0
    sliding_window: int | None = None  # a query at position p sees keys at positions > p - window
    kind: str = "attention"  # one of GROUP_KINDS
    # a mamba group's table entries past the running state's for the states after each draft (vLLM's
    # MambaSpec.num_speculative_blocks, = num_speculative_tokens): part of the table's width (spec/mamba.py)
    num_speculative_blocks: int = 0
    # an mla group's latent widths, as vLLM's MLAAttention: the normalized latent (kv_lora_rank, e.g. 512) and
    # the decoupled RoPE key part (qk_rope_head_dim, e.g. 64) of each token, one vector of their sum per slot
    # (vLLM's head_size; spec/mla_cache.py). 0 for every other kind
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    def __post_init__(self) -> None:
        _require_ints(self, "block_size", "num_blocks")
        if self.kind not in GROUP_KINDS:
            raise ValueError(f"KVCacheGroup.kind must be one of {GROUP_KINDS}, got {self.kind!r}")
        check_latent_widths(self)
        if self.kind != "attention" and self.sliding_window is not None:
            raise ValueError(f"KVCacheGroup.sliding_window applies to attention groups, not to a {self.kind} group")
        if self.sliding_window is not None:
            _require_ints(self, "sliding_window")
        _require_ints(self, "num_speculative_blocks")
        if self.num_speculative_blocks < 0 or (self.num_speculative_blocks and self.kind != "mamba"):
            raise ValueError(f"KVCacheGroup.num_speculative_blocks must be >= 0, and 0 unless kind='mamba': {self}")
        if self.block_size < 1 or self.num_blocks < 2:
            raise ValueError(f"KVCacheGroup needs block_size >= 1 and num_blocks >= 2, got {self}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"KVCacheGroup.sliding_window must be >= 1, got {self.sliding_window}")
        if self.num_blocks > 2**31:  # block tables are int32 (BLOCK_ID_DTYPE): the largest id must fit
            raise ValueError(f"KVCacheGroup.num_blocks must be <= 2**31 (int32 block ids), got {self.num_blocks}")

    @property
    def latent_width(self) -> int:
        """An mla group's cache entry per slot: kv_lora_rank + qk_rope_head_dim (vLLM's head_size); 0 otherwise."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def first_read(self, num_computed: int) -> int:
        """The oldest position a step starting at `num_computed` reads: the window's start, or 0 without one."""
        return 0 if self.sliding_window is None else max(0, num_computed - self.sliding_window + 1)

    def first_live_entry(self, num_computed: int) -> int:
        """The first table entry such a step reads; the entries before it a window released for good
        (docs/semantics.md, "Blocks a window released"): they may hold ids the request is handed again."""
        return self.first_read(num_computed) // self.block_size


@dataclass(frozen=True)
class WorkerConfig:
    max_num_reqs: int  # rows in the request state pool
    max_model_len: int  # most tokens a request may ever hold
    max_num_batched_tokens: int  # token budget of one step
    vocab_size: int  # token ids are in [0, vocab_size)
    kv_groups: tuple[KVCacheGroup, ...] = (KVCacheGroup(16, 1024),)
    # the model's rotary embedding reads three position rows (vLLM's model_config.uses_mrope, spec/mrope.py):
    # BatchInputs.mrope_positions is then [3, T], and requests may carry a position table
    uses_mrope: bool = False
    # the longest encoder output a request may carry (vLLM's max_encoder_len, e.g. Whisper's 1500 frames):
    # > 0 exactly when kv_groups holds a cross_attention group (spec/cross_attention.py)
    max_encoder_len: int = 0
    # steps are scheduled one ahead of the samples (vLLM's async scheduling, spec/async_steps.py): a step's
    # counts assume the previous step's tokens, drafts all accepted, and record_sampled reports faults late
    async_scheduling: bool = False
    # every group draws its blocks from one pool, as vLLM's KVCacheManager does (one BlockPool for all KV cache
    # groups): a block id held by one group is not in another group's live table entries at the same time
    # (check 9, docs/semantics.md "One block pool"); the groups then share num_blocks. False: a pool per group
    one_block_pool: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_groups", tuple(self.kv_groups))
        _require_ints(self, "max_num_reqs", "max_model_len", "max_num_batched_tokens", "vocab_size")
        _require_ints(self, "max_encoder_len")
        check_encoder_config(self.kv_groups, self.max_encoder_len)
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"WorkerConfig.async_scheduling must be a bool, got {self.async_scheduling!r}")
        if not isinstance(self.one_block_pool, bool):
            raise ValueError(f"WorkerConfig.one_block_pool must be a bool, got {self.one_block_pool!r}")
        if self.one_block_pool and len({getattr(g, "num_blocks", None) for g in self.kv_groups}) > 1:
            sizes = [getattr(g, "num_blocks", None) for g in self.kv_groups]
            raise ValueError(f"WorkerConfig.one_block_pool: the groups share one pool, so one num_blocks, got {sizes}")
        if not isinstance(self.uses_mrope, bool):
            raise ValueError(f"WorkerConfig.uses_mrope must be a bool, got {self.uses_mrope!r}")
        if not all(isinstance(g, KVCacheGroup) for g in self.kv_groups):
            raise ValueError(f"WorkerConfig.kv_groups must hold KVCacheGroup objects, got {self.kv_groups!r}")
        if min(self.max_num_reqs, self.max_model_len, self.max_num_batched_tokens) < 1:
            raise ValueError(f"WorkerConfig sizes must be >= 1, got {self}")
        if self.vocab_size < 1 or not self.kv_groups:
            raise ValueError("WorkerConfig needs vocab_size >= 1 and at least one KV group")
        if self.vocab_size > MAX_VOCAB_SIZE:  # stored token ids are int32 (TOKEN_STORAGE_DTYPE)
            raise ValueError(f"WorkerConfig.vocab_size must be <= 2**31 (int32 token ids), got {self.vocab_size}")

    def max_blocks_per_req(self, group: int) -> int:
        # vLLM sizes every group's table for max(max_model_len, max_encoder_len) tokens: the cross group holds
        # the encoder's KV, and the decoder's positions index every group's table within bounds
        # a mamba group's table also holds its speculative state blocks (spec/mamba.py; vllm-ascend PR #11466)
        spec_blocks = self.kv_groups[group].num_speculative_blocks
        return math.ceil(max(self.max_model_len, self.max_encoder_len) / self.kv_groups[group].block_size) + spec_blocks


@dataclass(frozen=True)
class NewRequest:
    req_id: str
    prompt_token_ids: tuple[int, ...]
    block_ids: tuple[tuple[int, ...], ...]  # per KV group: the blocks allocated so far
    num_computed_tokens: int = 0  # > 0 on a prefix-cache hit
    # M-RoPE (spec/mrope.py; only where WorkerConfig.uses_mrope): the model processor's [3, prompt_len] position
    # table (temporal, height, width rows) and the delta positions past the prompt add (vLLM's
    # mrope_positions, mrope_position_delta); None: a text request, all three rows its plain positions
    mrope_positions: Any = None
    mrope_position_delta: int = 0
    # encoder-decoder (spec/cross_attention.py; only where the config has a cross_attention group): the number
    # of encoder output tokens whose KV the cross group holds, written on the request's first step
    encoder_len: int = 0


@dataclass(frozen=True)
class CachedRequest:
    req_id: str
    num_computed_tokens: int  # authoritative: the scheduler's count
    new_block_ids: tuple[tuple[int, ...], ...] | None = None  # per KV group, appended (or replacing)
    resumed: bool = False  # back from preemption: new_block_ids replace the whole table


@dataclass(frozen=True, eq=False)
class CachedRequestColumns(Sequence[CachedRequest]):
    """`SchedulerOutput.cached_requests` in columns, as vLLM's CachedRequestData: entry i of each is request i's.

    A sequence of CachedRequest to everything that iterates it (spec reads it that way), while a backend
    may read the columns directly: a scheduler that already holds its decisions as lists pays for no
    per-request objects, and the backend for no attribute walks.
    """

    req_ids: Sequence[str]  # [n]
    num_computed_tokens: Sequence[int]  # [n] authoritative: the scheduler's counts (a list, or an int array)
    new_block_ids: Sequence[tuple[tuple[int, ...], ...] | None] | None = None  # [n] per request; None: none at all
    resumed_req_ids: frozenset[str] = frozenset()  # requests back from preemption: their new ids replace the table

    def __len__(self) -> int:
        return len(self.req_ids)

    @overload
    def __getitem__(self, index: int) -> CachedRequest: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[CachedRequest, ...]: ...

    def __getitem__(self, index: int | slice) -> CachedRequest | tuple[CachedRequest, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        req_id = self.req_ids[index]
        blocks = None if self.new_block_ids is None else self.new_block_ids[index]
        computed = self.num_computed_tokens[index]
        if isinstance(computed, np.integer):
            computed = int(computed)
        # an unhashable id (check 1 names it) is in no set
        resumed = isinstance(req_id, Hashable) and req_id in self.resumed_req_ids
        return CachedRequest(req_id, computed, blocks, resumed)

    def __iter__(self) -> Iterator[CachedRequest]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CachedRequestColumns | tuple | list):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True)
class SchedulerOutput:
    new_requests: tuple[NewRequest, ...] = ()
    cached_requests: tuple[CachedRequest, ...] | CachedRequestColumns = ()
    # req_id -> tokens this step; its order is the tie-break of the batch sort
    num_scheduled_tokens: Mapping[str, int] = field(default_factory=dict)
    finished_req_ids: frozenset[str] = frozenset()
    # req_id -> draft token ids (speculative decoding, spec/drafts.py); absent or empty: none. A request
    # with k drafts is scheduled through its last known token and then the k drafts.
    scheduled_spec_decode_tokens: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass(frozen=True, eq=False)
class BatchInputs:
    """One step's inputs for the model. num_reqs = len(req_ids); T = num_tokens_padded."""

    req_ids: tuple[str, ...]  # [num_reqs] batch_idx -> req_id
    index_mapping: Any  # [num_reqs] int32, batch_idx -> req_state_idx
    num_scheduled_tokens: Any  # [num_reqs] int32
    query_start_loc: Any  # [num_reqs + 1] int32, CSR offsets into the flat tokens
    positions: Any  # [T] int64, flat token index -> position in its request (0 for padding)
    input_ids: Any  # [T] int64 (0 for padding)
    seq_lens: Any  # [num_reqs] int32, num_computed_tokens + num_scheduled_tokens
    # [num_reqs + num_drafts] int32, flat indices of the tokens whose logits are sampled: each request's last
    # token, and with drafts each drafting request's last 1 + k tokens (spec/drafts.py); [num_reqs] without
    logits_indices: Any
    block_tables: tuple[Any, ...]  # per group: [num_reqs, max_blocks_per_req(g)] int32
    slot_mappings: tuple[Any, ...]  # per group: [T] int64 (PAD_SLOT_ID for padding)
    num_tokens: int  # real tokens: query_start_loc[-1]
    num_tokens_padded: int  # T >= num_tokens
    # Speculative decoding, as vLLM's SpecDecodeMetadata (spec/drafts.py). None when the step schedules no
    # draft, so a step without drafts is the batch it always was.
    num_draft_tokens: Any = None  # [num_reqs] int32, drafts of each batch row (0 for most)
    cu_num_draft_tokens: Any = None  # [num_reqs] int32, cumsum(num_draft_tokens) (no leading 0, as vLLM)
    draft_token_ids: Any = None  # [num_drafts] int64, the drafts in batch order
    target_logits_indices: Any = None  # [num_drafts] int32, row of logits[logits_indices] that verifies each draft
    bonus_logits_indices: Any = None  # [num_reqs] int32, row of logits[logits_indices] after each row's last draft
    # Async scheduling (spec/async_steps.py): None unless WorkerConfig.async_scheduling. The tokens whose input id is
    # the previous step's sample, which a host scheduling ahead does not know: vLLM gathers them on the device.
    pending_token_indices: Any = None  # [num_pending] int32 flat token indices, ascending
    pending_prev_batch_idx: Any = None  # [num_pending] int32, the previous batch's batch_idx that sampled each

    # The model-kind features' records (spec/feature.py), one per feature of the config: () for a plain decoder.
    # Each is a frozen dataclass whose fields read as the batch's own (batch.mrope_positions, below).
    features: tuple[Any, ...] = ()
    # The rows' classification by progress (spec/classify.py RowClasses, host arrays over the real rows): set by
    # every prepare. The graph the batch runs (spec/graphs.py BatchDescriptor): None unless prepared with graphs;
    # then index_mapping, num_scheduled_tokens, seq_lens, block_tables have descriptor.num_reqs rows and
    # query_start_loc one more (spec/padding.py), the rest num_reqs.
    row_classes: Any = None
    descriptor: Any = None

    @property
    def num_reqs(self) -> int:
        """The real requests (one per req_id); record_sampled takes one row per real request."""
        return len(self.req_ids)

    @property
    def num_reqs_padded(self) -> int:
        """Request rows of the padded per-row arrays: the descriptor's, or num_reqs without one."""
        return self.num_reqs if self.descriptor is None else int(self.descriptor.num_reqs)

    def feature(self, record_type: type[R]) -> R | None:
        """The batch's record of one feature (e.g. spec.mamba.StateIndices), or None for a model without it."""
        return next((r for r in self.features if isinstance(r, record_type)), None)

    def __getattr__(self, name: str) -> Any:
        """A feature record's field read by its name, as every field of the batch is: `batch.mrope_positions` is
        the M-RoPE record's, and None for a model without M-RoPE (any known feature's field, `FEATURE_FIELDS`)."""
        for record in self.__dict__.get("features", ()):
            if name in record.__dataclass_fields__:
                return getattr(record, name)
        if name in FEATURE_FIELDS:
            return None
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


# The field names of every feature record (spec/feature.py), filled as each record class is defined
# (`feature_record`): a field read on a batch of a model without the feature is None, any other name an error.
FEATURE_FIELDS: set[str] = set()


def feature_record(cls: type[R]) -> type[R]:
    """Declare a frozen dataclass as a feature's batch record: its fields read as fields of BatchInputs."""
    clash = set(cls.__dataclass_fields__) & ({f for f in BatchInputs.__dataclass_fields__} | FEATURE_FIELDS)  # type: ignore[attr-defined]
    if clash:
        raise TypeError(f"{cls.__name__}: field(s) {sorted(clash)} already read on BatchInputs")
    FEATURE_FIELDS.update(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    return cls


@dataclass(frozen=True)
class RowSnapshot:
    row: int  # req_state_idx
    req_id: str
    token_ids: tuple[int, ...]  # every known token: prompt, then sampled
    num_computed_tokens: int
    block_ids: tuple[tuple[int, ...], ...]  # per group: the table's filled entries


PoolSnapshot = tuple[RowSnapshot, ...]  # occupied rows, by row
