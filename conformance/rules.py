"""Every acceptance rule of spec, with what generates each side of it and what asserts it: written down once.

One `Rule` per refusal site of spec (conformance/rule_sites.py finds them in spec's source: a rule of
spec with no entry here fails `test_every_refusal_site_has_a_rule`). For each rule:
- `valid`: the boundary its valid side is generated at: a predicate in `VALID_EDGES` that some step of the
  reference scheduler's seeded runs satisfies (`test_valid_sides_are_generated` requires one), or
  `EVERY_STEP` for rules with no numeric boundary (a type, a container, "listed once"), whose valid side
  is every output the scheduler sends, or the test that builds it by hand where the scheduler, as vLLM's,
  never goes (a step up to max_model_len leaves no room for its sample);
- `invalid`: `GENERATED` when the suite's fault generators (conformance.mutations' breakers and
  malformations for scheduler outputs, conformance.sampled_faults for record_sampled's ids) reach the
  site in the seeded runs (`test_invalid_sides_are_generated` requires it), or the test that builds the
  fault by hand where no generator can (a visible gap, kept as short as it can be);
- `tests`: where the refusal (and each backend's agreement) is asserted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from conformance.rule_sites import Site
from conformance.seeded import Sampled
from spec.cross_attention import cross_group
from spec.types import NULL_BLOCK_ID, RowSnapshot, SchedulerOutput, WorkerConfig

EVERY_STEP = "every step"
GENERATED = "generated"

INVALID_SUITE = "conformance/test_invalid.py::test_invalid_outputs_are_rejected_identically"
EVERY_CLASS = "conformance/test_invalid.py::test_every_error_class_is_provoked_and_survived"
MALFORMATIONS = "conformance/test_invalid.py::test_every_malformation_is_provoked_and_survived"
DRAFT_FAULTS = "conformance/test_drafts.py::test_every_draft_fault_is_provoked_and_survived"
MISUSE = "conformance/test_invalid.py::test_misuse_between_the_calls_changes_nothing"
SAMPLED = "conformance/test_sampled_faults.py::test_every_sampled_fault_is_refused_identically"
PIPELINE, BOUNDARIES = "conformance/test_pipeline.py", "conformance/test_boundaries.py"
ERRORS = "conformance/test_errors.py"
ASYNC = "conformance/test_async.py"
ASYNC_DRAFTS = "conformance/test_async_drafts.py"
GRAPHS_BY_HAND = "tests/test_graphs.py::test_pad_to_and_graphs_together_are_refused_and_change_nothing"
GRAPHS_MISUSE = "conformance/test_invalid.py::test_misused_graphs_pad_to_and_splits_are_refused_identically"
AT_MAX_MODEL_LEN = f"{BOUNDARIES}::test_a_step_up_to_max_model_len_is_valid_and_its_sample_has_no_room"


@dataclass(frozen=True)
class Rule:
    file: str  # spec/<file>
    function: str
    text: str  # occurs in the site's call source
    summary: str
    valid: str  # a VALID_EDGES name, or EVERY_STEP
    invalid: str  # GENERATED, or the test that builds the fault by hand
    tests: tuple[str, ...]

    def matches(self, site: Site) -> bool:
        return site.file == self.file and site.function == self.function and self.text in site.source


def _tables_after(out: SchedulerOutput, rows: Mapping[str, RowSnapshot], num_groups: int) -> dict[str, list[list[int]]]:
    """Each scheduled request's tables as they stand after the step."""
    tables = {r.req_id: [list(t) for t in r.block_ids] for r in out.new_requests}
    for c in out.cached_requests:
        added = c.new_block_ids or tuple(() for _ in range(num_groups))
        kept = [] if c.resumed else [list(t) for t in rows[c.req_id].block_ids]
        tables[c.req_id] = [[*(kept[g] if kept else []), *added[g]] for g in range(num_groups)]
    return tables


def _computed(out: SchedulerOutput) -> dict[str, int]:
    return {r.req_id: int(r.num_computed_tokens) for r in (*out.new_requests, *out.cached_requests)}


Edge = Callable[[WorkerConfig, Mapping[str, RowSnapshot], SchedulerOutput], bool]


def _budget_full(config: WorkerConfig, rows: Mapping[str, RowSnapshot], out: SchedulerOutput) -> bool:
    return out.total_num_scheduled_tokens == config.max_num_batched_tokens


def _pool_full(config: WorkerConfig, rows: Mapping[str, RowSnapshot], out: SchedulerOutput) -> bool:
    return len(rows) - len(out.finished_req_ids) + len(out.new_requests) == config.max_num_reqs


def _prompt_id_at_vocab_end(config: WorkerConfig, rows: Mapping[str, RowSnapshot], out: SchedulerOutput) -> bool:
    return any(config.vocab_size - 1 in r.prompt_token_ids for r in out.new_requests)


def _draft_id_at_vocab_end(config: WorkerConfig, rows: Mapping[str, RowSnapshot], out: SchedulerOutput) -> bool:
    return any(config.vocab_size - 1 in d for d in out.scheduled_spec_decode_tokens.values())


def _step_ends_at_last_known(config: WorkerConfig, rows: Mapping[str, RowSnapshot], out: SchedulerOutput) -> bool:
    computed, drafts = _computed(out), out.scheduled_spec_decode_tokens
    known = {r: len(row.token_ids) for r, row in rows.items()}
    known.update({r.req_id: len(r.prompt_token_ids) for r in out.new_requests})
    return any(computed[r] + n == known[r] + len(drafts.get(r, ())) for r, n in out.num_scheduled_tokens.items())


def _drafts_with_one_plus_k(config: WorkerConfig, rows: Mapping[str, RowSnapshot], out: SchedulerOutput) -> bool:
    drafts = out.scheduled_spec_decode_tokens
    return any(len(d) and out.num_scheduled_tokens[r] == 1 + len(d) for r, d in drafts.items())


def _block_id_at_range_end(config: WorkerConfig, rows: Mapping[str, RowSnapshot], out: SchedulerOutput) -> bool:
    tables = _tables_after(out, rows, len(config.kv_groups)).values()
    return any(group.num_blocks - 1 in t[g] for t in tables for g, group in enumerate(config.kv_groups))


def _released_id_again(config: WorkerConfig, rows: Mapping[str, RowSnapshot], out: SchedulerOutput) -> bool:
    """A table whose released part holds an id its live part holds too (the window reuse of vLLM)."""
    computed = _computed(out)
    for req_id, tables in _tables_after(out, rows, len(config.kv_groups)).items():
        for g, group in enumerate(config.kv_groups):
            first = group.first_live_entry(computed[req_id])
            if set(tables[g][:first]) & (set(tables[g][first:]) - {NULL_BLOCK_ID}):
                return True
    return False


def _released_id_in_another_group(config: WorkerConfig, rows: Mapping[str, RowSnapshot], out: SchedulerOutput) -> bool:
    """With one block pool: an id one group's window released is held in another group (vLLM's pool reuses it)."""
    if not config.one_block_pool:
        return False
    computed, tables = _computed(out), _tables_after(out, rows, len(config.kv_groups))
    released: dict[int, set[int]] = {}  # group -> ids its scheduled tables hold below their window
    held: dict[int, set[int]] = {}  # group -> ids they hold from their first live entry on
    for req_id, t in tables.items():
        for g, group in enumerate(config.kv_groups):
            first = group.first_live_entry(computed[req_id])
            released.setdefault(g, set()).update(set(t[g][:first]) - {NULL_BLOCK_ID})
            held.setdefault(g, set()).update(set(t[g][first:]) - {NULL_BLOCK_ID})
    return any(released[g] & held[h] for g in released for h in held if g != h)


def _null_in_a_window_table(config: WorkerConfig, rows: Mapping[str, RowSnapshot], out: SchedulerOutput) -> bool:
    tables = _tables_after(out, rows, len(config.kv_groups)).values()
    groups = config.kv_groups
    return any(NULL_BLOCK_ID in t[g] for t in tables for g in range(len(groups)) if groups[g].sliding_window)


def _table_at_max_blocks(config: WorkerConfig, rows: Mapping[str, RowSnapshot], out: SchedulerOutput) -> bool:
    tables = _tables_after(out, rows, len(config.kv_groups)).values()
    return any(len(t[g]) == config.max_blocks_per_req(g) for t in tables for g in range(len(config.kv_groups)))


def _writes_the_last_entry(config: WorkerConfig, rows: Mapping[str, RowSnapshot], out: SchedulerOutput) -> bool:
    computed = _computed(out)
    for req_id, tables in _tables_after(out, rows, len(config.kv_groups)).items():
        last = computed[req_id] + out.num_scheduled_tokens[req_id] - 1
        decoder = [(i, g) for i, g in enumerate(config.kv_groups) if g.kind != "cross_attention"]  # positions' tables
        if any(last // g.block_size == len(tables[i]) - 1 for i, g in decoder):
            return True
    return False


def _null_just_before_the_window(config: WorkerConfig, rows: Mapping[str, RowSnapshot], out: SchedulerOutput) -> bool:
    computed = _computed(out)
    for req_id, tables in _tables_after(out, rows, len(config.kv_groups)).items():
        for g, group in enumerate(config.kv_groups):
            first = group.first_live_entry(computed[req_id])
            if 0 < first <= len(tables[g]) and tables[g][first - 1] == NULL_BLOCK_ID:
                return True
    return False


def _shared_block_written(config: WorkerConfig, rows: Mapping[str, RowSnapshot], out: SchedulerOutput) -> bool:
    """A request writes a block another request's table holds too (a prefix-cache hit recomputing its last token)."""
    computed, tables = _computed(out), _tables_after(out, rows, len(config.kv_groups))
    for g, group in enumerate(config.kv_groups):
        if group.kind == "cross_attention":  # decoder tokens write none of its blocks
            continue
        held: dict[int, set[str]] = {}
        for row in rows.values():
            for b in row.block_ids[g]:
                held.setdefault(b, set()).add(row.req_id)
        for req_id, t in tables.items():
            bs, last = group.block_size, computed[req_id] + out.num_scheduled_tokens[req_id] - 1
            for b in {t[g][p // bs] for p in range(computed[req_id], last + 1)}:
                if held.get(b, set()) - {req_id}:
                    return True
    return False


def _resumed_from_zero(config: WorkerConfig, rows: Mapping[str, RowSnapshot], out: SchedulerOutput) -> bool:
    return any(c.resumed and c.num_computed_tokens == 0 for c in out.cached_requests)


def _one_token_scheduled(config: WorkerConfig, rows: Mapping[str, RowSnapshot], out: SchedulerOutput) -> bool:
    return 1 in out.num_scheduled_tokens.values()


def _step_to_max_model_len(config: WorkerConfig, rows: Mapping[str, RowSnapshot], out: SchedulerOutput) -> bool:
    """A step whose last scheduled position is max_model_len - 1 (knob drafts_to_the_end: its last are drafts)."""
    computed = _computed(out)
    return any(computed[r] + n == config.max_model_len for r, n in out.num_scheduled_tokens.items())


def _async_drafts(config: WorkerConfig, rows: Mapping[str, RowSnapshot], out: SchedulerOutput) -> bool:
    """Drafts sent under async scheduling: each after a step whose verdict the host had read (the scheduler's
    async mode never drafts a request twice in a row)."""
    return config.async_scheduling and any(len(d) for d in out.scheduled_spec_decode_tokens.values())


def _finished_and_new(config: WorkerConfig, rows: Mapping[str, RowSnapshot], out: SchedulerOutput) -> bool:
    return bool(out.finished_req_ids) and bool(out.new_requests)


def _new_multimodal_request(config: WorkerConfig, rows: Mapping[str, RowSnapshot], out: SchedulerOutput) -> bool:
    return any(r.mrope_positions is not None for r in out.new_requests)


def _encoder_len_at_max(config: WorkerConfig, rows: Mapping[str, RowSnapshot], out: SchedulerOutput) -> bool:
    return any(config.max_encoder_len and r.encoder_len == config.max_encoder_len for r in out.new_requests)


def _cross_table_exact(config: WorkerConfig, rows: Mapping[str, RowSnapshot], out: SchedulerOutput) -> bool:
    g = cross_group(config)
    if g is None:
        return False
    size = config.kv_groups[g].block_size
    return any(len(r.block_ids[g]) == -(-r.encoder_len // size) for r in out.new_requests)


def _encoder_resumed_from_zero(config: WorkerConfig, rows: Mapping[str, RowSnapshot], out: SchedulerOutput) -> bool:
    return cross_group(config) is not None and _resumed_from_zero(config, rows, out)


def _hybrid_step(config: WorkerConfig, rows: Mapping[str, RowSnapshot], out: SchedulerOutput) -> bool:
    return bool(out.num_scheduled_tokens) and any(g.kind == "mamba" for g in config.kv_groups)


def _mamba_continuing(config: WorkerConfig, rows: Mapping[str, RowSnapshot], out: SchedulerOutput) -> bool:
    """A continuing request of a hybrid model past its first token: it reads the state its last step kept."""
    return _hybrid_step(config, rows, out) and any(not c.resumed and c.num_computed_tokens for c in out.cached_requests)


def _mamba_drafts_at_capacity(config: WorkerConfig, rows: Mapping[str, RowSnapshot], out: SchedulerOutput) -> bool:
    spec_blocks = [g.num_speculative_blocks for g in config.kv_groups if g.kind == "mamba"]
    return any(len(d) == s for d in out.scheduled_spec_decode_tokens.values() for s in spec_blocks if d)


def _mamba_last_entry_written(config: WorkerConfig, rows: Mapping[str, RowSnapshot], out: SchedulerOutput) -> bool:
    """A step whose last state (its last draft's, or its own) lands in its mamba table's last entry."""
    tables, computed = _tables_after(out, rows, len(config.kv_groups)), _computed(out)
    for g, group in enumerate(config.kv_groups):
        if group.kind != "mamba":
            continue
        for req_id, n in out.num_scheduled_tokens.items():
            k = len(out.scheduled_spec_decode_tokens.get(req_id, ()))
            if (computed[req_id] + n - 1) // group.block_size + k == len(tables[req_id][g]) - 1:
                return True
    return False


VALID_EDGES: dict[str, Edge] = {
    "the step uses the whole token budget": _budget_full,
    "every row is held after the step": _pool_full,
    "a prompt id is vocab_size - 1": _prompt_id_at_vocab_end,
    "a draft id is vocab_size - 1": _draft_id_at_vocab_end,
    "a step ending at the last known token (+ k drafts)": _step_ends_at_last_known,
    "k drafts on exactly 1 + k scheduled tokens": _drafts_with_one_plus_k,
    "a block id num_blocks - 1": _block_id_at_range_end,
    "an id released by the window, live again": _released_id_again,
    "the null block in a windowed table": _null_in_a_window_table,
    "one block pool: an id a window released, held by another group": _released_id_in_another_group,
    "a table of max_blocks_per_req entries": _table_at_max_blocks,
    "a step writing its table's last entry": _writes_the_last_entry,
    "a null entry just before the first one read": _null_just_before_the_window,
    "a block another request holds, written": _shared_block_written,
    "a resumed request starting from 0": _resumed_from_zero,
    "a request scheduled for one token": _one_token_scheduled,
    "a step ending at max_model_len": _step_to_max_model_len,
    "drafts under async scheduling, the verdict before them read": _async_drafts,
    "finished and new requests in one step": _finished_and_new,
    "a new request with an M-RoPE table": _new_multimodal_request,
    "an encoder_len of max_encoder_len": _encoder_len_at_max,
    "a cross table of exactly cdiv(encoder_len, block_size) blocks": _cross_table_exact,
    "an encoder-decoder request resumed from 0 (its encoder runs again)": _encoder_resumed_from_zero,
    "a step of a hybrid model (a mamba group)": _hybrid_step,
    "a hybrid model's continuing request, reading its last step's state": _mamba_continuing,
    "as many drafts as the mamba group keeps speculative blocks": _mamba_drafts_at_capacity,
    "a step writing its mamba table's last entry": _mamba_last_entry_written,
}

SampledEdge = Callable[[Sampled, WorkerConfig], bool]


def _all_drafts_kept(s: Sampled, config: WorkerConfig) -> bool:
    return any(t and d and len(r) == 1 + len(d) for r, d, t in zip(s.rows, s.drafts, s.takes, strict=True))


def _no_draft_kept(s: Sampled, config: WorkerConfig) -> bool:
    return any(t and d and len(r) == 1 for r, d, t in zip(s.rows, s.drafts, s.takes, strict=True))


def _sampled_id_at_vocab_end(s: Sampled, config: WorkerConfig) -> bool:
    return any(t and config.vocab_size - 1 in r for r, t in zip(s.rows, s.takes, strict=True))


def _sampled_to_max_model_len(s: Sampled, config: WorkerConfig) -> bool:
    return any(t and k + len(r) == config.max_model_len for r, t, k in zip(s.rows, s.takes, s.known, strict=True))


def _a_row_that_does_not_take(s: Sampled, config: WorkerConfig) -> bool:
    return not all(s.takes)


SAMPLED_EDGES: dict[str, SampledEdge] = {
    "1 + k tokens kept (every draft accepted)": _all_drafts_kept,
    "1 token kept of a drafting row (none accepted)": _no_draft_kept,
    "a sampled id vocab_size - 1": _sampled_id_at_vocab_end,
    "kept tokens reaching max_model_len": _sampled_to_max_model_len,
    "a mid-prefill row beside taking rows": _a_row_that_does_not_take,
}

V, D, P = "validate.py", "drafts.py", "pool.py"
G = "group_rules.py"
C = "cross_attention.py"
M, MAMBA_TESTS = "mamba.py", "conformance/test_mamba.py"
R, MROPE = "mrope.py", "conformance/test_mrope.py"
MROPE_REFUSED = "test_bad_mrope_inputs_are_refused_and_change_nothing"
IP = "conformance/test_input_policy.py"
RULES: tuple[Rule, ...] = (
    # check 1, the output's own fields (spec/validate.py _check_containers)
    Rule(
        V,
        "_check_containers",
        '"new_requests", f"{type(',
        "new_requests is a tuple or list",
        EVERY_STEP,
        GENERATED,
        (MALFORMATIONS,),
    ),
    Rule(
        V,
        "_check_containers",
        '"cached_requests", f"{type(',
        "cached_requests is a tuple, list or columns",
        EVERY_STEP,
        GENERATED,
        (MALFORMATIONS,),
    ),
    Rule(
        V,
        "_check_containers",
        '"num_scheduled_tokens", f"{type(',
        "num_scheduled_tokens is a mapping",
        EVERY_STEP,
        GENERATED,
        (MALFORMATIONS,),
    ),
    Rule(
        V,
        "_check_containers",
        '"finished_req_ids", f"{type(',
        "finished_req_ids is a set, tuple or list",
        EVERY_STEP,
        GENERATED,
        (MALFORMATIONS,),
    ),
    Rule(
        V,
        "_check_containers",
        '"scheduled_spec_decode_tokens", f"{drafts}',
        "drafts are a mapping",
        EVERY_STEP,
        GENERATED,
        (MALFORMATIONS,),
    ),
    Rule(
        V,
        "_check_containers",
        "not a NewRequest",
        "new_requests holds NewRequests",
        EVERY_STEP,
        GENERATED,
        (MALFORMATIONS, IP),
    ),
    Rule(
        V,
        "_check_containers",
        '"cached_requests.req_ids", f"{type(',
        "columns' req_ids are a tuple or list",
        EVERY_STEP,
        f"{IP}::test_a_container_of_the_wrong_kind_is_refused",
        (IP,),
    ),
    Rule(
        V,
        "_check_containers",
        "one per req_id",
        "columns of cached requests agree in length",
        EVERY_STEP,
        GENERATED,
        (MALFORMATIONS, IP),
    ),
    Rule(
        V,
        "_check_containers",
        '"needs a set"',
        "columns' resumed_req_ids is a set",
        EVERY_STEP,
        GENERATED,
        (MALFORMATIONS, IP),
    ),
    Rule(
        V,
        "_check_containers",
        "is not among the cached",
        "columns' resumed ids are cached ids",
        EVERY_STEP,
        GENERATED,
        (MALFORMATIONS, IP),
    ),
    Rule(
        V,
        "_check_containers",
        "not a CachedRequest",
        "cached_requests holds CachedRequests",
        EVERY_STEP,
        GENERATED,
        (MALFORMATIONS, IP),
    ),
    Rule(
        V,
        "_check_containers",
        '"finished_req_ids", f"{req_id!r} is not a str")',
        "finished ids are str",
        EVERY_STEP,
        GENERATED,
        (MALFORMATIONS,),
    ),
    Rule(
        V,
        "_check_containers",
        '"finished_req_ids", "listed twice"',
        "a finished id is listed once",
        EVERY_STEP,
        GENERATED,
        (MALFORMATIONS, f"{IP}::test_every_sequence_of_finished_ids_must_be_distinct"),
    ),
    # check 1, consistency (spec/validate.py _check_consistency)
    Rule(
        V, "_check_consistency", '"req_id", f"', "a request's req_id is a str", EVERY_STEP, GENERATED, (MALFORMATIONS,)
    ),
    Rule(
        V,
        "_check_consistency",
        '"new_requests/cached_requests", "listed twice"',
        "a request is listed once",
        EVERY_STEP,
        GENERATED,
        (MALFORMATIONS, INVALID_SUITE),
    ),
    Rule(
        V,
        "_check_consistency",
        "finished and scheduled",
        "a finished request is not scheduled",
        "finished and new requests in one step",
        GENERATED,
        (EVERY_CLASS,),
    ),
    Rule(
        V,
        "_check_consistency",
        "listed but not scheduled",
        "a listed request is scheduled",
        EVERY_STEP,
        GENERATED,
        (EVERY_CLASS,),
    ),
    Rule(
        V,
        "_check_consistency",
        '"num_computed_tokens"',
        "num_computed_tokens is an integer >= 0",
        "a resumed request starting from 0",
        GENERATED,
        (EVERY_CLASS, MALFORMATIONS),
    ),
    Rule(
        V,
        "_check_consistency",
        'fail(None, "num_scheduled_tokens", f"key',
        "num_scheduled_tokens keys are str",
        EVERY_STEP,
        GENERATED,
        (MALFORMATIONS, IP),
    ),
    Rule(
        V,
        "_check_consistency",
        "neither new nor cached",
        "a scheduled request is listed",
        EVERY_STEP,
        GENERATED,
        (EVERY_CLASS,),
    ),
    Rule(
        V,
        "_check_consistency",
        "every scheduled request needs",
        "num_scheduled_tokens are integers >= 1",
        "a request scheduled for one token",
        GENERATED,
        (EVERY_CLASS, MALFORMATIONS),
    ),
    Rule(
        V,
        "_check_consistency",
        '"scheduled_spec_decode_tokens", f"key',
        "draft keys are str",
        EVERY_STEP,
        GENERATED,
        (MALFORMATIONS,),
    ),
    Rule(
        V,
        "_check_consistency",
        "drafts for a request that is not scheduled",
        "drafts only for scheduled requests",
        EVERY_STEP,
        GENERATED,
        (DRAFT_FAULTS,),
    ),
    Rule(
        V,
        "_check_consistency",
        '"scheduled_spec_decode_tokens", detail',
        "k drafts need 1 + k scheduled tokens",
        "k drafts on exactly 1 + k scheduled tokens",
        GENERATED,
        (DRAFT_FAULTS,),
    ),
    Rule(
        V,
        "_check_consistency",
        '"block_ids", f"',
        "a new request has a table per group",
        EVERY_STEP,
        GENERATED,
        (MALFORMATIONS,),
    ),
    Rule(V, "_check_consistency", '"resumed"', "resumed is a bool", EVERY_STEP, GENERATED, (MALFORMATIONS,)),
    Rule(
        V,
        "_check_consistency",
        '"new_block_ids", f"',
        "new_block_ids has an entry per group",
        EVERY_STEP,
        GENERATED,
        (MALFORMATIONS, IP),
    ),
    # check 1, M-RoPE inputs of new requests (spec/mrope.py check_mrope_inputs)
    Rule(
        R,
        "check_mrope_inputs",
        "the model does not use M-RoPE",
        "tables and deltas only on a model with M-RoPE",
        EVERY_STEP,
        GENERATED,
        (MALFORMATIONS, f"{MROPE}::{MROPE_REFUSED}"),
    ),
    Rule(
        R,
        "check_mrope_inputs",
        "needs an integer with |delta|",
        "the delta is an integer, |delta| < 2**62",
        "a new request with an M-RoPE table",
        GENERATED,
        (MALFORMATIONS, f"{MROPE}::{MROPE_REFUSED}"),
    ),
    Rule(
        R,
        "check_mrope_inputs",
        "without a position table",
        "a text request has no delta",
        EVERY_STEP,
        GENERATED,
        (MALFORMATIONS, f"{MROPE}::{MROPE_REFUSED}"),
    ),
    Rule(
        R,
        "check_mrope_inputs",
        "table of integer positions",
        "a table is 3 rows of integer positions",
        "a new request with an M-RoPE table",
        GENERATED,
        (MALFORMATIONS, f"{MROPE}::{MROPE_REFUSED}"),
    ),
    Rule(
        R,
        "check_mrope_inputs",
        "columns for a prompt of",
        "a table has one column per prompt token",
        "a new request with an M-RoPE table",
        GENERATED,
        (MALFORMATIONS, f"{MROPE}::{MROPE_REFUSED}"),
    ),
    # checks 2-8 (spec/validate.py plan_step)
    Rule(
        V,
        "plan_step",
        '"finished_req_ids", "request holds no row"',
        "a finished request holds a row",
        "finished and new requests in one step",
        GENERATED,
        (EVERY_CLASS,),
    ),
    Rule(
        V,
        "plan_step",
        '"cached_requests", "request holds no row"',
        "a cached request holds a row",
        EVERY_STEP,
        GENERATED,
        (EVERY_CLASS,),
    ),
    Rule(
        V, "plan_step", "already holds a row", "a new request holds no row yet", EVERY_STEP, GENERATED, (EVERY_CLASS,)
    ),
    Rule(
        V,
        "plan_step",
        "rows taken",
        "no more live requests than rows",
        "every row is held after the step",
        GENERATED,
        (EVERY_CLASS,),
    ),
    Rule(
        V,
        "plan_step",
        "step total",
        "no more scheduled tokens than the budget",
        "the step uses the whole token budget",
        GENERATED,
        (EVERY_CLASS,),
    ),
    Rule(
        V,
        "plan_step",
        '"prompt_token_ids", "not a tuple',
        "a prompt is integer ids",
        EVERY_STEP,
        GENERATED,
        (MALFORMATIONS,),
    ),
    Rule(
        V,
        "plan_step",
        '"prompt_token_ids", f"{bad[0]}',
        "prompt ids in the vocabulary",
        "a prompt id is vocab_size - 1",
        GENERATED,
        (EVERY_CLASS,),
    ),
    Rule(
        V,
        "plan_step",
        '"scheduled_spec_decode_tokens", "not a tuple',
        "drafts are integer ids",
        EVERY_STEP,
        GENERATED,
        (DRAFT_FAULTS,),
    ),
    Rule(
        V,
        "plan_step",
        '"scheduled_spec_decode_tokens", f"{bad[0]}',
        "draft ids in the vocabulary",
        "a draft id is vocab_size - 1",
        GENERATED,
        (DRAFT_FAULTS,),
    ),
    # a prompt of max_model_len tokens leaves no room for its sample: no scheduler sends one, so that valid side
    # is built by hand; a step may end at max_model_len when its last tokens are drafts (knob drafts_to_the_end)
    Rule(
        V,
        "plan_step",
        "len(new.prompt_token_ids)",
        "a prompt fits max_model_len",
        AT_MAX_MODEL_LEN,
        GENERATED,
        (EVERY_CLASS,),
    ),
    Rule(
        V,
        "plan_step",
        "> max_model_len",
        "a step ends at or before max_model_len",
        "a step ending at max_model_len",
        GENERATED,
        (EVERY_CLASS, AT_MAX_MODEL_LEN),
    ),
    Rule(
        V,
        "plan_step",
        'UnknownTokenError(s.req_id, "num_scheduled_tokens"',
        "every input token is known",
        "a step ending at the last known token (+ k drafts)",
        GENERATED,
        (EVERY_CLASS,),
    ),
    Rule(
        V,
        "plan_step",
        'UnknownTokenError(s.req_id, "scheduled_spec_decode_tokens"',
        "a drafting step ends exactly at known + k",
        "k drafts on exactly 1 + k scheduled tokens",
        GENERATED,
        (DRAFT_FAULTS,),
    ),
    # check 8 under async scheduling (spec/async_steps.py, rule 5)
    Rule(
        "async_steps.py",
        "check_no_drafts_after_unverified",
        "UnknownTokenError(req_id",
        "no drafts right after drafts whose verdict the host has not read",
        "drafts under async scheduling, the verdict before them read",
        GENERATED,
        (f"{ASYNC}::test_async_runs_agree_with_spec_on_every_step", DRAFT_FAULTS),
    ),
    Rule(
        "async_steps.py",
        "check_resumed_within_known",
        "UnknownTokenError(cached.req_id",
        "a request resumed while its drafts' verdict is unread runs over the tokens it held before them",
        f"{ASYNC}::test_a_resumption_over_the_tokens_held_before_unread_drafts_runs",
        f"{ASYNC}::test_a_resumption_past_the_tokens_held_before_unread_drafts_is_refused",
        (f"{ASYNC}::test_a_resumption_past_the_tokens_held_before_unread_drafts_is_refused",),
    ),
    Rule(
        "async_steps.py",
        "check_proposed_drafts",
        "UnknownTokenError(req_id",
        "k placeholder drafts take k proposals the drafter made at the row's last sample (none for a new or "
        "resumed request, none after a record without them)",
        f"{ASYNC_DRAFTS}::test_placeholder_drafts_follow_unverified_drafts_at_the_corrected_count",
        f"{ASYNC_DRAFTS}::test_more_placeholders_than_proposals_are_refused",
        (
            f"{ASYNC_DRAFTS}::test_more_placeholders_than_proposals_are_refused",
            f"{ASYNC_DRAFTS}::test_a_record_without_proposals_leaves_none",
            f"{ASYNC_DRAFTS}::test_a_new_request_never_drafts_from_a_previous_owners_proposals",
            f"{ASYNC_DRAFTS}::test_a_resumed_request_drafts_from_a_new_proposal_only",
        ),
    ),
    # checks 9-13 (spec/group_rules.py per group, spec/validate.py across groups)
    Rule(G, "check_range", '"not a tuple, list', "block ids are integer ids", EVERY_STEP, GENERATED, (MALFORMATIONS,)),
    Rule(
        G,
        "check_range",
        "not in [0,",
        "block ids in [0, num_blocks)",
        "a block id num_blocks - 1",
        GENERATED,
        (EVERY_CLASS,),
    ),
    Rule(
        G,
        "check_ids",
        "appears twice",
        "ids distinct among the live entries (released ones may repeat)",
        "an id released by the window, live again",
        GENERATED,
        (MALFORMATIONS, f"{PIPELINE}::test_a_block_the_window_released_may_come_back_to_the_same_request"),
    ),
    Rule(
        V,
        "_check_one_pool",
        "BlockIdError(s.req_id",
        "one block pool: an id held in one group at a time",
        "one block pool: an id a window released, held by another group",
        GENERATED,
        (EVERY_CLASS, "conformance/test_one_pool.py"),
    ),
    Rule(
        G,
        "check_ids",
        "null block in a group without",
        "the null block only in windowed groups",
        "the null block in a windowed table",
        GENERATED,
        (EVERY_CLASS,),
    ),
    Rule(
        G,
        "check_size",
        "blocks >",
        "at most max_blocks_per_req entries",
        "a table of max_blocks_per_req entries",
        GENERATED,
        (EVERY_CLASS,),
    ),
    Rule(
        G,
        "check_present",
        "MissingBlockError(s.req_id",
        "a block for every scheduled token",
        "a step writing its table's last entry",
        GENERATED,
        (EVERY_CLASS,),
    ),
    Rule(
        G,
        "check_not_null",
        "NullBlockError(s.req_id",
        "nothing read or written through the null block",
        "a null entry just before the first one read",
        GENERATED,
        (EVERY_CLASS, f"{BOUNDARIES}::test_a_null_placeholder_appended_by_a_continuing_request_is_never_written"),
    ),
    Rule(
        V,
        "_check_unique_slots",
        "DuplicateSlotError",
        "no two tokens of a step write one slot",
        "a block another request holds, written",
        GENERATED,
        (EVERY_CLASS,),
    ),
    # encoder-decoder requests (spec/cross_attention.py), at checks 1, 7 and 11
    Rule(
        C,
        "check_encoder_fields",
        '"encoder_len", detail',
        "encoder_len is an integer >= 0",
        EVERY_STEP,
        GENERATED,
        (MALFORMATIONS,),
    ),
    Rule(
        C,
        "check_encoder_len",
        "no cross_attention group",
        "no encoder output on a model without a cross group",
        EVERY_STEP,
        GENERATED,
        (EVERY_CLASS,),
    ),
    Rule(
        C,
        "check_encoder_len",
        "not in [1, max_encoder_len",
        "1 <= encoder_len <= max_encoder_len with one",
        "an encoder_len of max_encoder_len",
        GENERATED,
        (EVERY_CLASS,),
    ),
    Rule(
        C,
        "check_cross_blocks",
        "encoder tokens need",
        "cdiv(encoder_len, block_size) cross blocks",
        "a cross table of exactly cdiv(encoder_len, block_size) blocks",
        GENERATED,
        (EVERY_CLASS,),
    ),
    Rule(
        C,
        "check_cross_blocks",
        "written at position 0 only",
        "new cross blocks only on a step from position 0",
        "an encoder-decoder request resumed from 0 (its encoder runs again)",
        GENERATED,
        (EVERY_CLASS,),
    ),
    # mamba state groups (spec/mamba.py), at checks 9-12 (check 13's site is _check_unique_slots')
    Rule(
        M,
        "check_ids",
        "appears twice",
        "a mamba table's non-null ids are distinct (null entries allowed)",
        "a step of a hybrid model (a mamba group)",
        GENERATED,
        (MALFORMATIONS, MAMBA_TESTS),
    ),
    Rule(
        M,
        "check_drafts",
        "BlockTableOverflowError(req_id",
        "at most num_speculative_blocks drafts",
        "as many drafts as the mamba group keeps speculative blocks",
        GENERATED,
        (EVERY_CLASS, MAMBA_TESTS),
    ),
    Rule(
        M,
        "check_present",
        '"num_computed_tokens"',
        "the state after position num_computed - 1 was kept",
        "a hybrid model's continuing request, reading its last step's state",
        GENERATED,
        (EVERY_CLASS, MAMBA_TESTS),
    ),
    Rule(
        M,
        "check_present",
        'f"block_ids[{g}]", detail',
        "the table reaches the read state and the last draft's",
        "a step writing its mamba table's last entry",
        GENERATED,
        (EVERY_CLASS, MAMBA_TESTS),
    ),
    Rule(
        M,
        "check_not_null",
        "the state read",
        "the state read is not the null block",
        "a hybrid model's continuing request, reading its last step's state",
        GENERATED,
        (EVERY_CLASS, MAMBA_TESTS),
    ),
    Rule(
        M,
        "check_not_null",
        "the state written",
        "no state is written to the null block",
        "a step of a hybrid model (a mamba group)",
        GENERATED,
        (EVERY_CLASS, MAMBA_TESTS),
    ),
    # record_sampled (spec/pool.py, spec/drafts.py)
    Rule(
        P,
        "record_sampled",
        '"batch", detail',
        "only the batch of the last prepare",
        EVERY_STEP,
        GENERATED,
        (
            f"{IP}::test_record_sampled_takes_only_the_batch_of_the_last_prepare",
            "conformance/test_boundaries.py::test_a_copy_of_the_batch_with_its_rows_permuted_is_refused",
        ),
    ),
    Rule(
        P,
        "record_sampled",
        '"sampled_token_ids", detail',
        "sampled ids of an integer dtype",
        EVERY_STEP,
        GENERATED,
        (SAMPLED, f"{IP}::test_sampled_ids_need_an_integer_dtype"),
    ),
    Rule(
        D,
        "token_rows",
        'None, "sampled_token_ids", detail',
        "ids are [num_reqs] or [num_reqs, width]",
        EVERY_STEP,
        GENERATED,
        (SAMPLED,),
    ),
    Rule(
        D,
        "token_rows",
        "rows of ids for",
        "one row of ids per batch row",
        EVERY_STEP,
        GENERATED,
        (SAMPLED, f"{ERRORS}::test_wrong_number_of_sampled_tokens_is_rejected"),
    ),
    Rule(
        D,
        "proposed_ids",
        "None, field, synchronous)",
        "the drafter's ids are taken under async scheduling only",
        f"{ASYNC_DRAFTS}::test_placeholder_drafts_take_the_drafters_ids",
        f"{ASYNC_DRAFTS}::test_placeholder_drafts_without_async_scheduling_are_refused",
        (f"{ASYNC_DRAFTS}::test_placeholder_drafts_without_async_scheduling_are_refused",),
    ),
    Rule(
        D,
        "proposed_ids",
        "needs integer ids",
        "the drafter's ids are integers",
        f"{ASYNC_DRAFTS}::test_placeholder_drafts_take_the_drafters_ids",
        f"{ASYNC_DRAFTS}::test_malformed_proposals_are_refused_at_once",
        (f"{ASYNC_DRAFTS}::test_malformed_proposals_are_refused_at_once",),
    ),
    Rule(
        D,
        "proposed_ids",
        "None, field, shape)",
        "the drafter's ids are [num_reqs, P]",
        f"{ASYNC_DRAFTS}::test_placeholder_drafts_take_the_drafters_ids",
        f"{ASYNC_DRAFTS}::test_malformed_proposals_are_refused_at_once",
        (f"{ASYNC_DRAFTS}::test_malformed_proposals_are_refused_at_once",),
    ),
    Rule(
        D,
        "check_accepted",
        "no token for a row that samples",
        "a taking row has a token",
        "a mid-prefill row beside taking rows",
        GENERATED,
        (SAMPLED,),
    ),
    Rule(
        D,
        "check_accepted",
        "a token after the placeholder",
        "no token after a row's first placeholder",
        "1 token kept of a drafting row (none accepted)",
        GENERATED,
        (SAMPLED,),
    ),
    Rule(
        D,
        "check_accepted",
        "InconsistentSchedulerOutputError(req_id, field, detail)",
        "at most 1 + k tokens, each but the last the drafts' own",
        "1 + k tokens kept (every draft accepted)",
        GENERATED,
        (SAMPLED,),
    ),
    Rule(
        D,
        "check_accepted",
        "TokenIdError",
        "kept ids in the vocabulary",
        "a sampled id vocab_size - 1",
        GENERATED,
        (SAMPLED, "conformance/test_boundaries.py::test_a_negative_id_in_the_one_id_per_row_form_is_refused"),
    ),
    Rule(
        D,
        "check_accepted",
        "no room past max_model_len",
        "kept tokens fit max_model_len",
        "kept tokens reaching max_model_len",
        GENERATED,
        (
            SAMPLED,
            "conformance/test_drafts.py::test_accepted_tokens_past_max_model_len_are_rejected",
            "conformance/test_errors.py::test_sampled_token_past_max_model_len_is_rejected",
        ),
    ),
    # prepare (its checks: check_last_applied, padded_tokens) and row_of (spec/pool.py)
    Rule(
        P,
        "check_last_applied",
        "not the last applied",
        "prepare only the output applied last",
        EVERY_STEP,
        GENERATED,
        (MISUSE, IP),
    ),
    Rule(
        P,
        "check_graphs_choice",
        "are exclusive",
        "pad_to and graphs are not both given (two answers to how far to pad)",
        EVERY_STEP,
        GRAPHS_BY_HAND,
        (GRAPHS_BY_HAND, GRAPHS_MISUSE),
    ),
    Rule(
        P,
        "check_graphs_choice",
        "needs a CapturedGraphs",
        "graphs is a CapturedGraphs",
        EVERY_STEP,
        GRAPHS_BY_HAND,
        (GRAPHS_BY_HAND,),
    ),
    Rule(
        P,
        "padded_tokens",
        "is not an integer",
        "pad_to is an integer",
        EVERY_STEP,
        GENERATED,
        (MISUSE, f"{IP}::test_pad_to_that_is_not_an_integer_at_least_the_tokens_is_refused"),
    ),
    Rule(
        P,
        "padded_tokens",
        "scheduled tokens",
        "pad_to is at least the scheduled tokens",
        EVERY_STEP,
        GENERATED,
        (MISUSE, f"{IP}::test_pad_to_that_is_not_an_integer_at_least_the_tokens_is_refused"),
    ),
    Rule(
        P,
        "row_of",
        "request holds no row",
        "row_of a request that holds a row",
        EVERY_STEP,
        GENERATED,
        (MISUSE, "conformance/test_errors.py::test_row_of_an_unknown_request"),
    ),
)
