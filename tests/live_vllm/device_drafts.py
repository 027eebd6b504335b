"""What model runner v2 (MRv2) did in each step of a run whose drafts its speculator proposes on the device
(EAGLE, a draft model): the extraction only; test_device_drafts.py compares.

    recorder = DraftRecorder(runner)   # an MRv2 runner with a speculator, after the engine is built
    llm.generate(...)
    recorder.steps                     # one DraftStep per step that ran the model, in the runner's order

MRv2 keeps a step's draft ids on the device: its speculator's `propose` returns them after sampling (one row
per batch row, `num_speculative_steps` wide), the runner stores them in its request state
(`req_states.draft_tokens[row]`) and tells the scheduler only how many (ids -1). At the request's next step
`combine_sampled_and_draft_tokens` copies them from that store into `input_ids`. With async scheduling the
scheduler sends step N + 1 before it has seen step N's kept tokens, so its counts (`num_computed_tokens`)
are optimistic; MRv2 corrects them on the device (`num_computed_tokens.gpu`, advanced by query length
minus rejected drafts) and keeps the scheduler's values only as upper bounds (`num_computed_tokens_np`,
`seq_lens_cpu_upper_bound`).

The recorder wraps four methods of one runner instance (the runner, and its speculator's `propose`) and
takes host copies, as the shadow checker's MRv2 attach does (shadow/vllm_attach/mrv2.py), but checks
nothing and is not refused under async scheduling. A `DraftStep` holds the scheduler output as the runner
received it (placeholders kept), the arrays under the shadow checker's field names, and per request the
tokens kept and the drafts proposed for its next step: what `ShadowChecker.check` and `record_sampled`
take (the proposals as `next_draft_ids` where spec models device-proposed drafts). On CPU every tensor op
has finished when the call returns, so each copy is taken where the runner made the value.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shadow.vllm_attach.common import host


@dataclass
class DraftStep:
    """One step of an MRv2 runner that drafts on the device, as it ran."""

    sched: Any  # vLLM's SchedulerOutput, deep-copied as execute_model received it (draft ids -1 kept)
    req_ids: list[str] = field(default_factory=list)  # [num_reqs] batch_idx -> req_id (the runner's order)
    # the shadow checker's field names -> host copies of what prepare_inputs/prepare_attn built, plus
    # "num_computed_upper_bound" [num_reqs] (the scheduler's optimistic counts, num_computed_tokens_np) and
    # "seq_lens_upper_bound" [num_reqs] (seq_lens_cpu_upper_bound)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    rows: list[int] = field(default_factory=list)  # [num_reqs] batch_idx -> request-state row (idx_mapping)
    kept: dict[str, list[int]] = field(default_factory=dict)  # req_id -> tokens kept (none mid-prefill)
    # req_id -> the ids `propose` returned for its next step (the drafter's output) ...
    proposed: dict[str, list[int]] = field(default_factory=dict)
    stored: dict[str, list[int]] = field(default_factory=dict)  # ... and what its draft_tokens row then held


class DraftRecorder:
    """Records every step of one MRv2 runner with a speculator (see the module docstring)."""

    def __init__(self, runner: Any) -> None:
        if runner.speculator is None:
            raise ValueError(f"{type(runner).__name__} has no speculator: nothing is drafted on the device")
        self.runner = runner
        self.steps: list[DraftStep] = []
        self._step: DraftStep | None = None
        self._originals: dict[str, Callable[..., Any]] = {
            "execute_model": runner.execute_model,
            "prepare_attn": runner.prepare_attn,
            "sample_tokens": runner.sample_tokens,
        }
        runner.execute_model, runner.prepare_attn = self._execute_model, self._prepare_attn
        runner.sample_tokens = self._sample_tokens
        self._propose = runner.speculator.propose
        runner.speculator.propose = self._proposing

    def detach(self) -> None:
        for name in self._originals:
            self.runner.__dict__.pop(name, None)
        self.runner.speculator.__dict__.pop("propose", None)

    def _execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        dummy = kwargs.get("dummy_run") or (len(args) > 1 and args[1])
        if not dummy and scheduler_output.total_num_scheduled_tokens:
            self._step = DraftStep(copy.deepcopy(scheduler_output))
        return self._originals["execute_model"](scheduler_output, *args, **kwargs)

    def _prepare_attn(self, input_batch: Any) -> Any:
        block_tables, slot_mappings = result = self._originals["prepare_attn"](input_batch)
        step = self._step
        if step is None or step.req_ids:
            return result
        n = input_batch.num_reqs
        step.req_ids = list(input_batch.req_ids[:n])
        step.rows = [int(r) for r in input_batch.idx_mapping_np[:n]]
        a = step.arrays
        a["input_ids"] = host(input_batch.input_ids)  # [num_tokens_after_padding]
        a["positions"] = host(input_batch.positions)  # [num_tokens_after_padding]
        a["query_start_loc"] = host(input_batch.query_start_loc[: n + 1])  # [num_reqs + 1]
        a["seq_lens"] = host(input_batch.seq_lens[:n])  # [num_reqs]
        a["num_scheduled_tokens"] = np.array(input_batch.num_scheduled_tokens[:n], copy=True)  # [num_reqs]
        a["logits_indices"] = host(input_batch.logits_indices)  # [num_reqs + num_drafts]
        a["num_computed_upper_bound"] = np.array(input_batch.num_computed_tokens_np[:n], copy=True)  # [num_reqs]
        a["seq_lens_upper_bound"] = host(input_batch.seq_lens_cpu_upper_bound[:n])  # [num_reqs]
        if input_batch.num_draft_tokens_per_req is not None:
            a["num_draft_tokens"] = np.array(input_batch.num_draft_tokens_per_req[:n], copy=True)  # [num_reqs]
            a["cu_num_sampled_tokens"] = np.array(input_batch.cu_num_logits_np[1 : n + 1], copy=True)  # [num_reqs]
        for g in range(len(block_tables)):
            a[f"block_table[{g}]"] = host(block_tables[g][:n])  # [num_reqs, max_num_blocks]
            a[f"slot_mapping[{g}]"] = host(slot_mappings[g])  # [num_tokens_after_padding]
        return result

    def _proposing(self, input_batch: Any, *args: Any, **kwargs: Any) -> Any:
        drafts = self._propose(input_batch, *args, **kwargs)  # [num_reqs (padded), num_speculative_steps]
        step = self._step
        if step is not None and step.req_ids and not kwargs.get("dummy_run"):
            ids = host(drafts)
            step.proposed = {r: [int(t) for t in ids[b]] for b, r in enumerate(step.req_ids)}
        return drafts

    def _sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        out = self._originals["sample_tokens"](*args, **kwargs)
        step, self._step = self._step, None
        if step is None or not step.req_ids or out is None:
            return out
        out.copy_event.synchronize()
        rows, counts = out.sampled_token_ids, out.num_sampled_tokens_np  # [num_reqs, width], [num_reqs]
        step.kept = {r: [int(t) for t in rows[b, : int(counts[b])]] for b, r in enumerate(step.req_ids)}
        store = host(self.runner.req_states.draft_tokens)  # [max_num_reqs, num_speculative_steps]
        step.stored = {r: [int(t) for t in store[row]] for r, row in zip(step.req_ids, step.rows, strict=True)}
        self.steps.append(step)
        return out
