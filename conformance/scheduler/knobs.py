"""The scheduler model's knobs: each one moves the outputs into a different corner of the interface."""

from __future__ import annotations

from dataclasses import dataclass

from spec.graphs import CapturedGraphs


@dataclass(frozen=True)
class SchedulerKnobs:
    token_budget: int | None = None  # tokens per step, at most config.max_num_batched_tokens
    max_running: int | None = None  # requests scheduled per step, at most config.max_num_reqs
    max_chunk: int | None = None  # longest prefill chunk of one request per step (chunked prefill)
    enable_prefix_caching: bool = True
    allocation_order: str = "ascending"  # fresh block ids: ascending, descending or random
    reuse_freed_first: bool = False  # hand out freed blocks before fresh ones (stale ids get reused)
    pad_buckets: tuple[int, ...] = ()  # pad each step's token count up to the smallest bucket that fits
    abort_prob: float = 0.0  # chance per step that one live request is aborted (finished without output)
    shuffle_order: bool = False  # shuffle num_scheduled_tokens' order (the batch sort's tie-break)
    spec_tokens: int = 0  # most draft tokens per request per step (speculative decoding; 0: none)
    acceptance_rate: float = 0.6  # chance that the rejection step accepts each draft, in turn
    # drafts on a request's first step (new or resumed), which vLLM never sends (its drafts come from the
    # step before) but spec accepts: a new request may take a row freed in the same output and draft at once
    drafts_on_admission: bool = False
    # a continuing request in a sliding-window group may be sent a null placeholder past its last block, once
    # its table covers every position it can still reach (spec accepts an entry nothing reads or writes)
    null_lookahead: bool = False
    # drafts that may run to the last position of max_model_len and of the output budget (vLLM stops one short,
    # spec accepts the step): the rejection step then keeps at most the tokens that still fit, as an engine
    # must drop a bonus token with no room (synchronous scheduling only: ignored under async)
    drafts_to_the_end: bool = False
    # async scheduling with spec_tokens: the drafter runs on the device after each sample (vLLM's model runner v2);
    # outputs carry placeholders and the driver hands the pool the drafter's ids (spec/async_steps.py, rule 8)
    drafts_on_device: bool = False
    # async scheduling's neighbours of a resumption (spec/async_steps.py, rule 7), each a chance per step; ignored
    # in synchronous runs, whose outputs stay as they were:
    # a request whose drafts' verdict is unread is preempted and resumed in the same output, over the tokens it
    # held before them
    resume_at_once: float = 0.0
    # an output that releases rows (finished or aborted) schedules nothing, and one request that sampled in the
    # step before is preempted, to be resumed right after
    idle_steps: float = 0.0
    # a request that sampled in the last step is aborted before the host reads the sample: its row is free for a
    # new request in the same output
    abort_after_sample: float = 0.0
    # vLLM's form of each output (conformance/scheduler/vllm_form.py); none of these changes what is scheduled
    # new_block_ids_to_zero, as vLLM 0.32 sends it when its cache needs zeroing (a mixed-precision KV cache;
    # a model with a mamba group sends it whatever this knob says)
    zero_new_blocks: bool = False
    common_prefix_blocks: bool = False  # num_common_prefix_blocks: the true counts (0.32 sends it empty)
    model_runner_v2: bool = False  # v2's form: prefill_token_ids; a resumed request is sent again as a new one
    pipeline_parallel: bool = False  # new_token_ids: each cached request's scheduled tokens, as PP ranks get them
    # how a step is prepared beyond its output (conformance/scheduler/step_shapes.py); none changes what is scheduled
    graphs: CapturedGraphs | None = None  # the captured graphs (sizes, mode, 1 + K, profile) a graph step runs
    graph_steps: float = 0.0  # chance a step is prepared with `graphs` (in place of pad_buckets' pad_to)
    dp_peer_steps: float = 0.0  # chance a step has a DP peer with more tokens: padded to it, or a dummy batch if empty
    ubatch_steps: float = 0.0  # chance a step's batch is split in two micro-batches (DBO)
