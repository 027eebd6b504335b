"""Drafting steps handed over as vLLM holds them: logits indices of every draft, SpecDecodeMetadata, and
1 .. k + 1 accepted tokens per request in each of the forms an engine has them.

The engine here keeps its state in a spec pool but lays each step out as vLLM's model runner does: its
own batch order (spec's reversed), one set of buffers reused every step and handed over as CPU torch
tensors over them, slots padded to max_num_batched_tokens, and the sampler's indices computed the way
vllm/v1/worker/gpu_model_runner.py's `_calc_spec_decode_metadata` computes them, in its own order.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import spec
from conformance.scenario import Scenario, random_scenario
from conformance.scheduler import ReferenceScheduler, as_vllm
from shadow.checker import ShadowChecker, ShadowMismatchError, replay
from spec.drafts import pad_accepted
from spec.types import SchedulerOutput, WorkerConfig
from tests.test_shadow import run_script

BUGS = {  # a planted engine bug -> the field the checker must name
    "target_shifted": "target_logits_indices",
    "bonus_is_last_draft": "bonus_logits_indices",
    "drafts_off_by_one": "draft_token_ids",
    "cu_drafts_exclusive": "cu_num_draft_tokens",
    "logits_at_first_token": "logits_indices",
}


def _arange_per_row(counts: np.ndarray) -> np.ndarray:
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


class VllmLayoutEngine:
    def __init__(self, config: WorkerConfig, bug: str | None = None) -> None:
        self.config, self.bug = config, bug
        self.pool = spec.RequestStatePool(config)
        budget = config.max_num_batched_tokens
        self.input_ids = np.zeros(budget, np.int32)  # [max_num_batched_tokens] reused: tails keep old values
        self.positions = np.zeros(budget, np.int64)  # [max_num_batched_tokens]
        self.slots = [np.zeros(budget, np.int64) for _ in config.kv_groups]  # per group [max_num_batched_tokens]
        self.query_start_loc = np.zeros(config.max_num_reqs + 1, np.int32)  # [max_num_reqs + 1] reused too
        self.seq_lens = np.zeros(config.max_num_reqs, np.int32)  # [max_num_reqs]
        self.order: list[int] = []  # engine batch_idx -> spec batch row
        self.drafted = self.rejected = 0

    def execute(self, out: SchedulerOutput) -> tuple[dict[str, torch.Tensor], list[str]]:
        self.pool.apply(out)
        batch = self.batch = self.pool.prepare(out)
        self.order = list(range(batch.num_reqs))[::-1]
        req_ids = [batch.req_ids[b] for b in self.order]
        qsl_spec = np.asarray(batch.query_start_loc)
        n = np.asarray(batch.num_scheduled_tokens)[self.order].astype(np.int64)  # [num_reqs] engine order
        qsl = self.query_start_loc[: len(n) + 1]  # [num_reqs + 1] a view of the reused buffer, as vLLM's
        qsl[1:] = np.cumsum(n)
        self.seq_lens[: len(n)] = np.asarray(batch.seq_lens)[self.order]
        for g in range(len(self.slots)):
            self.slots[g][:] = -1
        for e, b in enumerate(self.order):
            src, dst = slice(qsl_spec[b], qsl_spec[b + 1]), slice(qsl[e], qsl[e + 1])
            self.input_ids[dst] = np.asarray(batch.input_ids)[src]
            self.positions[dst] = np.asarray(batch.positions)[src]
            for g, slots in enumerate(self.slots):
                slots[dst] = np.asarray(batch.slot_mappings[g])[src]
        arrays = {
            "query_start_loc": qsl,
            "positions": self.positions,
            "input_ids": self.input_ids,
            "seq_lens": self.seq_lens[: len(n)],
        }
        for g, slots in enumerate(self.slots):
            arrays[f"slot_mapping[{g}]"] = slots
            arrays[f"block_table[{g}]"] = np.asarray(batch.block_tables[g])[self.order]
        drafts = out.scheduled_spec_decode_tokens
        if not drafts:  # vLLM builds SpecDecodeMetadata only when some request drafts
            arrays["logits_indices"] = qsl[1:] - 1
        else:
            arrays.update(self._spec_decode_metadata(np.array([len(drafts.get(r, ())) for r in req_ids]), qsl))
            self.drafted += 1
        return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}, req_ids

    def _spec_decode_metadata(self, num_draft_tokens: np.ndarray, qsl: np.ndarray) -> dict[str, np.ndarray]:
        """vLLM's _calc_spec_decode_metadata, step for step."""
        num_sampled = num_draft_tokens + 1
        cu_num_sampled = np.cumsum(num_sampled).astype(np.int32)
        logits_indices = np.repeat(qsl[1:] - num_sampled, num_sampled) + _arange_per_row(num_sampled)
        bonus = cu_num_sampled - 1
        cu_num_draft = np.cumsum(num_draft_tokens).astype(np.int32)
        target = np.repeat(cu_num_sampled - num_sampled, num_draft_tokens) + _arange_per_row(num_draft_tokens)
        draft_token_ids = self.input_ids[logits_indices][target + 1]
        if self.bug == "target_shifted" and target.size:
            target = target + 1
        if self.bug == "bonus_is_last_draft":
            bonus = bonus - (num_draft_tokens > 0)
        if self.bug == "drafts_off_by_one" and target.size:
            draft_token_ids = self.input_ids[logits_indices][target]
        if self.bug == "cu_drafts_exclusive":  # a leading 0, as query_start_loc has: not vLLM's form
            cu_num_draft = np.concatenate([[0], cu_num_draft[:-1]]).astype(np.int32)
        if self.bug == "logits_at_first_token":
            logits_indices = logits_indices - (np.repeat(num_draft_tokens, num_sampled) > 0)
        return {
            "logits_indices": logits_indices,
            "draft_token_ids": draft_token_ids,
            "num_draft_tokens": num_draft_tokens,
            "cu_num_draft_tokens": cu_num_draft,
            "cu_num_sampled_tokens": cu_num_sampled,
            "target_logits_indices": target,
            "bonus_logits_indices": bonus,
        }

    def record(self, kept: dict[str, tuple[int, ...]], drafts: dict[str, tuple[int, ...]]) -> None:
        self.rejected += sum(len(kept[r]) < 1 + len(drafts[r]) for r in kept if r in drafts)
        self.pool.record_sampled(self.batch, pad_accepted([list(kept.get(r, ())) for r in self.batch.req_ids]))


def _sampled_form(step: int, kept: dict[str, tuple[int, ...]], order: list[str]) -> object:
    """The accepted tokens in turn as a mapping, vLLM's [num_reqs, width] tensor, and its list of lists."""
    form = step % 3
    if form == 0:
        return {r: list(t) for r, t in kept.items()}
    rows = [list(kept.get(r, ())) for r in order]
    return torch.from_numpy(pad_accepted(rows)) if form == 1 else rows


def run(scenario: Scenario, engine: VllmLayoutEngine, checker: ShadowChecker, vllm_form: bool = True) -> int:
    sched = ReferenceScheduler(scenario.config, scenario.workload, scenario.knobs, seed=scenario.seed)
    rng = np.random.default_rng(scenario.seed)
    steps = 0
    while not sched.done():
        out = sched.schedule()
        arrays, order = engine.execute(out)
        checker.check(as_vllm(out, sched) if vllm_form else out, arrays, order)
        target = {r: int(rng.integers(scenario.config.vocab_size)) for r in sched.sampling_req_ids(out)}
        kept = sched.rejection_step(out, target)
        engine.record(kept, {r: tuple(t) for r, t in out.scheduled_spec_decode_tokens.items()})
        checker.record_sampled(_sampled_form(steps, kept, order))
        sched.update(out, kept)
        steps += 1
    return steps


def _drafting_scenarios() -> list[Scenario]:
    found = [s for s in (random_scenario(seed, spec_decode=True) for seed in range(40)) if s.knobs.spec_tokens > 0]
    return found[:4]


@pytest.mark.parametrize("index", range(4))
def test_drafting_steps_in_vllms_form_pass_and_the_record_replays(index: int, tmp_path: Path) -> None:
    scenario = _drafting_scenarios()[index]
    engine = VllmLayoutEngine(scenario.config)
    checker = ShadowChecker(scenario.config, repro_dir=tmp_path)
    steps = run(scenario, engine, checker, vllm_form=index % 2 == 0)
    assert steps == checker.step_index > 0 and not checker.reports
    assert not replay(scenario.config, checker.steps).reports  # the record holds each step as it was


def test_the_drafting_runs_draft_and_reject() -> None:
    """The runs above are evidence only if drafts were scheduled and some were rejected."""
    drafted = rejected = 0
    for scenario in _drafting_scenarios():
        engine = VllmLayoutEngine(scenario.config)
        run(scenario, engine, ShadowChecker(scenario.config, write_repro=False))
        drafted, rejected = drafted + engine.drafted, rejected + engine.rejected
    assert drafted > 0 and rejected > 0, (drafted, rejected)


@pytest.mark.parametrize(("bug", "field"), sorted(BUGS.items()))
def test_a_planted_sampler_bug_is_named_and_its_script_fails_the_same_way(bug: str, field: str, tmp_path: Path) -> None:
    scenario = _drafting_scenarios()[0]
    checker = ShadowChecker(scenario.config, repro_dir=tmp_path)
    with pytest.raises(ShadowMismatchError) as caught:
        run(scenario, VllmLayoutEngine(scenario.config, bug=bug), checker)
    error = caught.value
    assert error.field == field and error.req_id is not None and error.step == checker.step_index - 1
    assert error.repro_path is not None
    ran = run_script(error.repro_path)
    assert ran.returncode == 1 and str(error).splitlines()[0] in ran.stderr, ran.stderr
