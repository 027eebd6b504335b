"""What a scheduler run did, so tests can check each feature was actually exercised."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SchedulerStats:
    steps: int = 0
    scheduled_tokens: int = 0
    admitted: int = 0  # new requests sent to the pool
    finished: int = 0  # by length or stop token
    stopped_by_token: int = 0
    aborted: int = 0  # by the abort knob
    unfittable: int = 0  # aborted because it could never get its blocks, even alone
    preemptions: int = 0
    resumptions: int = 0
    prefix_hit_tokens: int = 0  # num_computed_tokens > 0 handed to new or resumed requests
    full_prefix_hits: int = 0  # whole known sequence cached: the last token is recomputed in a shared block
    window_releases: int = 0  # blocks released by sliding windows
    null_lookaheads: int = 0  # null placeholders appended by continuing requests (knob null_lookahead)
    window_reuses: int = 0  # released blocks handed back to the request whose table still lists them
    padded_steps: int = 0
    optimistic_counts: int = 0  # async scheduling: request-steps sent counting drafts the sampler had rejected
    drafts_scheduled: int = 0  # draft tokens sent in scheduled_spec_decode_tokens
    drafts_accepted: int = 0
    all_drafts_accepted: int = 0  # drafting request-steps that kept every draft
    no_draft_accepted: int = 0  # and that kept none
    drafts_on_prefill: int = 0  # drafts riding on a chunk that also computes prompt tokens
    drafts_after_unverified: int = 0  # drafts on the device: request-steps drafting before the last verdict is read
    drafts_on_admission: int = 0  # drafting request-steps of a new or resumed request's first step
    drafts_on_retaken_row: int = 0  # of those, new requests in a row that the same output freed
    drafts_to_the_end: int = 0  # drafting request-steps that reached the end and dropped the bonus (drafts_to_the_end)
    drafts_crossing_blocks: int = 0  # drafting request-steps whose drafts start or cross a block of some group
    # async scheduling, the neighbours of rule 7 (spec/async_steps.py; knobs resume_at_once, idle_steps,
    # abort_after_sample):
    resumed_before_verdict: int = 0  # resumed in the step right after drafting, over the tokens held before
    resumed_before_verdict_rejected: int = 0  # of those, with a rejected draft behind them
    resumed_before_verdict_accepted: int = 0  # and with an accepted draft behind them
    idle_steps: int = 0  # outputs that release rows and schedule nothing
    resumed_after_idle_step: int = 0  # sampled before an idle step, resumed right after it over that sample
    continued_after_idle_step: int = 0  # the same, continuing (not preempted)
    retaken_after_abort: int = 0  # new requests on the row of a request aborted right after it sampled
    retaken_after_abort_rejected: int = 0  # of those, where that sample had rejected drafts
    encoder_writes: int = 0  # first steps of encoder-decoder requests: their encoder's KV is written
    encoder_rewrites: int = 0  # of those, resumed after a preemption: the encoder runs again
    block_usage: list[list[int]] = field(default_factory=list)  # per step: blocks in use per group
