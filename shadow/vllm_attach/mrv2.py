"""The shadow checker inside vLLM's model runner v2 (MRv2, vllm/v1/worker/gpu/model_runner.py; on CPU
`vllm.v1.worker.cpu.model_runner.CPUModelRunner`, a subclass): every step checked before the forward pass.

    shadow = attach(llm)          # shadow.vllm_attach.attach: picks this class for an MRv2 runner
    llm.generate(...)             # each step is checked before the model runs; a divergence raises

MRv2 builds a step's inputs on the device: `prepare_inputs` returns an `InputBatch` (its batch order,
tokens, positions, offsets, lengths, logits rows), `prepare_attn` returns per KV cache group the block
table and slot mapping that every attention group's `CommonAttentionMetadata` is then built from
unchanged. `VllmShadowV2` wraps three methods of one runner instance and takes host copies of what the
runner itself built:

| runner method | what is taken |
|---|---|
| `execute_model(scheduler_output)` | the step's SchedulerOutput (handed to `spec.interop.from_vllm` by the checker); |
| | a step without tokens is checked here (it only finishes or preempts requests) |
| `prepare_attn(input_batch)` | from the `InputBatch`: `req_ids` (batch order), `input_ids`, `positions`, |
| | `query_start_loc`, `seq_lens`, `num_scheduled_tokens`, `logits_indices`, and with drafts |
| | `num_draft_tokens` (`num_draft_tokens_per_req`), `cu_num_sampled_tokens` (`cu_num_logits[1:]`); |
| | from its result, per group g: `block_table[g]`, `slot_mapping[g]`; the step is checked here |
| `sample_tokens` | the tokens each request kept (its sampler's `num_sampled` of each row: 1..k+1, none |
| | mid-prefill) -> `record_sampled`, read when the engine takes the output (`get_output`) or the next |
| | step starts; with a speculator, the drafts it proposed (`req_states.draft_tokens`, the step's rows) |

Drafts: MRv2 tells the scheduler only how many drafts it proposed (ids -1, unless structured outputs
need them) and reads the ids from its own `req_states.draft_tokens`; the checker is given the scheduler
output with those placeholders replaced by the ids proposed at the request's last step (the scheduler
may schedule fewer: the first k), as v1's scheduler output carries them. MRv2 builds no
`SpecDecodeMetadata`: its draft ids are checked where it puts them, in `input_ids`, and its target and
bonus rows through `logits_indices` and `cu_num_sampled_tokens`.

The row each request holds in MRv2's request state (`idx_mapping`: it hands out the last freed row
first) is its own business, as slotmap's rule is that row numbers are not compared: the checker compares
request by request in MRv2's batch order. Refused (UnsupportedVllmConfigError): speculative decoding
with async scheduling, prefill context parallelism (`pcp_manager` builds the inputs instead of
`prepare_attn`), adaptive draft verification, and a model state that samples more than one token a
step. Nothing here imports vLLM.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np

from shadow.checker import ShadowChecker
from shadow.vllm_attach.common import AttachedShadow, Step, host
from shadow.vllm_attach.config import UnsupportedVllmConfigError

WRAPPED = ("execute_model", "prepare_attn", "sample_tokens")


class VllmShadowV2(AttachedShadow):
    """The attached checker of one MRv2 runner (see the module docstring)."""

    def __init__(self, runner: Any, checker: ShadowChecker | None = None, keep_records: bool = True, **kw: Any) -> None:
        super().__init__(runner, checker, keep_records, **kw)
        self._pending: tuple[Step, Any] | None = None  # the last step's AsyncOutput, its tokens not yet recorded
        self._rows = np.zeros(0, np.int64)  # [num_reqs] the step's request-state rows (idx_mapping), not compared
        self._proposed: dict[str, list[int]] = {}  # req_id -> the drafts proposed for its next step
        self._originals: dict[str, Callable[..., Any]] = {}
        for name in WRAPPED:
            self._originals[name] = getattr(runner, name)
            setattr(runner, name, getattr(self, f"_w_{name}"))
        runner._slotmap_shadow = self

    def _refuse(self, runner: Any) -> None:
        why = None
        if runner.speculative_config is not None and runner.scheduler_config.async_scheduling:
            why = ("async_scheduling with speculative decoding: the scheduler counts drafts it has not seen "
                   "accepted; attach with async_scheduling=False")  # fmt: skip
        elif getattr(runner, "pcp_manager", None) is not None:
            why = "prefill context parallelism: its PCPManager builds the step's inputs, not prepare_attn"
        elif getattr(runner, "adaptive_verification", None) is not None:
            why = "adaptive draft verification: the runner reallocates drafts on the device"
        elif runner.model_state.num_new_sampled_tokens_per_step != 1:
            why = f"a model state that samples {runner.model_state.num_new_sampled_tokens_per_step} tokens a step"
        if why is not None:
            raise UnsupportedVllmConfigError(f"{type(runner).__name__} (model runner v2): {why}")

    def detach(self) -> None:
        """Restore the runner's own methods (recording a pending step's tokens first)."""
        self._flush()
        for name in self._originals:
            self.runner.__dict__.pop(name, None)
        self.runner.__dict__.pop("_slotmap_shadow", None)

    # ---- the wrapped methods ---------------------------------------------------------------------
    def _w_execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("dummy_run") or (len(args) > 1 and args[1]):  # a profile or DP padding run: no step
            return self._originals["execute_model"](scheduler_output, *args, **kwargs)
        self._flush()
        for req_id in (*scheduler_output.finished_req_ids, *(scheduler_output.preempted_req_ids or ())):
            self._proposed.pop(req_id, None)  # its row is freed: a resumption comes back as a new request
        sched = self._with_proposed_drafts(scheduler_output)
        step = self._step = Step(sched, copy.deepcopy(sched) if self.keep_records else None)
        out = self._originals["execute_model"](scheduler_output, *args, **kwargs)
        if not step.checked:
            if scheduler_output.total_num_scheduled_tokens:
                raise RuntimeError(
                    f"slotmap: step {self.checker.step_index} scheduled tokens but model runner v2 never called "
                    "prepare_attn, so it went unchecked (a data-parallel dummy batch?)"
                )
            # no forward pass and no sample_tokens call: the step only finishes or preempts requests
            self._check(step)
            self._record(step, {})
        return out

    def _w_prepare_attn(self, input_batch: Any) -> Any:
        block_tables, slot_mappings = result = self._originals["prepare_attn"](input_batch)
        step = self._step
        if step is None or step.checked:
            return result
        n = input_batch.num_reqs
        step.req_ids = list(input_batch.req_ids[:n])  # [num_reqs] batch_idx -> req_id
        a = step.arrays
        a["input_ids"] = host(input_batch.input_ids)  # [num_tokens_after_padding]
        a["positions"] = host(input_batch.positions)  # [num_tokens_after_padding]
        a["query_start_loc"] = host(input_batch.query_start_loc[: n + 1])  # [num_reqs + 1]
        a["seq_lens"] = host(input_batch.seq_lens[:n])  # [num_reqs]
        a["num_scheduled_tokens"] = np.array(input_batch.num_scheduled_tokens[:n], copy=True)  # [num_reqs]
        a["logits_indices"] = host(input_batch.logits_indices)  # [num_reqs + num_drafts]: k + 1 rows per request
        if input_batch.num_draft_tokens_per_req is not None:  # a step with drafts
            a["num_draft_tokens"] = np.array(input_batch.num_draft_tokens_per_req[:n], copy=True)  # [num_reqs]
            a["cu_num_sampled_tokens"] = np.array(input_batch.cu_num_logits_np[1 : n + 1], copy=True)  # [num_reqs]
        self._rows = np.array(input_batch.idx_mapping_np[:n], copy=True)  # [num_reqs] request-state rows
        for g in range(len(self.config.kv_groups)):
            a[f"block_table[{g}]"] = host(block_tables[g][:n])  # [num_reqs, max_num_blocks of group g]
            a[f"slot_mapping[{g}]"] = host(slot_mappings[g])  # [num_tokens_after_padding], PAD_SLOT_ID past the batch
        self._check(step)
        return result

    def _w_sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        out = self._originals["sample_tokens"](*args, **kwargs)
        step = self._step
        if step is None or not step.checked or out is None:
            return out
        self._pending = (step, out)
        if self.runner.speculator is not None:  # what it proposed for each request's next step, in its row
            drafts = host(self.runner.req_states.draft_tokens)[self._rows]  # [num_reqs, num_speculative_steps]
            self._proposed.update({r: [int(t) for t in drafts[i]] for i, r in enumerate(step.req_ids)})
        own = out.get_output

        def get_output() -> Any:  # the engine takes the step's output: its tokens are on the host now
            result = own()
            if self._pending is not None and self._pending[1] is out:
                self._flush()
            return result

        out.get_output = get_output
        return out

    # ---- the kept tokens -------------------------------------------------------------------------
    def _flush(self) -> None:
        """Record the pending step's kept tokens (at its get_output, or when the next step starts)."""
        if self._pending is None:
            return
        step, out = self._pending
        self._pending = None
        out.copy_event.synchronize()
        rows = out.sampled_token_ids  # [num_reqs, width] host copy; row i keeps its first num_sampled[i]
        counts = out.num_sampled_tokens_np  # [num_reqs]
        req_ids = out.model_runner_output.req_ids
        self._record(step, {r: [int(t) for t in rows[i, : int(counts[i])]] for i, r in enumerate(req_ids)})

    def _with_proposed_drafts(self, sched: Any) -> Any:
        """The scheduler output with the drafts the runner proposed in place of the scheduler's placeholders.

        MRv2 keeps its proposals on the device (`req_states.draft_tokens`) and hands the scheduler only
        their count (ids -1) unless structured outputs need the ids; the scheduler may schedule fewer. So
        request r's k scheduled drafts are the first k of those proposed for it at its last step, as v1's
        scheduler output carries them. Real ids (structured outputs) are kept as scheduled.
        """
        drafts = sched.scheduled_spec_decode_tokens
        if not drafts or not any(t < 0 for ids in drafts.values() for t in ids):
            return sched
        filled = {r: self._proposed[r][: len(ids)] if r in self._proposed and min(ids, default=0) < 0 else ids
                  for r, ids in drafts.items()}  # fmt: skip
        out = copy.copy(sched)  # the runner's own output is left as it is
        out.scheduled_spec_decode_tokens = filled
        return out
