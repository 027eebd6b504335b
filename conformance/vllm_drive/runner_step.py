"""One step of a model runner, as vLLM's engine core runs it: `execute_model`, then `sample_tokens`.

    kept = run_step(runner, to_vllm(form, max_tokens))   # req_id -> the tokens the runner kept this step

vLLM's engine core calls `sample_tokens(grammar_output)` only when `execute_model` returned None (a step that
ran the model); a step that schedules no token returns its (empty) output at once. The kept tokens are the
runner's own: one sampled token, or with drafts the accepted drafts and the token after them (1 .. k + 1), and
none for a row whose chunk stops before its last known token (its sample is discarded).
"""

from __future__ import annotations

from typing import Any

from conformance.vllm_drive.mrv2_drafts import write_drafts


def run_step(runner: Any, scheduler_output: Any, kind: str = "v1") -> dict[str, list[int]]:
    """Execute one vLLM SchedulerOutput on `runner` (of `kind`, engine.runner_kind); req_id -> tokens kept (rows
    that keep none: []). Model runner v2 reads its draft ids from its own store: they are written there first."""
    if kind == "v2":
        write_drafts(runner, scheduler_output)
    result = runner.execute_model(scheduler_output)
    if result is None:
        result = runner.sample_tokens(None)
    if result is not None and hasattr(result, "get_output"):  # an async runner's output: wait for its host copy
        result = result.get_output()
    if result is None or not getattr(result, "req_ids", None):
        return {}
    rows = zip(result.req_ids, result.sampled_token_ids, strict=False)
    return {r: [int(t) for t in row if t >= 0] for r, row in rows}


def release_state(runner: Any) -> None:
    """After a failed step: drop the half-run step's state so the runner takes the next output."""
    if getattr(runner, "execute_model_state", None) is not None:
        runner.execute_model_state = None


def held_requests(runner: Any) -> set[str]:
    """The request ids the runner holds state for (v1's `requests`, v2's `req_states.req_id_to_index`)."""
    v2_states = getattr(runner, "req_states", None)
    if v2_states is not None and hasattr(v2_states, "req_id_to_index"):
        return set(v2_states.req_id_to_index)
    return set(getattr(runner, "requests", {}))
