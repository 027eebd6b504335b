"""Planted bugs for scripts/mutation-score: one or more per rule class, each a real bug class of engines.

Each mutant is an exact text replacement in one file of the product (or of the shadow checker) and the
test files expected to notice it. `tests/test_mutants.py` keeps this list honest in CI (every `old` text
still occurs exactly once, every test file exists), so the list cannot rot silently while the code moves.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    rule: str  # the rule of spec it breaks (docs/semantics.md, conformance/rules.py)
    path: str  # relative to the repository root
    old: str  # occurs exactly once in `path`
    new: str
    tests: tuple[str, ...]  # pytest arguments: the test files expected to fail


BOUNDARIES = "conformance/test_boundaries.py"
PIPELINE = "conformance/test_pipeline.py"
INVALID = "conformance/test_invalid.py"
TARGETED = "conformance/test_targeted.py"
CONTEXT_PARALLEL = "conformance/test_context_parallel.py"
CP_RANKS = "conformance/test_context_parallel_ranks.py"
CP_UNIT = "tests/test_context_parallel.py"
MAMBA = "conformance/test_mamba.py"
TINY_HYBRID = "tests/test_tiny_hybrid.py"
FP8_FAST = "tests/test_fast_fp8.py"
ATTENTION_FAST = "tests/test_fast_attention.py"
ASYNC = "conformance/test_async.py"
ASYNC_DRAFTS = "conformance/test_async_drafts.py"
ASYNC_FAULTS = "conformance/test_async_faults.py"
CROSS = "conformance/test_cross_attention.py"
MROPE = "conformance/test_mrope.py"
ONE_POOL = "conformance/test_one_pool.py"
MLA_UNIT = "tests/test_mla.py"
MLA_SPLIT = "tests/test_mla_split.py"
MLA_SUITE = "conformance/test_mla.py"
TINY_MLA = "tests/test_tiny_mla.py"
# MLA attention's read of a cache entry: the latent, then the RoPE part at offset kv_lora_rank; the bug reads the
# RoPE part from the entry's start (the latent's first rope_dim elements)
GRAPHS_UNIT = "tests/test_graphs.py"
UBATCH_UNIT = "tests/test_ubatch.py"
GRAPHS_SUITE = "conformance/test_graphs.py"
SHAPED_STEPS = f"{GRAPHS_SUITE}::test_graph_dp_and_dbo_steps_agree_with_spec"  # graphs, DP peers, dummies, DBO
PADDED_RUNS = f"{GRAPHS_SUITE}::test_spec_and_fast_agree_on_padded_batches"  # every step prepared with graphs
SHADOW_PADDING = "tests/test_shadow_padding.py"
ROPE_READ = "        latents, k_pe = entries[:, :rank], entries[:, rank:]  # [k, L], [k, R]\n"
ROPE_AT_LATENT = "        latents, k_pe = entries[:, :rank], entries[:, : entries.shape[1] - rank]  # [k, L], [k, R]\n"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "sampled-negative-id-accepted",
        "record_sampled: every taken id in the vocabulary",
        "fast/sampled.py",
        "if sampled[b] < 0 or sampled[b] >= vocab or known >= max_len:",
        "if sampled[b] >= vocab or known >= max_len:",
        (BOUNDARIES,),
    ),
    Mutant(
        "released-tails-not-refreshed-on-append",
        "12 NullBlockError: nothing written through the null block",
        "fast/released.py",
        "for e in range(starts[k], starts[k] + lengths[k]):",
        "for e in range(starts[k], starts[k]):",
        (BOUNDARIES,),
    ),
    Mutant(
        "released-tails-miss-a-handed-back-id",
        "12 NullBlockError: nothing written through the null block",
        "fast/released.py",
        "                    tails[row] = max(tails[row], j)\n",
        "                    pass\n",
        (BOUNDARIES, PIPELINE),
    ),
    Mutant(
        "stale-batch-rows-not-compared",
        "record_sampled: only the batch of the last prepare",
        "fast/pool.py",
        "and np.array_equal(host_array(batch.index_mapping)[: batch.num_reqs], self._prepared_rows_np)\n",
        "",
        (BOUNDARIES,),
    ),
    Mutant(
        "drafts-after-previous-owner",
        "drafts: a new request's drafts follow its prompt",
        "fast/drafts.py",
        "return plan.num_computed + plan.num_scheduled - num_drafts",
        "return plan.num_computed + plan.num_scheduled - num_drafts + (plan.num_computed == 0)",
        (BOUNDARIES,),
    ),
    Mutant(
        "shadow-padding-checked-one-late",
        "padding: a padded token writes no KV (PAD_SLOT_ID)",
        "shadow/compare_steps.py",
        'padding = a[name][total:] if kind == "slot_mapping" else np.zeros(0)',
        'padding = a[name][total + 1 :] if kind == "slot_mapping" else np.zeros(0)',
        (BOUNDARIES,),
    ),
    Mutant(
        "spec-window-reuse-refused",
        "9 BlockIdError: ids distinct among live entries only",
        "spec/group_rules.py",
        "live = s.tables[g][self.live_from(state, s, g) :]",
        "live = s.tables[g]",
        (PIPELINE,),
    ),
    Mutant(
        "async-record-checks-one-draft-short",
        "record_sampled: every kept draft equals the draft at its position (async, host mode)",
        "fast/async_steps.py",
        "fault = fault or (j < count - 1 and tokens[b, j] != draft_ids[starts[i] + j])",
        "fault = fault or (j < count - 2 and tokens[b, j] != draft_ids[starts[i] + j])",
        (ASYNC_FAULTS,),
    ),
    Mutant(
        "async-record-kernel-checks-one-draft-short",
        "record_sampled: every kept draft equals the draft at its position (async, the Triton record kernel)",
        "fast/kernels/record_ahead.py",
        "not_a_draft = tl.reduce((kept & (cols < count - 1) & (t != draft))",
        "not_a_draft = tl.reduce((kept & (cols < count - 2) & (t != draft))",
        (ASYNC_FAULTS,),
    ),
    Mutant(
        "async-bulk-rules-unvouched",
        "8 UnknownTokenError under async: the bulk planner's plans are held to rules 5, 7 and 8 (fast)",
        "fast/step_modes.py",
        "        return Fallback.ASYNC_RULES\n",
        "        return None\n",
        (ASYNC, ASYNC_DRAFTS),
    ),
    Mutant(
        "async-proposals-of-a-previous-owner",
        "async rule 8: a row's next owner drafts from no proposal of its predecessor (vllm-ascend #13864)",
        "spec/async_steps.py",
        "    state.num_proposed[rows] = 0  # a row that does not take its sample proposes nothing\n",
        "",
        (ASYNC_DRAFTS,),
    ),
    Mutant(
        "async-proposals-kept-on-resume",
        "async rule 8: a new or resumed request drafts only from a new proposal",
        "spec/async_steps.py",
        "proposed = 0 if row is None or req_id in resumed else int(state.num_proposed[row])",
        "proposed = 0 if row is None else int(state.num_proposed[row])",
        (ASYNC_DRAFTS,),
    ),
    Mutant(
        "async-stale-proposals-kept",
        "async rule 8: a record without the drafter's ids leaves its rows none (fast's host bookkeeping)",
        "fast/async_steps.py",
        "num_proposed[row] = width if takes else 0",
        "num_proposed[row] = max(width, num_proposed[row]) if takes else 0",
        (ASYNC_DRAFTS,),
    ),
    Mutant(
        "async-proposals-unchecked-spec",
        "async rule 8: a proposal outside the vocabulary is a late TokenIdError (spec)",
        "spec/async_steps.py",
        "bad = proposed[b][(proposed[b] < 0) | (proposed[b] >= config.vocab_size)]",
        "bad = proposed[b][(proposed[b] < 0) & (proposed[b] >= config.vocab_size)]",
        (ASYNC_DRAFTS,),
    ),
    Mutant(
        "async-proposals-unchecked-host",
        "async rule 8: a proposal outside the vocabulary is a late TokenIdError (fast, host mode)",
        "fast/async_steps.py",
        "fault = fault or proposed[b, j] < 0 or proposed[b, j] >= vocab",
        "fault = fault or proposed[b, j] < 0",
        (ASYNC_DRAFTS,),
    ),
    Mutant(
        "async-proposals-unchecked-kernel",
        "async rule 8: a proposal outside the vocabulary is a late TokenIdError (fast, Triton path)",
        "fast/kernels/record_ahead.py",
        "faults |= ((proposed < 0) | (proposed >= vocab)).any(dim=1).to(torch.int32)",
        "faults |= (proposed < 0).any(dim=1).to(torch.int32)",
        (ASYNC_DRAFTS,),
    ),
    Mutant(
        "async-device-drafts-not-copied",
        "async rule 8: the model reads the drafter's ids at the draft positions (fast, Triton path)",
        "fast/async_steps.py",
        "self.dev.token_ids.index_put_((row_index, self.num_known[row_index] + draft), values)",
        "values.zero_()",
        (ASYNC_DRAFTS,),
    ),
    Mutant(
        "async-resume-past-unread-verdict",
        "8 UnknownTokenError: a resumption with its drafts' verdict unread runs over the tokens held before them",
        "spec/async_steps.py",
        "        if end > held:",
        "        if end > held + 3:",
        (ASYNC,),
    ),
    Mutant(
        "async-resume-corrected",
        "async scheduling: the correction leaves a resumed count alone (rule 2), a resumption at once included",
        "spec/async_steps.py",
        "for c in sched.cached_requests if not c.resumed]",
        "for c in sched.cached_requests]",
        (ASYNC,),
    ),
    Mutant(
        "async-resume-corrected-on-the-device",
        "async scheduling: the correction leaves a resumed count alone (rule 2), a resumption at once included",
        "fast/async_steps.py",
        "        if replaced[i]:\n            drop[table_rows[i]] = True\n",
        "",
        (ASYNC,),
    ),
    Mutant(
        "async-resume-window-from-a-corrected-start",
        "9/12 under async: a resumed step's window is checked from its own start, which no verdict moves",
        "spec/async_steps.py",
        "    if row is None or resumed:\n",
        "    if row is None:\n",
        (ASYNC,),
    ),
    Mutant(
        "async-pending-from-an-older-batch",
        "async scheduling: after a step whose batch was not recorded, no pending token (rule 3)",
        "spec/step_modes.py",
        "        forget_unrecorded(state, self.recorded)",
        "        pass",
        (ASYNC,),
    ),
    Mutant(
        "async-pending-from-an-older-batch-fast",
        "async scheduling: after a step whose batch was not recorded, no pending token (rule 3)",
        "fast/step_modes.py",
        "        forget_unrecorded(state, self.recorded)",
        "        pass",
        (ASYNC,),
    ),
    Mutant(
        "async-rejected-drafts-kept-for-a-new-owner",
        "async scheduling: a row's new owner carries nothing of the old one's verdict (vllm-ascend #13864)",
        "spec/async_steps.py",
        "    num_rejected[freed_rows] = 0\n",
        "",
        (ASYNC,),
    ),
    Mutant(
        "async-rejected-drafts-kept-for-a-new-owner-host",
        "async scheduling: a row's new owner carries nothing of the old one's verdict (vllm-ascend #13864)",
        "fast/async_steps.py",
        "            gone = gone or row == rows[i]\n",
        "            gone = gone and row == rows[i]\n",
        (ASYNC,),
    ),
    Mutant(
        "spec-one-pool-unchecked",
        "9 BlockIdError: with one block pool, an id held in one group at a time",
        "spec/validate.py",
        "if config.one_block_pool and num_groups > 1:  # check 9 across groups",
        "if config.one_block_pool and num_groups > 9:  # check 9 across groups",
        (ONE_POOL, INVALID),
    ),
    Mutant(
        "spec-one-pool-released-entries-held",
        "9 BlockIdError: a block a window released may go to another group",
        "spec/validate.py",
        "for block in rules[g].held_ids(state, s, g).tolist():",
        "for block in set(s.tables[g].tolist()) - {0}:",
        (ONE_POOL,),
    ),
    Mutant(
        "fast-one-pool-unchecked",
        "9 BlockIdError: with one block pool, an id held in one group at a time (fast's bulk check)",
        "fast/one_pool.py",
        "if owner[block] != 0 and owner[block] != mark:",
        "if owner[block] == 127:",
        (ONE_POOL, INVALID),
    ),
    Mutant(
        "fast-mamba-speculative-states-written-twice",
        "13 DuplicateSlotError: no mamba state block written by two requests (fast's bulk check)",
        "fast/mamba_bulk.py",
        "if count < 0 or written_twice(EMPTY, written[:count], marks):",
        "if count < 0:",
        (MAMBA,),
    ),
    Mutant(
        "fast-async-window-read-from-the-count-sent",
        "async rule 4, 9 BlockIdError: a window read from the lowest start a verdict gives (fast's bulk check)",
        "fast/validate.py",
        "lowest_starts(rows, num_computed, state.num_unverified_drafts) if config.async_scheduling else num_computed",
        "num_computed",
        (ASYNC,),
    ),
    Mutant(
        "fast-async-mamba-read-at-the-count-sent",
        "async rule 4, 11 MissingBlockError: a mamba state stored for every count a verdict gives (fast's bulk check)",
        "fast/mamba_bulk.py",
        "lowest[i] = max(0, c - unverified[row])",
        "lowest[i] = c",
        (ASYNC,),
    ),
    Mutant(
        "fast-async-mamba-writes-at-the-count-sent",
        "async rule 4, 13 DuplicateSlotError: the mamba states every verdict may write (fast's bulk check)",
        "fast/mamba_bulk.py",
        "for e in range((lowest[i] + num_scheduled[i] - 1) // block_size, write + drafts + 1):",
        "for e in range(write, write + drafts + 1):",
        (ASYNC,),
    ),
    Mutant(
        "fast-mamba-prefix-hit-inside-a-state-block",
        "11 MissingBlockError: a new request's mamba read is a state cached at a block's end (fast's bulk check)",
        "fast/mamba_bulk.py",
        "if c % min_block != 0:  # a cached state covers whole blocks only",
        "if c < 0:  # a cached state covers whole blocks only",
        (MAMBA,),
    ),
    Mutant(
        "fast-one-pool-appends-unmarked",
        "9 BlockIdError: with one block pool, an id appended to one group while another holds it",
        "fast/one_pool.py",
        "start = max(lo, end[row]) if marked[row] and first[row] != end[row] else lo",
        "start = total if marked[row] and first[row] != end[row] else lo",
        (ONE_POOL,),
    ),
    Mutant(
        "fast-released-entries-not-rechecked",
        "9 BlockIdError: a released duplicate read again is refused",
        "fast/bulk_checks.py",
        "if window > 0 and (released_tails.shape[0] == 0 or released_tails[row] >= lo):",
        "if False:",
        (PIPELINE,),
    ),
    Mutant(
        "fast-shared-block-slots-unchecked",
        "13 DuplicateSlotError: no two tokens of a step write one slot",
        "fast/validate.py",
        "if written_twice(new_written[g] if num_new else EMPTY, written, memory.written):",
        "if False:",
        (TARGETED, INVALID),
    ),
    Mutant(
        "fast-missing-block-off-by-one",
        "11 MissingBlockError: a block for every scheduled token",
        "fast/bulk_checks.py",
        "if count + added[i] > width or last_block >= count + added[i]:",
        "if count + added[i] > width or last_block > count + added[i]:",
        (INVALID, "tests/test_fast_validate.py::test_decode_step_errors_match_spec"),
    ),
    Mutant(
        "fast-unknown-token-off-by-one",
        "8 UnknownTokenError: every input token known",
        "fast/bulk_checks.py",
        "if num_computed[i] < 0 or last[i] >= num_known[rows[i]] + k:",
        "if num_computed[i] < 0 or last[i] > num_known[rows[i]] + k:",
        (INVALID,),
    ),
    Mutant(
        "fast-row-memo-kept-past-a-freed-row",
        "3 rows: a continuing request's row is the row it holds",
        "fast/bulk_read.py",
        "if self.req_ids is not None and _any_at(self._held, rows):",
        "if False:",
        ("tests/test_fast_validate.py",),
    ),
    Mutant(
        "fast-new-request-unknown-token-off-by-one",
        "8 UnknownTokenError: a new request's every input token known",
        "fast/bulk_checks.py",
        "if prompt_lens[i] > max_model_len or num_computed[i] < 0 or last[i] >= known_end:",
        "if prompt_lens[i] > max_model_len or num_computed[i] < 0 or last[i] > known_end:",
        (INVALID, "tests/test_fast_validate.py::test_mixed_step_errors_match_spec"),
    ),
    Mutant(
        "spec-cp-transform-on-replicated-group",
        "context parallelism: a replicated group keeps the pool's slots on every rank (vLLM PR #57260)",
        "spec/context_parallel.py",
        "        if cp.is_sharded(g):\n            bs = cp.block_size(config, g)",
        "        if True:\n            bs = cp.block_size(config, g)",
        (CONTEXT_PARALLEL,),
    ),
    Mutant(
        "cp-merge-empty-states-nan",
        "context parallelism: merging empty states (LSE -inf) gives output 0, never NaN (FlashInfer #4051)",
        "fast/context_parallel.py",
        "    safe = torch.where(empty, 1.0, total)\n",
        "    safe = total\n",
        (CP_UNIT, CONTEXT_PARALLEL, CP_RANKS),
    ),
    Mutant(
        "cp-merge-unguarded-shift-nan",
        "context parallelism: merging empty states (LSE -inf) gives output 0, never NaN (FlashInfer #4051)",
        "fast/context_parallel.py",
        '    shift = torch.where(peak == float("-inf"), 0.0, peak)\n    weights = torch.exp(lses_acc',
        "    shift = peak\n    weights = torch.exp(lses_acc",
        (CP_UNIT, CONTEXT_PARALLEL),
    ),
    Mutant(
        "spec-cp-merge-empty-states-nan",
        "context parallelism: merging empty states (LSE -inf) gives output 0, never NaN (FlashInfer #4051)",
        "spec/context_parallel.py",
        "    safe = np.where(empty, dtype(1), total)\n",
        "    safe = total\n",
        (CP_UNIT,),
    ),
    Mutant(
        "async-rejected-drafts-uncorrected",
        "async scheduling: the device takes the rejected drafts off the optimistic num_computed (vllm-ascend #14883)",
        "fast/async_steps.py",
        "        computed[row] -= rejected[row]\n",
        "        computed[row] -= 0\n",
        (ASYNC,),
    ),
    Mutant(
        "async-cp-lengths-from-optimistic-counts",
        "context parallelism under async scheduling: each rank's slots and lengths from the corrected count (the "
        "Triton path's correction skipped; vllm-ascend #10032)",
        "fast/async_steps.py",
        "            self.dev.num_computed[cont] -= self.num_rejected[cont]\n",
        "",
        (CONTEXT_PARALLEL,),
    ),
    Mutant(
        "async-cp-lengths-from-optimistic-counts-spec",
        "context parallelism under async scheduling: each rank's slots and lengths from the corrected count (spec's "
        "correction skipped for continuing requests)",
        "spec/async_steps.py",
        "    state.num_computed_tokens[continuing] -= num_rejected[continuing]\n",
        "",
        (CONTEXT_PARALLEL,),
    ),
    Mutant(
        "async-pending-token-for-a-new-owner",
        "async scheduling: a new request on a retaken row has no pending token (vLLM #37159)",
        "spec/state.py",
        "            self.sampled_in[freed] = -1  # a new owner of the row has no pending token\n",
        "",
        (ASYNC,),
    ),
    Mutant(
        "async-faulty-record-appended",
        "async scheduling: a faulty record appends placeholders, never the faulty ids",
        "fast/async_steps.py",
        "PLACEHOLDER_TOKEN_ID if any_fault else tokens[b, j]",
        "tokens[b, j] if j < w else PLACEHOLDER_TOKEN_ID",
        (ASYNC,),
    ),
    Mutant(
        "mrope-chunk-read-from-column-0",
        "M-RoPE: a chunk reads the table at its own positions, cut at its end (vLLM PRs #10388/#10403)",
        "fast/mrope.py",
        "out[j, t] = tables[row, j, p] if p < lengths[row] else p + deltas[row]",
        "out[j, t] = tables[row, j, t - query_start_loc[b]] if p < lengths[row] else p + deltas[row]",
        (MROPE,),
    ),
    Mutant(
        "mrope-chunk-past-the-prompt-reads-the-table",
        "M-RoPE: each token past the prompt is p + delta, in a chunk that starts inside the prompt too",
        "fast/mrope.py",
        "out[j, t] = tables[row, j, p] if p < lengths[row] else p + deltas[row]",
        "out[j, t] = tables[row, j, p] if positions[query_start_loc[b]] < lengths[row] else p + deltas[row]",
        (MROPE,),
    ),
    Mutant(
        "mrope-delta-not-kept-between-steps",
        "M-RoPE: the delta is the request's from admission on, never changed between chunks (vLLM PR #10403)",
        "fast/mrope.py",
        "        self.deltas[freed_rows] = 0\n",
        "        self.deltas[:] = 0\n",
        (MROPE,),
    ),
    Mutant(
        "mrope-decode-rows-plain-positions",
        "M-RoPE: decode rows in a mixed batch get p + delta, not plain positions (SGLang PR #11330)",
        "fast/kernels/mrope.py",
        "tl.where(in_table, column, position + delta)",
        "tl.where(in_table, column, position)",
        (MROPE,),
    ),
    Mutant(
        "spec-mrope-decode-rows-empty",
        "M-RoPE: decode rows in a mixed batch get p + delta, not empty positions (SGLang PR #11330)",
        "spec/mrope.py",
        "    out[:, :num_tokens] = p + deltas[token_rows]  # past the prompt",
        "    out[:, :0] = p[:0]  # past the prompt",
        (MROPE,),
    ),
    Mutant(
        "cross-slots-for-encoders-that-do-not-run",
        "cross-attention: the cross slot mapping covers only the rows whose encoder runs (a step from position 0)",
        "fast/cross_attention.py",
        "scheduled = np.where(state.num_computed_tokens[index_mapping] == 0, lens, 0)",
        "scheduled = lens",
        (CROSS,),
    ),
    Mutant(
        "spec-cross-slots-for-encoders-that-do-not-run",
        "cross-attention: the cross slot mapping covers only the rows whose encoder runs (a step from position 0)",
        "spec/cross_attention.py",
        "runs = (lens > 0) & (num_computed[index_mapping] == 0)",
        "runs = lens > 0",
        (CROSS,),
    ),
    Mutant(
        "spec-cross-slots-not-cut-to-encoder-len",
        "cross-attention: block_ids[:cdiv(L, bs)] * bs + arange, cut to L",
        "spec/cross_attention.py",
        ".reshape(-1)[:encoder_len]",
        ".reshape(-1)",
        (CROSS,),
    ),
    Mutant(
        "cross-slots-not-cut-to-encoder-len",
        "cross-attention: block_ids[:cdiv(L, bs)] * bs + arange, cut to L",
        "fast/cross_attention.py",
        "which, within = ranges(scheduled)",
        "which, within = ranges(-(-scheduled // block_size) * block_size)",
        (CROSS,),
    ),
    Mutant(
        "sglang-last-loc-at-seq-len",
        "SGLang layout: decoder position p is at column encoder_len + p (SGLang PR #39040)",
        "fast/interop/sglang.py",
        "last_loc=filled.gather(1, (encoder_lens + seq_lens - 1)[:, None]).squeeze(1),",
        "last_loc=filled.gather(1, (seq_lens - 1)[:, None]).squeeze(1),",
        (CROSS, "conformance/test_interop.py"),
    ),
    Mutant(
        "spec-sglang-last-loc-at-seq-len",
        "SGLang layout: decoder position p is at column encoder_len + p (SGLang PR #39040)",
        "spec/interop/sglang.py",
        "last_loc=req_to_token[rows, encoder_lens + seq_lens - 1],",
        "last_loc=req_to_token[rows, seq_lens - 1],",
        (CROSS, "conformance/test_interop.py"),
    ),
    Mutant(
        "cross-attention-causal",
        "cross-attention: every decoder query sees all L encoder keys, no causal mask",
        "fast/encoder_attention.py",
        "lens.clamp(min=1).to(encoder_seq_lens.dtype),",  # a row's query i of n sees its first L - (n - 1 - i) keys
        "(lens - (ends[row] - 1 - tokens)).clamp(min=1).to(encoder_seq_lens.dtype),",
        (CROSS,),
    ),
    Mutant(
        "fp8-value-scale-not-applied",
        "fp8 KV caches: attention reads decode(code) * v_scale (FlashInfer: out *= v_scale)",
        "fast/cpu/prefill.py",
        "inv = v_scale[h] / total[u, r]",
        "inv = np.float32(1.0) / total[u, r]",
        (FP8_FAST,),
    ),
    Mutant(
        "fp8-key-scale-applied-twice",
        "fp8 KV caches: attention reads decode(code) * k_scale (FlashInfer: sm_scale *= k_scale)",
        "fast/kernels/paged_attention.py",
        "logit_scale = scale * tl.load(k_scale_ptr + kv_head)",
        "logit_scale = scale * tl.load(k_scale_ptr + kv_head) * tl.load(k_scale_ptr + kv_head)",
        (FP8_FAST,),
    ),
    Mutant(
        "fp8-scale-by-query-head",
        "fp8 KV caches: query head h reads the scale of KV head h // (num_heads // num_kv_heads)",
        "fast/cpu/prefill.py",
        "ks = scale * k_scale[h]",
        "ks = scale * k_scale[(h * group) % k_scale.shape[0]]",
        (FP8_FAST,),
    ),
    Mutant(
        "cpu-prefill-second-row-vector-reads-the-first",
        "paged attention: each query row's logits come from its own query",
        "fast/cpu/prefill.py",
        "qa, qb = simd.load(qt, d * rp + rv), simd.load(qt, d * rp + rv + LANES)",
        "qa, qb = simd.load(qt, d * rp + rv), simd.load(qt, d * rp + rv)",
        (ATTENTION_FAST,),
    ),
    Mutant(
        "cpu-prefill-last-rows-repeat-a-key",
        "paged attention: a row reads every visible key of its walked blocks",
        "fast/cpu/prefill.py",
        "a7 = simd.fma(simd.broadcast(kbuf, kh + d), qa, a7)",
        "a7 = simd.fma(simd.broadcast(kbuf, kg + d), qa, a7)",
        (ATTENTION_FAST,),
    ),
    Mutant(
        "cpu-prefill-causal-mask-skipped-at-the-diagonal",
        "paged attention: causal, a query sees no key past its own position",
        "fast/cpu/prefill.py",
        "masked = first + j1 - 1 > p0 or",
        "masked = first + j1 - 1 > p0 + 1 or",
        (ATTENTION_FAST,),
    ),
    Mutant(
        "cpu-prefill-window-mask-skipped-at-its-edge",
        "paged attention: sliding window, a query sees only its last `window` positions",
        "fast/cpu/prefill.py",
        "(window != 0 and first + j0 < k_hi - window)",
        "(window != 0 and first + j0 < k_hi - window - 1)",
        (ATTENTION_FAST,),
    ),
    Mutant(
        "cpu-prefill-later-tiles-miss-their-last-key",
        "paged attention: causal, a query sees every key up to its own position",
        "fast/cpu/prefill.py",
        "tile_hi = min(p0s[u] + tile, k_hi)",
        "tile_hi = min(p0s[u] + tile - (u > 0), k_hi)",
        (ATTENTION_FAST,),
    ),
    Mutant(
        "cpu-decode-small-group-reads-one-row",
        "paged attention: GQA, every query head of a KV head attends",
        "fast/cpu/decode.py",
        "s[r, j] = dot(q[r], key[at : at + head_dim]) * (scale * k_scale[h])",
        "s[r, j] = dot(q[h * group], key[at : at + head_dim]) * (scale * k_scale[h])",
        (ATTENTION_FAST,),
    ),
    Mutant(
        "spec-fp8-value-scale-not-applied",
        "fp8 KV caches: attention reads decode(code) * v_scale (FlashInfer: out *= v_scale)",
        "spec/attention.py",
        "values = dequantize(values, fmt, v_scales[None, :, None], dtype)",
        "values = dequantize(values, fmt, np.ones_like(v_scales)[None, :, None], dtype)",
        (f"{PIPELINE}::test_fp8_write_kv_then_paged_attention_matches_dense_attention",),
    ),
    Mutant(
        "fp8-int32-block-offsets",
        "fp8 KV caches: cache offsets are int64 (a cache of more than 2**31 elements, vLLM #50427)",
        "fast/kernels/paged_attention.py",
        "phys = tl.load(table_row + k_pos // block_size, mask=k_mask, other=0).to(tl.int64)",
        "phys = tl.load(table_row + k_pos // block_size, mask=k_mask, other=0)",
        (f"{FP8_FAST}::test_fp8_cache_offsets_past_int32",),
    ),
    Mutant(
        "fp8-int32-slot-offsets",
        "fp8 KV caches: cache offsets are int64 (a cache of more than 2**31 elements, vLLM #50427)",
        "fast/kernels/write_kv.py",
        "slot = tl.load(slot_mapping_ptr + token).to(tl.int64)",
        "slot = tl.load(slot_mapping_ptr + token)",
        (f"{FP8_FAST}::test_fp8_cache_offsets_past_int32",),
    ),
    Mutant(
        "mamba-fresh-row-reads-null-block",
        "mamba: a row without prior state reads no state block (-1), never the null block (vLLM PR #33937)",
        "fast/mamba.py",
        "read[b] = NO_STATE if bases[b] < 0 else",
        "read[b] = 0 if bases[b] < 0 else",  # block 0 is the null block
        (MAMBA, TINY_HYBRID),
    ),
    Mutant(
        "mamba-fresh-row-reads-its-stale-block",
        "mamba: a fresh row never reads the state a finished request left in its block (vLLM PR #37728)",
        "fast/kernels/mamba.py",
        "    prev = tl.load(entries + column, mask=base >= 0, other=-1)",
        "    prev = tl.load(entries + column)",
        (MAMBA,),
    ),
    Mutant(
        "mamba-resumed-row-reads-its-old-state",
        "mamba: a resumed request starts from its new table's state, not the one before its preemption",
        "spec/mamba.py",
        "fresh = s.fresh_tables",
        "fresh = False",
        (MAMBA, TINY_HYBRID),
    ),
    Mutant(
        "mamba-async-read-from-the-optimistic-count",
        "mamba under async: the state read and num_accepted_tokens follow the count corrected by rejected drafts",
        "spec/mamba.py",
        "num_computed = np.asarray(batch.seq_lens) - np.asarray(batch.num_scheduled_tokens)",
        "num_computed = in_batch_order(plan.num_computed, order)",  # the count the scheduler sent
        (
            f"{ASYNC}::test_a_mamba_state_is_read_from_the_corrected_count",
            f"{ASYNC}::test_async_hybrid_runs_agree_with_spec_on_every_step",
        ),
    ),
    Mutant(
        "mamba-async-read-from-the-optimistic-count-host-mode",
        "mamba under async: the state read and num_accepted_tokens follow the count corrected by rejected drafts",
        "fast/mamba.py",
        "num_scheduled.numpy(), steps.bases,",
        # the compiled gather runs each row at seq_lens - num_scheduled: made the host's plan count
        "(seq_lens.numpy() - in_batch_order(plan.num_computed, order)).astype(np.int32), steps.bases,",
        (
            f"{ASYNC}::test_a_mamba_state_is_read_from_the_corrected_count",
            f"{ASYNC}::test_async_hybrid_runs_agree_with_spec_on_every_step",
        ),
    ),
    Mutant(
        "mamba-async-state-indices-from-host-seq-lens-triton",
        "mamba under async: the state read and num_accepted_tokens follow the count corrected by rejected drafts",
        "fast/mamba.py",
        "mamba_state_indices_triton(table, batch.index_mapping, seq_lens, num_scheduled, reads,",
        "mamba_state_indices_triton(table, batch.index_mapping, upload(in_batch_order(plan.num_computed"
        " + plan.num_scheduled, order).astype(np.int32), dev.device), num_scheduled, reads,",  # the host's lengths
        (f"{ASYNC}::test_a_mamba_state_is_read_from_the_corrected_count",),
    ),
    Mutant(
        "mamba-table-without-speculative-blocks",
        "mamba: the table's width holds the speculative state blocks (vllm-ascend PR #11466)",
        "spec/types.py",
        "        spec_blocks = self.kv_groups[group].num_speculative_blocks\n",
        "        spec_blocks = 0\n",
        (MAMBA,),
    ),
    Mutant(
        "columns-resumed-ids-of-any-container",
        "check 1: the columns' resumed_req_ids is a set (an empty tuple reads as no resumptions)",
        "fast/bulk_read.py",
        "if type(resumed_ids) not in (frozenset, set) or resumed_ids or type(cached.req_ids) not in SEQUENCES:",
        "if resumed_ids or type(cached.req_ids) not in SEQUENCES:",
        (f"{INVALID}::test_every_malformation_is_provoked_and_survived",),
    ),
    Mutant(
        "pad-to-below-the-tokens-accepted",
        "prepare: pad_to is at least the step's scheduled tokens",
        "spec/pool.py",
        "    if pad_to < num_tokens:\n",
        "    if False:\n",
        (f"{INVALID}::test_misuse_between_the_calls_changes_nothing",),
    ),
    Mutant(
        "drafts-kept-past-max-model-len",
        "record_sampled: kept tokens fit max_model_len",
        "fast/sampled.py",
        "        if c == 0 or c > 1 + k or known + c > max_len:",
        "        if c == 0 or c > 1 + k:",
        ("conformance/test_sampled_faults.py",),
    ),
    Mutant(
        "mla-write-parts-swapped-spec",
        "MLA write: an entry is kv_c then k_pe (concat_and_cache_mla), latent first",
        "spec/mla_cache.py",
        "entries = np.concatenate([kv_c, k_pe], axis=1)",
        "entries = np.concatenate([k_pe, kv_c], axis=1)",
        (MLA_UNIT, TINY_MLA),
    ),
    Mutant(
        "mla-write-parts-swapped-fast",
        "MLA write: an entry is kv_c then k_pe (concat_and_cache_mla), latent first",
        "fast/mla_cache.py",
        "    entries = torch.cat([kv_c, k_pe], dim=1)  # [T, kv_lora_rank + rope_dim], latent first",
        "    entries = torch.cat([k_pe, kv_c], dim=1)  # [T, kv_lora_rank + rope_dim], latent first",
        (MLA_UNIT, MLA_SUITE),
    ),
    Mutant(
        "mla-write-parts-swapped-kernel",
        "MLA write: an entry is kv_c then k_pe (concat_and_cache_mla), latent first",
        "fast/kernels/mla_cache.py",
        "    tl.store(entry + lanes_l, latent, mask=lanes_l < rank)  # the latent first, then the RoPE part\n"
        "    tl.store(entry + rank + lanes_r, rope, mask=lanes_r < rope_dim)",
        "    tl.store(entry + rope_dim + lanes_l, latent, mask=lanes_l < rank)\n"
        "    tl.store(entry + lanes_r, rope, mask=lanes_r < rope_dim)",
        (MLA_UNIT,),
    ),
    Mutant(
        "mla-decode-rope-read-at-the-latent-spec",
        "MLA attention: the RoPE key part is read at offset kv_lora_rank of the entry",
        "spec/mla_attention.py",
        ROPE_READ + '        logits = np.einsum("qhl,kl->hqk"',
        ROPE_AT_LATENT + '        logits = np.einsum("qhl,kl->hqk"',
        (MLA_UNIT, TINY_MLA),
    ),
    Mutant(
        "mla-prefill-rope-read-at-the-latent-spec",
        "MLA attention: the RoPE key part is read at offset kv_lora_rank of the entry",
        "spec/mla_attention.py",
        ROPE_READ + "        keys = np.einsum(",
        ROPE_AT_LATENT + "        keys = np.einsum(",
        (MLA_UNIT, TINY_MLA),
    ),
    Mutant(
        "mla-decode-rope-read-at-the-latent-fast",
        "MLA attention: the RoPE key part is read at offset kv_lora_rank of the entry",
        "fast/kernels/mla_attention.py",
        "pe = tl.load(entry[:, None] + rank + rope[None, :],",
        "pe = tl.load(entry[:, None] + rope[None, :],",
        (MLA_UNIT, MLA_SUITE),
    ),
    Mutant(
        "mla-decode-query-parts-swapped-fast-host",
        "MLA attention: fast's CPU decode concatenates the query's two parts in the wrong order",
        "fast/mla_attention.py",
        "torch.cat((as_float32(q_latent.detach()), as_float32(q_pe.detach())), dim=2)",
        "torch.cat((as_float32(q_pe.detach()), as_float32(q_latent.detach())), dim=2)",
        (MLA_UNIT, MLA_SUITE),
    ),
    Mutant(
        "mla-prefill-rope-read-at-the-latent-fast",
        "MLA attention: the RoPE key part is read at offset kv_lora_rank of the entry",
        "fast/mla_attention.py",
        ROPE_READ + "        keys = torch.einsum(",
        ROPE_AT_LATENT + "        keys = torch.einsum(",
        (MLA_UNIT, MLA_SUITE),
    ),
    Mutant(
        "mla-rope-applied-twice-at-the-write",
        "MLA write: k_pe arrives rotated (concat_and_cache_mla stores it as given): never rotated again",
        "slotmap/tiny/mla.py",
        "kv.write(layer_idx, kv_c, k_pe, batch.slot_mappings[self.group])",
        "kv.write(layer_idx, kv_c, _apply_rope(k_pe[:, None], cos, sin)[:, 0], batch.slot_mappings[self.group])",
        (TINY_MLA,),
    ),
    Mutant(
        "mla-split-decode-threshold-exclusive",
        "MLA split: a decode is a row of at most reorder_batch_threshold tokens (1 + K: a verify row included)",
        "spec/classify.py",
        "short = query_lens <= threshold",
        "short = query_lens < threshold",
        (MLA_SPLIT, "tests/test_graphs.py"),
    ),
    # ---- padded batches, classification, dummy batches and micro-batches (issue 39) --------------------------
    Mutant(
        "graphs-uniform-decode-by-shape-spec",
        "classify: a decode by progress, not by shape (a 1 + K-token prompt chunk is a prefill)",
        "spec/classify.py",
        "return short if treat_short_extends_as_decodes else short & ~is_prefilling",
        "return short",
        (GRAPHS_UNIT,),
    ),
    Mutant(
        "graphs-uniform-decode-by-shape-fast",
        "classify: a decode by progress, not by shape (a 1 + K-token prompt chunk is a prefill)",
        "fast/classify.py",
        "decode = (not prefilling) and q <= decode_query_len",
        "decode = q <= decode_query_len",
        (SHAPED_STEPS, PADDED_RUNS),
    ),
    Mutant(
        "graphs-stale-pad-region-fast",
        "padding: every slot past the real tokens is PAD_SLOT_ID, never an earlier, larger step's",
        "fast/slots.py",
        "    for pad in range(num_tokens, out.shape[0]):",
        "    for pad in range(out.shape[0], out.shape[0]):",  # the reused buffer's PAD region is not refilled
        (SHAPED_STEPS, PADDED_RUNS),
    ),
    Mutant(
        "graphs-padded-rows-keep-a-stale-index-mapping-fast",
        "padding: a padded request row's index_mapping is -1 (it names no request)",
        "fast/padding.py",
        "        out[n:].fill_(value)\n",
        '        out[n:].fill_(value) if key != "index_mapping" else None\n',
        (SHAPED_STEPS, PADDED_RUNS),
    ),
    Mutant(
        "graphs-padded-block-table-rows-left-from-a-larger-batch-fast",
        "padding: a padded request row's block-table row is all NULL_BLOCK_ID, whatever the reused buffer held",
        "fast/padding.py",
        "        out[n:].fill_(value)\n",
        '        out[n:].fill_(value) if not key.startswith("block_tables") else None\n',
        (SHAPED_STEPS, PADDED_RUNS),
    ),
    Mutant(
        "graphs-flashmla-pads-seq-lens-with-zero",
        "padding profiles: FlashMLA's padded rows have seq_len 1 (its fp8 decode kernel indexes block_table[-1] at 0)",
        "spec/padding_profiles.py",
        'FLASHMLA = PaddingProfile("flashmla", pad_seq_len=1)',
        'FLASHMLA = PaddingProfile("flashmla", pad_seq_len=0)',
        (GRAPHS_UNIT, SHADOW_PADDING),
    ),
    Mutant(
        "graphs-dummy-slots-not-pad-spec",
        "dummy batch: every slot is PAD_SLOT_ID from the start (a dummy step writes no KV)",
        "spec/dummy.py",
        "slot_mappings=tuple(np.full(padded, PAD_SLOT_ID, SLOT_DTYPE) for _ in groups),",
        "slot_mappings=tuple(np.zeros(padded, SLOT_DTYPE) for _ in groups),",
        (GRAPHS_UNIT, SHAPED_STEPS),
    ),
    Mutant(
        "graphs-dummy-slots-not-pad-fast",
        "dummy batch: every slot is PAD_SLOT_ID from the start (a dummy step writes no KV)",
        "fast/dummy.py",
        "torch.full((padded,), PAD_SLOT_ID, dtype=torch.int64, device=device)",
        "torch.zeros(padded, dtype=torch.int64, device=device)",
        (SHAPED_STEPS,),
    ),
    Mutant(
        "graphs-ubatch-straddling-seq-len-not-cut-spec",
        "DBO: the straddling request's seq_len in the first half ends at the half's last token",
        "spec/ubatch.py",
        "    seq_lens[-1] -= max(0, int(batch.query_start_loc[stop]) - tokens.stop)\n",
        "",
        (UBATCH_UNIT,),
    ),
    Mutant(
        "graphs-ubatch-query-start-loc-not-rebased-spec",
        "DBO: a half's query_start_loc is rebased onto its own first token",
        "spec/ubatch.py",
        "batch.query_start_loc[start : stop + 1].astype(np.int64) - tokens.start",
        "batch.query_start_loc[start : stop + 1].astype(np.int64)",
        (UBATCH_UNIT,),
    ),
    Mutant(
        "graphs-ubatch-straddling-seq-len-not-cut-fast",
        "DBO: the straddling request's seq_len in the first half ends at the half's last token",
        "fast/ubatch.py",
        "    seq_lens[-1:] -= (qsl[stop : stop + 1] - tokens.stop).clamp_(min=0).to(seq_lens.dtype)\n",
        "",
        (SHAPED_STEPS,),
    ),
    Mutant(
        "graphs-ubatch-query-start-loc-not-rebased-fast",
        "DBO: a half's query_start_loc is rebased onto its own first token",
        "fast/ubatch.py",
        "torch.sub(qsl[start : stop + 1], tokens.start)",
        "torch.sub(qsl[start : stop + 1], 0)",
        (SHAPED_STEPS,),
    ),
)

# ---- sparse top-k attention (spec/sparse_topk.py, spec/sparse_attention.py, spec/sparse_mla.py and fast's) ----
SPARSE_UNIT = "tests/test_sparse_topk.py"
SPARSE_READER = "tests/test_sparse_attention.py"
SPARSE_MLA = "tests/test_sparse_mla_attention.py"
SPARSE_SUITE_FAST = "conformance/test_sparse.py::test_sparse_selections_agree_on_every_step[fast]"
SPARSE_SUITE_SPEC = "conformance/test_sparse.py::test_sparse_selections_agree_on_every_step[spec]"
SPARSE_ROW_RULE = "sparse slots: entry (t, j) maps through the table of t's own batch row (req_id_per_token)"
SPARSE_PAD_RULE = "sparse readers: -1 lists nothing (never the slot -1, the cache's last)"
SPARSE_DUP_RULE = "sparse rule 6 DuplicateIndexError: one position twice in a row is refused"
SPARSE_CAUSAL_RULE = "sparse rule 3 FutureIndexError: a query at position p reads positions <= p"

SPARSE_MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "sparse-topk-previous-row-table-spec",
        SPARSE_ROW_RULE,
        "spec/sparse_topk.py",
        "    table = batch.block_tables[group]\n    slots = cp_slot_mapping(",
        "    table = np.roll(batch.block_tables[group], 1, axis=0)\n    slots = cp_slot_mapping(",
        (SPARSE_UNIT,),
    ),
    Mutant(
        "sparse-topk-previous-row-table-fast",
        SPARSE_ROW_RULE,
        "fast/sparse_topk.py",
        "slots = fast_cp.cp_slot_mapping(flat, bounds, table, block_size, rank_cp)",
        "slots = fast_cp.cp_slot_mapping(flat, bounds, torch.roll(table, 1, 0), block_size, rank_cp)",
        (SPARSE_UNIT, SPARSE_SUITE_FAST),
    ),
    Mutant(
        "sparse-reader-minus-one-read-as-slot-spec",
        SPARSE_PAD_RULE,
        "spec/sparse_attention.py",
        "        slots = slots[slots >= 0]  # [k] this query's keys",
        "        slots = slots[slots >= -1]  # [k] this query's keys",
        (SPARSE_READER,),
    ),
    Mutant(
        "sparse-reader-minus-one-read-as-slot-fast",
        SPARSE_PAD_RULE,
        "fast/sparse_attention.py",
        "    listed = slots >= 0  # [c, top_k]",
        "    listed = slots >= -1  # [c, top_k]",
        (SPARSE_READER,),
    ),
    Mutant(
        "sparse-mla-reader-minus-one-read-as-slot-spec",
        SPARSE_PAD_RULE,
        "spec/sparse_mla.py",
        "        slots = slots[slots >= 0]  # [k] this query's keys",
        "        slots = slots[slots >= -1]  # [k] this query's keys",
        (SPARSE_MLA,),
    ),
    Mutant(
        "sparse-mla-reader-minus-one-read-as-slot-fast",
        SPARSE_PAD_RULE,
        "fast/sparse_mla.py",
        "    listed = slots >= 0  # [c, top_k]",
        "    listed = slots >= -1  # [c, top_k]",
        (SPARSE_MLA, SPARSE_SUITE_FAST),
    ),
    Mutant(
        "sparse-topk-duplicate-check-dropped-spec",
        SPARSE_DUP_RULE,
        "spec/sparse_topk.py",
        '    refuse(DuplicateIndexError, real & repeated_entries(topk), "= {idx} is listed twice in the row")\n',
        "",
        (SPARSE_UNIT, SPARSE_SUITE_SPEC),
    ),
    Mutant(
        "sparse-topk-duplicate-check-dropped-fast",
        SPARSE_DUP_RULE,
        "fast/sparse_topk.py",
        "        bad[:, 1:] |= real & repeat",
        "        pass",
        (SPARSE_UNIT, SPARSE_SUITE_FAST),
    ),
    Mutant(
        "sparse-topk-causality-off-by-one-spec",
        SPARSE_CAUSAL_RULE,
        "spec/sparse_topk.py",
        "refuse(FutureIndexError, selected & (topk > pos),",
        "refuse(FutureIndexError, selected & (topk > pos + 1),",
        (SPARSE_UNIT, SPARSE_SUITE_SPEC),
    ),
    Mutant(
        "sparse-topk-causality-off-by-one-fast",
        SPARSE_CAUSAL_RULE,
        "fast/sparse_topk.py",
        "| (selected & (topk > pos))",
        "| (selected & (topk > pos + 1))",
        (SPARSE_UNIT, SPARSE_SUITE_FAST),
    ),
)
MUTANTS = (*MUTANTS, *SPARSE_MUTANTS)
