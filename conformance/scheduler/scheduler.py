"""A reference scheduler model: continuous batching over a block allocator, emitting valid SchedulerOutputs.

Per step (`schedule`):
 1. rows of requests finished since the last step are released (`finished_req_ids`); arrivals join
    the waiting queue; the abort knob may abort one live request.
 2. running requests, in admission order, get `min(remaining, budget, max_chunk)` tokens: a decode
    (1 token) or the next prefill chunk. Sliding-window groups first release blocks that fell out of
    the window. When blocks run out, the newest running request is preempted (recompute: its blocks
    are freed, it keeps its row, and later resumes with `resumed=True` and a fresh table).
 3. waiting requests (preempted ones first) are admitted while budget, rows and blocks last, reusing
    cached prefix blocks (chained block hashes; a hit is cut to a multiple of every group's block size,
    except that a fully cached sequence recomputes just its last token inside the shared block).

Speculative decoding (knob `spec_tokens`): a running request whose chunk reaches its last known token
may carry drafts (conformance.scheduler.drafter), trimmed, as vLLM trims them, to what the budget, the
chunk limit and the blocks allow; blocks are allocated for the draft positions too. After the step the
rejection step (`rejection_step`) says which drafts the target kept; `update` appends the kept tokens and
rolls num_computed back past the rejected drafts, whose blocks the request keeps.

Blocks a window released go back to the allocator at once, and (with `reuse_freed_first`, as vLLM's
free queue does) are handed out again first, to the same request too: the pool never learns of a
release (the id stays in the row's table below the window), so the row's table then lists the id
twice, once released and once live, which spec accepts (docs/semantics.md, "Block ids"). One
constraint of the pool shapes the model beyond vLLM's: no two tokens of one step may write one slot,
so two full-cache hits that would recompute into the same shared slot are not admitted in the same step.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

from conformance.scheduler.allocator import BlockAllocator
from conformance.scheduler.drafter import Drafter, Proposer
from conformance.scheduler.knobs import SchedulerKnobs
from conformance.scheduler.mamba import caches_states, chunk_limit, speculative_blocks
from conformance.scheduler.request import SchedRequest, Status
from conformance.scheduler.stats import SchedulerStats
from conformance.scheduler.step_shapes import StepShape, StepShaper
from conformance.scheduler.workload import Workload
from spec.cross_attention import cross_group
from spec.types import (
    NULL_BLOCK_ID,
    PLACEHOLDER_TOKEN_ID,
    CachedRequest,
    NewRequest,
    RowSnapshot,
    SchedulerOutput,
    WorkerConfig,
)


class ReferenceScheduler:
    def __init__(
        self,
        config: WorkerConfig,
        workload: Workload,
        knobs: SchedulerKnobs | None = None,
        seed: int = 0,
        proposer: Proposer | None = None,  # drafts from elsewhere (e.g. n-gram lookup); default: random ones
    ) -> None:
        self.config = config
        self.knobs = knobs = knobs or SchedulerKnobs()
        self.rng = random.Random(seed)
        self.groups = config.kv_groups
        self.cross = cross_group(config)  # the encoder's KV (spec/cross_attention.py), or None
        if config.one_block_pool:  # vLLM's form: every group allocates from one BlockPool (the same object)
            shared = BlockAllocator(self.groups[0].num_blocks, knobs.allocation_order, knobs.reuse_freed_first, seed)
            self.allocators = [shared] * len(self.groups)
        else:
            self.allocators = [
                BlockAllocator(g.num_blocks, knobs.allocation_order, knobs.reuse_freed_first, seed=seed * 31 + i)
                for i, g in enumerate(self.groups)
            ]
        ids = [r.req_id for r in workload.requests]
        if len(set(ids)) != len(ids):
            raise ValueError("workload req_ids must be unique")
        # under async scheduling the next step goes out before the cut is known: the knob applies to synchronous only
        self.to_the_end = knobs.drafts_to_the_end and not config.async_scheduling
        # drafts proposed on the device (spec/async_steps.py, rule 8): async scheduling only, as in vLLM
        self.on_device = knobs.drafts_on_device and config.async_scheduling and knobs.spec_tokens > 0
        self._drafts_sent: dict[str, tuple[int, ...]] = {}  # the output being executed: each request's draft ids
        self._proposals: dict[str, tuple[int, ...]] | None = None  # the drafter's output for that output's samples
        self.requests = {r.req_id: SchedRequest(r, len(self.groups)) for r in workload.requests}
        self._arrivals = sorted(self.requests.values(), key=lambda r: r.spec.arrival_step)  # stable
        self.waiting: list[SchedRequest] = []  # preempted requests first, then arrivals in order
        self.running: list[SchedRequest] = []  # admission order: the tail is preempted first
        self.rows: list[str | None] = [None] * config.max_num_reqs  # the pool's rows, as the pool will hold them
        self.pool_num_computed: dict[str, int] = {}  # the num_computed_tokens last sent for each row holder
        self._to_release: list[str] = []  # finished since the last output: their rows go in the next one
        self._last: SchedulerOutput | None = None
        self._sampling: tuple[str, ...] = ()
        self._last_scheduled: frozenset[str] = frozenset()
        self._sampled_last: frozenset[str] = frozenset()  # the requests the last output sampled for
        self._after_idle: frozenset[str] | None = None  # after an idle step: the requests that sampled before it
        # what the last output did beyond what SchedulerOutput says (vLLM's form says it: vllm_form.py)
        self.preempted_req_ids: frozenset[str] = frozenset()  # preempted by the last schedule()
        self.fresh_blocks: tuple[tuple[int, ...], ...] = ()  # per group: blocks it allocated, prefix hits not included
        self.previously_scheduled: frozenset[str] = frozenset()  # the requests the output before it scheduled
        self.finished_unheld: frozenset[str] = frozenset()  # aborted by it without ever holding a row
        self.step_index = 0
        self.stats = SchedulerStats()
        self.token_budget = min(knobs.token_budget or config.max_num_batched_tokens, config.max_num_batched_tokens)
        self.max_running = min(knobs.max_running or config.max_num_reqs, config.max_num_reqs)
        self.max_chunk = knobs.max_chunk or config.max_model_len
        self.drafter = Drafter(knobs.spec_tokens, knobs.acceptance_rate, config.vocab_size, seed * 17 + 5)
        self.proposer: Proposer = proposer or self.drafter
        self.shaper = StepShaper(knobs, seed)  # graphs, DP peers and DBO per step: their own random source

    # ---- public API -------------------------------------------------------------------------
    def done(self) -> bool:
        return not (self._arrivals or self.waiting or self.running or self._to_release or self._last)

    def schedule(self) -> SchedulerOutput:
        if self._last is not None:
            raise RuntimeError("update() the previous output before scheduling the next one")
        finished = self._to_release
        self._to_release = []
        self._arrive()
        unheld: list[str] = []  # aborted before they held a row: vLLM lists them as finished all the same
        if self.knobs.abort_prob and self.rng.random() < self.knobs.abort_prob:
            self._abort_one(finished, unheld)
        aborted = self._abort_after_sample(finished)
        step = _Step(self.token_budget, [set() for _ in self.groups], [[] for _ in self.groups])
        idle = self._idle_step(step, finished)
        if not idle:
            self._schedule_running(step, finished)
            self._schedule_waiting(step, finished)
        self._count_after_idle(step)
        self._after_idle = self._sampled_last if idle else None

        freed_now = {self.rows.index(r) for r in finished}  # rows this output frees
        for req_id in finished:
            self.rows[self.rows.index(req_id)] = None
            self.pool_num_computed.pop(req_id, None)
        for new in step.new:  # lowest free row, in the order given
            row = self.rows.index(None)
            self.rows[row] = new.req_id
            self.stats.drafts_on_retaken_row += new.req_id in step.drafting_new and row in freed_now
            if row in aborted:  # the aborted owner's sample (and its drafts' verdict) is not read yet
                self.stats.retaken_after_abort += 1
                self.stats.retaken_after_abort_rejected += aborted[row].phantom > 0
        for req_id, _ in step.scheduled:
            self.pool_num_computed[req_id] = self.requests[req_id].num_computed
        scheduled = list(step.scheduled)
        if self.knobs.shuffle_order:
            self.rng.shuffle(scheduled)
        out = SchedulerOutput(
            new_requests=tuple(step.new),
            cached_requests=tuple(step.cached),
            num_scheduled_tokens=dict(scheduled),
            finished_req_ids=frozenset(finished),
            scheduled_spec_decode_tokens={r: (PLACEHOLDER_TOKEN_ID,) * len(d) for r, d in step.drafts.items()}
            if self.on_device
            else dict(step.drafts),
        )
        self._drafts_sent, self._proposals = dict(step.drafts), None
        self._sampling = tuple(
            r
            for r, n in step.scheduled
            if self.requests[r].num_computed + n
            == self.requests[r].num_tokens + self.requests[r].phantom + len(step.drafts.get(r, ()))
        )
        self._end_run_ahead(step)
        self.preempted_req_ids = frozenset(step.preempted)
        self.fresh_blocks = tuple(tuple(b) for b in step.fresh)
        self.previously_scheduled = frozenset(self._last_scheduled)
        self._last_scheduled = frozenset(out.num_scheduled_tokens)
        self.finished_unheld = frozenset(unheld)
        self._last = out
        self.step_index += 1
        self.stats.steps += 1
        self.stats.scheduled_tokens += out.total_num_scheduled_tokens
        self.stats.block_usage.append(self._blocks_in_use())
        return out

    def pad_to(self, out: SchedulerOutput) -> int | None:
        """The smallest padding bucket holding the step's tokens, or None (no padding)."""
        total = out.total_num_scheduled_tokens
        fitting = [b for b in self.knobs.pad_buckets if b >= total]
        if not fitting:
            return None
        self.stats.padded_steps += 1
        return min(fitting)

    def step_shape(self, out: SchedulerOutput) -> StepShape:
        """How the step is prepared (conformance/scheduler/step_shapes.py): pad_to, graphs, a dummy batch, a split."""
        return self.shaper.shape(out, self.pad_to(out))

    @property
    def last_output(self) -> SchedulerOutput | None:
        """The output being executed: the last schedule()'s, until update() receives it."""
        return self._last

    def sampling_req_ids(self, out: SchedulerOutput) -> tuple[str, ...]:
        """Requests of `out` whose step reaches their last known token: exactly those that get a sampled token."""
        if out is not self._last:
            raise RuntimeError("not the output being executed")
        return self._sampling

    def rejection_step(self, out: SchedulerOutput, target: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
        """Per sampling request of `out`, the tokens a rejection sampler keeps, given the target's token there."""
        if out is not self._last:
            raise RuntimeError("not the output being executed")
        kept = {}
        for req_id in self._sampling:
            drafts = self._drafts_sent.get(req_id, ())
            kept[req_id] = self.drafter.accept(drafts, int(target[req_id])) if drafts else (int(target[req_id]),)
            room = self._room(self.requests[req_id])
            if self.to_the_end and len(kept[req_id]) > room:  # the bonus token has no room: dropped
                kept[req_id] = kept[req_id][:room]
                self.stats.drafts_to_the_end += 1
        return kept

    def update(self, out: SchedulerOutput, sampled: Mapping[str, int | Sequence[int]]) -> None:
        """The step ran: advance progress (back past rejected drafts), append kept tokens, cache blocks, finish.

        `sampled[req_id]` is the sampled token, or with drafts the tokens the rejection step kept.
        """
        if out is not self._last:
            raise RuntimeError("update() must receive the output of the last schedule()")
        if set(sampled) != set(self._sampling):
            raise ValueError(f"sampled tokens for {sorted(sampled)}, expected {sorted(self._sampling)}")
        kept = {r: (int(t),) if isinstance(t, int) else tuple(int(x) for x in t) for r, t in sampled.items()}
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.requests[req_id]
            req.num_computed += n
            if req_id in kept:
                self._keep(req, self._drafts_sent.get(req_id, ()), kept[req_id])
            if self.on_device:  # what the pool's record keeps: a taking row's proposals, none for the others
                req.proposed = list((self._proposals or {}).get(req_id, ()))
            self._register_full_blocks(req)
        for req_id in self._sampling:
            req = self.requests[req_id]
            if any(t in req.spec.stop_token_ids for t in kept[req_id]):
                self.stats.stopped_by_token += 1
                self._finish(req)
            elif req.num_output >= req.spec.max_new_tokens or req.num_tokens >= self.config.max_model_len:
                self._finish(req)
        self._last = None
        self._sampled_last = frozenset(self._sampling)
        self._sampling = ()

    def _keep(self, req: SchedRequest, drafts: tuple[int, ...], tokens: tuple[int, ...]) -> None:
        """Append the kept tokens and roll num_computed back past the drafts that were rejected."""
        if not 1 <= len(tokens) <= len(drafts) + 1 or tokens[:-1] != drafts[: len(tokens) - 1]:
            raise ValueError(f"{req.req_id}: kept {tokens} is not accepted drafts of {drafts} plus one token")
        accepted = len(tokens) - 1
        if self.config.async_scheduling:  # the next step is sent as if every draft was accepted (spec/async_steps.py)
            req.phantom, req.unverified = len(drafts) - accepted, len(drafts)
        else:
            req.num_computed -= len(drafts) - accepted  # their KV is stale: the next step writes them again
        req.tokens.extend(tokens)
        req.num_output += len(tokens)
        if drafts:
            self.stats.drafts_accepted += accepted
            self.stats.all_drafts_accepted += accepted == len(drafts)
            self.stats.no_draft_accepted += accepted == 0

    def expected_snapshot(self) -> tuple[RowSnapshot, ...]:
        """The pool's snapshot after the last output was applied and its samples recorded (derived here)."""
        return tuple(
            RowSnapshot(
                row=row,
                req_id=req_id,
                token_ids=tuple(self.requests[req_id].tokens),
                num_computed_tokens=self.pool_num_computed[req_id],
                block_ids=tuple(tuple(t) for t in self.requests[req_id].pool_tables),
            )
            for row, req_id in enumerate(self.rows)
            if req_id is not None
        )

    # ---- one step ---------------------------------------------------------------------------
    def _arrive(self) -> None:
        while self._arrivals and self._arrivals[0].spec.arrival_step <= self.step_index:
            self.waiting.append(self._arrivals.pop(0))

    def _schedule_running(self, step: _Step, finished: list[str]) -> None:
        i = 0
        while i < len(self.running) and step.budget > 0 and len(step.scheduled) < self.max_running:
            req = self.running[i]
            if self._resume_at_once(req, step):
                continue  # req left the running list for the waiting one, first in line; index i is the next one
            self._release_out_of_window(req)
            if self.on_device:
                drafts = self._device_drafts(req)
            else:
                drafts = [] if req.unverified else self.proposer.propose(req.tokens, self._draft_room(req))
            want = min(req.num_tokens + req.phantom + len(drafts) - req.num_computed, step.budget, self.max_chunk)
            want = chunk_limit(self.groups, req.num_computed, want, self.knobs)  # mamba states at block ends
            n = self._make_room(req, want, step, finished)
            if n == 0:
                continue  # req left the running list (preempted or aborted); index i is the next one
            new_ids = self._null_lookahead(req, self._grow(req, n, step))
            step.add(req.req_id, n)
            known = req.num_tokens + req.phantom  # as the pool counts them until the verdict is read
            self._schedule_drafts(req, drafts[: max(0, req.num_computed + n - known)], step)
            step.cached.append(
                CachedRequest(req.req_id, req.num_computed, new_ids if any(new_ids) else None, resumed=False)
            )
            i += 1

    def _end_run_ahead(self, step: _Step) -> None:
        """Async scheduling: the output went out with the optimistic counts; from here on the scheduler counts what
        the pool holds after its correction (num_computed less the rejected drafts). A request resumed in it was
        sent a fresh count, which the pool does not correct (spec/async_steps.py, rule 2)."""
        resumed = {c.req_id for c in step.cached if c.resumed}
        for req in self.requests.values():
            if req.req_id in resumed:
                req.phantom, req.unverified = 0, 0
                continue
            if req.phantom and req.req_id in self.pool_num_computed and req.req_id in dict(step.scheduled):
                self.pool_num_computed[req.req_id] -= req.phantom
                self.stats.optimistic_counts += 1
            if req.phantom and req.status is Status.RUNNING:
                req.num_computed -= req.phantom
            req.phantom, req.unverified = 0, 0

    def drafts_sent(self, req_id: str) -> tuple[int, ...]:
        """The draft ids of `req_id` in the output being executed (the drafter's, where the output carries
        placeholders), () for none."""
        return self._drafts_sent.get(req_id, ())

    def device_proposals(self, out: SchedulerOutput) -> dict[str, tuple[int, ...]]:
        """The drafter's output after `out`'s samples (drafts on the device): req_id -> spec_tokens ids for each
        sampling request, drawn once per output; {} without drafts on the device."""
        if out is not self._last:
            raise RuntimeError("not the output being executed")
        if not self.on_device:
            return {}
        if self._proposals is None:
            rng, vocab = self.drafter.rng, self.config.vocab_size
            self._proposals = {r: tuple(rng.randrange(vocab) for _ in range(self.knobs.spec_tokens))
                               for r in self._sampling}  # fmt: skip
        return self._proposals

    def _device_drafts(self, req: SchedRequest) -> list[int]:
        """Some of the drafter's ids for req (its last sample's), as many as its room allows, whatever the verdict
        on its last drafts: the pool places them at the corrected count (spec/async_steps.py, rule 8). The pool
        validates on the optimistic count, so the step must also fit max_model_len counted with the phantoms."""
        room = min(self._draft_room(req), self.config.max_model_len - req.num_tokens - req.phantom)
        k = self.drafter.rng.randint(0, max(0, min(len(req.proposed), room)))
        self.stats.drafts_after_unverified += bool(k and req.unverified)
        return req.proposed[:k]

    def _draft_room(self, req: SchedRequest) -> int:
        """Most drafts req may carry: each kept one is an output token, and one more token always follows
        (knob drafts_to_the_end: the step may reach the end, and rejection_step keeps what fits)."""
        room = self._room(req)
        return room if self.to_the_end else room - 1

    def _room(self, req: SchedRequest) -> int:
        """Tokens req may still keep: to max_model_len and to its output budget."""
        return min(self.config.max_model_len - req.num_tokens, req.spec.max_new_tokens - req.num_output)

    def _schedule_drafts(self, req: SchedRequest, drafts: list[int], step: _Step) -> None:
        """The drafts left after trimming: the step's last len(drafts) tokens."""
        if not drafts:
            return
        step.drafts[req.req_id] = tuple(drafts)
        self.stats.drafts_scheduled += len(drafts)
        self.stats.drafts_on_prefill += req.num_tokens - req.num_computed > 1
        first, last = req.num_tokens - 1, req.num_tokens + len(drafts) - 1  # verifying token .. last draft
        self.stats.drafts_crossing_blocks += any(first // g.block_size != last // g.block_size for g in self.groups)

    def _make_room(self, req: SchedRequest, want: int, step: _Step, finished: list[str]) -> int:
        """Tokens `req` can run now, preempting newer running requests for blocks; 0 if req itself left."""
        while True:
            fit = self._fit(req, req.num_computed, [len(t) for t in req.blocks], want)
            if fit == want:
                return want
            if self.running[-1] is not req:
                self._preempt(self.running[-1], step)
                continue
            if fit > 0:
                return fit  # the newest request: runs a shorter chunk rather than preempting itself
            if len(self.running) > 1:
                self._preempt(req, step)
            else:  # alone and still no block: it can never run in this configuration
                self.stats.unfittable += 1
                if self._drop(req):
                    finished.append(req.req_id)
            return 0

    def _schedule_waiting(self, step: _Step, finished: list[str]) -> None:
        rows_held = sum(r is not None for r in self.rows) - len(finished)
        for req in list(self.waiting):
            if step.budget == 0 or len(step.scheduled) >= self.max_running:
                return
            if req.req_id in step.preempted and req.req_id not in step.resume_at_once:
                continue  # preempted in this very step: not back before the next one
            if req.status is Status.WAITING and rows_held >= self.config.max_num_reqs:
                continue
            plan = self._admission_plan(req, step)
            if plan is None:
                return  # first come, first served: wait for blocks to free up
            if plan.collides:
                continue  # its recomputed slot is written by another hit this step: next step
            self._admit(req, plan, step)
            rows_held += plan.is_new

    def _admission_plan(self, req: SchedRequest, step: _Step) -> _Admission | None:
        known = self._held_before_verdict(req) if req.req_id in step.resume_at_once else req.num_tokens
        computed, hits = self._prefix_hit(req, known)
        tables: list[list[int]] = []
        for g, group in enumerate(self.groups):
            first_needed = max(0, computed - group.sliding_window + 1) if group.sliding_window else 0
            tables.append([NULL_BLOCK_ID if j < first_needed // group.block_size else b for j, b in enumerate(hits[g])])
        drafts = [] if known < req.num_tokens else self._admission_drafts(req, tables)
        want = min(known + len(drafts) - computed, step.budget, self.max_chunk)
        want = chunk_limit(self.groups, computed, want, self.knobs)  # mamba states at block ends
        revived = [
            sum(1 for b in t if b != NULL_BLOCK_ID and self.allocators[g].is_free(b)) for g, t in enumerate(tables)
        ]
        n = self._fit(req, computed, [len(t) for t in tables], want, reserved=revived)
        if n <= 0:
            return None
        writes: list[list[int]] = []
        for g, group in enumerate(self.groups):  # only a recomputed last token can land in a shared block
            bs, table = group.block_size, tables[g]
            slots = [table[p // bs] * bs + p % bs for p in range(computed, min(computed + n, len(table) * bs))]
            writes.append(slots)
        collides = any(step.written[g].intersection(w) for g, w in enumerate(writes))
        return _Admission(computed, n, tables, writes, req.status is Status.WAITING, collides, drafts)

    def _admission_drafts(self, req: SchedRequest, tables: list[list[int]]) -> list[int]:
        """Drafts for a first step (knob drafts_on_admission), only where they land in blocks of its own."""
        if not self.knobs.drafts_on_admission or self.on_device:  # the device has no proposal for it yet
            return []
        in_shared = any(req.num_tokens < len(t) * g.block_size for t, g in zip(tables, self.groups, strict=True))
        return [] if in_shared else self.proposer.propose(req.tokens, self._draft_room(req))

    def _admit(self, req: SchedRequest, plan: _Admission, step: _Step) -> None:
        for g, table in enumerate(plan.tables):
            for b in table:
                if b != NULL_BLOCK_ID:
                    self.allocators[g].touch(b)
            step.written[g].update(plan.writes[g])
        req.blocks = [list(t) for t in plan.tables]
        req.pool_tables = [list(t) for t in plan.tables]  # a new or resumed request replaces its row's table
        req.num_computed = plan.computed
        req.num_hashed = [0] * len(self.groups)
        self._grow(req, plan.num_tokens, step)
        tables = tuple(tuple(t) for t in req.blocks)
        self.waiting.remove(req)
        self.running.append(req)
        self.stats.prefix_hit_tokens += plan.computed
        self.stats.full_prefix_hits += any(plan.writes)
        if plan.is_new:
            mrope = (req.spec.mrope_positions, req.spec.mrope_position_delta)  # a multimodal request's (or None, 0)
            step.new.append(
                NewRequest(
                    req.req_id, tuple(req.tokens), tables, plan.computed, *mrope, encoder_len=req.spec.encoder_len
                )
            )
            self.stats.admitted += 1
        else:
            step.cached.append(CachedRequest(req.req_id, plan.computed, tables, resumed=True))
            self.stats.resumptions += 1
            if req.req_id in step.resume_at_once:
                self.stats.resumed_before_verdict += 1
                self.stats.resumed_before_verdict_rejected += req.phantom > 0
                self.stats.resumed_before_verdict_accepted += req.unverified > req.phantom
        if req.spec.encoder_len:  # its first step (again, after a preemption) writes the encoder's KV
            self.stats.encoder_writes += 1
            self.stats.encoder_rewrites += not plan.is_new
        req.status = Status.RUNNING
        step.add(req.req_id, plan.num_tokens)
        kept = plan.drafts[: max(0, plan.computed + plan.num_tokens - req.num_tokens)]
        self._schedule_drafts(req, kept, step)
        if kept:
            self.stats.drafts_on_admission += 1
            if plan.is_new:
                step.drafting_new.add(req.req_id)

    # ---- blocks -----------------------------------------------------------------------------
    def _fit(
        self,
        req: SchedRequest,
        start: int,
        table_lens: list[int],
        want: int,
        reserved: list[int] | None = None,
    ) -> int:
        """Most tokens <= want, from position `start`, whose missing blocks every group can allocate now."""
        if self.config.one_block_pool:
            return self._fit_one_pool(req, start, table_lens, want, sum(reserved) if reserved else 0)
        fit = want
        for g, group in enumerate(self.groups):
            free = self.allocators[g].num_free - (reserved[g] if reserved else 0)
            if g == self.cross:  # the encoder's blocks, all or nothing, whatever the decoder runs
                fit = fit if _cross_need(req, table_lens[g], group.block_size) <= free else 0
                continue
            held = table_lens[g] + max(free, 0) - speculative_blocks(group)  # a mamba group's drafts' states
            fit = min(fit, held * group.block_size - start)
        return max(fit, 0)

    def _fit_one_pool(self, req: SchedRequest, start: int, table_lens: list[int], want: int, reserved: int) -> int:
        """_fit with one block pool: the most tokens whose missing blocks, every group's together, are free."""
        free = self.allocators[0].num_free - reserved
        lo, hi = 0, want
        while lo < hi:  # the groups' need grows with the tokens run: the largest count that fits
            mid = (lo + hi + 1) // 2
            if sum(self._need(req, g, start + mid, table_lens[g]) for g in range(len(self.groups))) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _need(self, req: SchedRequest, g: int, end: int, held: int) -> int:
        """Blocks group g must still allocate for positions up to `end` (exclusive), holding `held` entries."""
        group = self.groups[g]
        if g == self.cross:
            return _cross_need(req, held, group.block_size)
        return max(math.ceil(end / group.block_size) + speculative_blocks(group) - held, 0)

    def _blocks_in_use(self) -> list[int]:
        """Per group, the blocks its requests hold (with one pool, counted by the group that holds them)."""
        if not self.config.one_block_pool:
            return [a.num_used for a in self.allocators]
        return [len({b for r in self.running for b in r.blocks[g]} - {NULL_BLOCK_ID}) for g in range(len(self.groups))]

    def _grow(self, req: SchedRequest, n: int, step: _Step) -> tuple[tuple[int, ...], ...]:
        """Allocate the blocks positions [num_computed, num_computed + n) still lack, per group."""
        added = []
        for g in range(len(self.groups)):
            new = self.allocators[g].allocate(self._need(req, g, req.num_computed + n, len(req.blocks[g])))
            step.fresh[g] += new
            self.stats.window_reuses += len(set(new).intersection(req.pool_tables[g]))  # handed back to its owner
            req.blocks[g] += new
            req.pool_tables[g] += new
            added.append(tuple(new))
        return tuple(added)

    def _null_lookahead(self, req: SchedRequest, added: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
        """Knob null_lookahead: a null entry after the last block of a windowed group whose table already covers
        every position the request can still write (its final length is bounded by max_new_tokens)."""
        if not self.knobs.null_lookahead:
            return added
        final_len = min(len(req.spec.prompt_token_ids) + req.spec.max_new_tokens, self.config.max_model_len)
        out = list(added)
        for g, group in enumerate(self.groups):
            table = req.pool_tables[g]
            covered = (final_len - 1) // group.block_size < len(table)
            room = len(table) < self.config.max_blocks_per_req(g)
            if group.sliding_window and covered and room and table[-1:] != [NULL_BLOCK_ID] and self.rng.random() < 0.5:
                req.blocks[g].append(NULL_BLOCK_ID)
                table.append(NULL_BLOCK_ID)
                out[g] = (*out[g], NULL_BLOCK_ID)
                self.stats.null_lookaheads += 1
        return tuple(out)

    def _release_out_of_window(self, req: SchedRequest) -> None:
        for g, group in enumerate(self.groups):
            if group.sliding_window is None:
                continue
            # the oldest key a new query reads; under async scheduling, from the lowest start any verdict gives
            first_needed = max(0, req.num_computed - req.unverified - group.sliding_window + 1)
            for j in range(min(first_needed // group.block_size, len(req.blocks[g]))):
                if req.blocks[g][j] != NULL_BLOCK_ID:
                    self.allocators[g].release(req.blocks[g][j])
                    req.blocks[g][j] = NULL_BLOCK_ID
                    self.stats.window_releases += 1

    def _prefix_hit(self, req: SchedRequest, known: int) -> tuple[int, list[list[int]]]:
        """(num_computed_tokens, per group the cached blocks it starts with) for a run over its first `known` tokens."""
        if not self.knobs.enable_prefix_caching or self.cross is not None:  # no prefix cache for encoder output
            return 0, [[] for _ in self.groups]
        chains = []
        for g, group in enumerate(self.groups):
            chain = []
            for h in req.block_hashes(g, group.block_size)[: known // group.block_size]:
                block = self.allocators[g].lookup((g, h))  # a group's own cache: with one pool, ids are shared
                if block is None:
                    break
                chain.append(block)
            chains.append(chain)
        hit = min(len(c) * g.block_size for c, g in zip(chains, self.groups, strict=True))
        if hit >= known and any(g.kind == "mamba" for g in self.groups):
            step = math.lcm(*(g.block_size for g in self.groups))  # a mamba state is cached at block ends only
            computed = (known - 1) // step * step
        elif hit >= known:
            computed = known - 1  # logits need the last token: recompute it in place
        else:
            step = math.lcm(*(g.block_size for g in self.groups))
            computed = hit // step * step  # every group's computed part is whole blocks
        return computed, [c[: math.ceil(computed / g.block_size)] for c, g in zip(chains, self.groups, strict=True)]

    def _register_full_blocks(self, req: SchedRequest) -> None:
        for g, group in enumerate(self.groups):
            if g == self.cross or (group.kind == "mamba" and not caches_states(self.knobs)):
                continue
            hashes = req.block_hashes(g, group.block_size)
            # under async scheduling num_computed still counts the rejected drafts (phantom), whose KV is stale
            full = min((req.num_computed - req.phantom) // group.block_size, len(hashes))
            for j in range(req.num_hashed[g], full):
                if req.blocks[g][j] != NULL_BLOCK_ID:
                    self.allocators[g].register(req.blocks[g][j], (g, hashes[j]))
            req.num_hashed[g] = max(req.num_hashed[g], full)

    # ---- leaving ----------------------------------------------------------------------------
    def _free_blocks(self, req: SchedRequest) -> None:
        for g, table in enumerate(req.blocks):
            for b in table:
                self.allocators[g].release(b)
        req.blocks = [[] for _ in self.groups]

    def _preempt(self, req: SchedRequest, step: _Step) -> None:
        self._free_blocks(req)
        req.num_computed = 0
        req.proposed = []  # a resumed request drafts from a new proposal only (spec/async_steps.py, rule 8)
        req.num_hashed = [0] * len(self.groups)
        req.status = Status.PREEMPTED
        self.running.remove(req)
        self.waiting.insert(0, req)
        step.preempted.add(req.req_id)
        self.stats.preemptions += 1

    def _finish(self, req: SchedRequest) -> None:
        """Finished in update(): its row is released by the next output."""
        self.stats.finished += 1
        if self._drop(req):
            self._to_release.append(req.req_id)

    def _drop(self, req: SchedRequest) -> bool:
        """Free its blocks and forget it; True if it held a row (which must now be released)."""
        held = req.holds_row
        self._free_blocks(req)
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        return held

    def _abort_one(self, finished: list[str], unheld: list[str]) -> None:
        live = [*self.running, *self.waiting]
        if live:
            req = self.rng.choice(live)
            self.stats.aborted += 1
            if self._drop(req):
                finished.append(req.req_id)  # in this very output: apply frees rows before anything else
            else:
                unheld.append(req.req_id)

    # ---- async scheduling: the neighbours of a resumption (spec/async_steps.py, rule 7) ----------------------
    def _async_knob(self, chance: float) -> bool:
        """A knob's draw under async scheduling; never in a synchronous run (its outputs stay as they were)."""
        return self.config.async_scheduling and chance > 0 and self.rng.random() < chance

    def _resume_at_once(self, req: SchedRequest, step: _Step) -> bool:
        """Knob resume_at_once: req, whose drafts' verdict is unread, is preempted, to be resumed in this very
        output over the tokens it held before them (rule 7's valid side). True if it left the running list."""
        if not req.unverified or not self._async_knob(self.knobs.resume_at_once):
            return False
        self._preempt(req, step)
        step.resume_at_once.add(req.req_id)
        return True

    def _held_before_verdict(self, req: SchedRequest) -> int:
        """The tokens req held before the last record, whose verdict is unread: its 1 + k tokens less, as the pool
        counts them (every draft accepted) or as they are (the kept ones)."""
        return req.num_tokens + req.phantom - 1 - req.unverified

    def _idle_step(self, step: _Step, finished: list[str]) -> bool:
        """Knob idle_steps: an output with rows to release releases them and schedules nothing (no model runs on
        it), and one request that sampled in the step before is preempted, to be resumed right after."""
        if not finished or not self._async_knob(self.knobs.idle_steps):
            return False
        sampled = [r for r in self.running if r.req_id in self._sampled_last]
        if sampled:
            self._preempt(self.rng.choice(sampled), step)
        self.stats.idle_steps += 1
        return True

    def _count_after_idle(self, step: _Step) -> None:
        """Right after an idle step: requests that sampled before it, run over that sample's position."""
        if self._after_idle is None:
            return
        resumed = {c.req_id for c in step.cached if c.resumed}
        for req_id, n in step.scheduled:
            req = self.requests[req_id]
            if req_id in self._after_idle and req.num_computed < req.num_tokens <= req.num_computed + n:
                self.stats.resumed_after_idle_step += req_id in resumed
                self.stats.continued_after_idle_step += req_id not in resumed

    def _abort_after_sample(self, finished: list[str]) -> dict[int, SchedRequest]:
        """Knob abort_after_sample: one request that sampled in the last step is aborted in this output, before the
        host reads that sample; its row is free for a new request at once. {row: the aborted request}"""
        sampled = [r for r in self.running if r.req_id in self._sampled_last]
        if not sampled or not self._async_knob(self.knobs.abort_after_sample):
            return {}
        req = self.rng.choice(sampled)
        row = self.rows.index(req.req_id)
        self.stats.aborted += 1
        self._drop(req)
        finished.append(req.req_id)
        return {row: req}


def _cross_need(req: SchedRequest, held: int, block_size: int) -> int:
    """Cross blocks req still lacks: cdiv(encoder_len, block_size), allocated when it is admitted."""
    return max(0, math.ceil(req.spec.encoder_len / block_size) - held)


class _Step:
    """What one schedule() call has decided so far."""

    def __init__(self, budget: int, written: list[set[int]], fresh: list[list[int]]) -> None:
        self.budget = budget
        self.written = written  # per group: slots a shared block receives this step
        self.fresh = fresh  # per group: blocks allocated this step (vLLM's new blocks), in allocation order
        self.scheduled: list[tuple[str, int]] = []
        self.drafts: dict[str, tuple[int, ...]] = {}  # req_id -> the drafts it carries (scheduled_spec_decode_tokens)
        self.new: list[NewRequest] = []
        self.cached: list[CachedRequest] = []
        self.preempted: set[str] = set()
        self.drafting_new: set[str] = set()  # new requests drafting on their first step
        self.resume_at_once: set[str] = set()  # preempted in this step, to be resumed in it (knob resume_at_once)

    def add(self, req_id: str, n: int) -> None:
        self.scheduled.append((req_id, n))
        self.budget -= n


class _Admission:
    def __init__(
        self,
        computed: int,
        num_tokens: int,
        tables: list[list[int]],
        writes: list[list[int]],
        is_new: bool,
        collides: bool,
        drafts: list[int],
    ) -> None:
        self.computed = computed
        self.num_tokens = num_tokens
        self.tables = tables  # per group: cached prefix blocks (null below a window)
        self.writes = writes  # per group: slots written inside those cached blocks
        self.is_new = is_new  # holds no row yet: a NewRequest (else a resumed CachedRequest)
        self.collides = collides  # a write lands on a slot another request writes this step
        self.drafts = drafts  # proposed for its first step (trimmed to what it runs when admitted)
