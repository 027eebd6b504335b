"""Drafts for model runner v2: the drive is MRv2's speculator.

v1 reads a step's draft ids from the scheduler output (`scheduled_spec_decode_tokens`). MRv2 reads only
their count there: the ids it verifies are those in its own draft store, `req_states.draft_tokens[row]`,
which its speculator fills after each step (vllm/v1/worker/gpu/model_runner.py, `sample_tokens`). So for
a v2 drive, `write_drafts` puts the scheduler's drafts into the rows of the requests that carry them,
before `execute_model`, and `quiet_speculator` replaces the runner's own speculator's `propose` (on this
runner instance, until `restore_speculator`) by one that proposes nothing (its ids would be overwritten
anyway; MRv2's n-gram kernel does not run in Triton's interpreter on CPU). A request added in this very
step has no row yet, and MRv2 zeroes a new row's store: drafts on admission are gated for v2 (gates.py).
"""

from __future__ import annotations

from typing import Any


def write_drafts(runner: Any, scheduler_output: Any) -> None:
    """Each drafting request's draft ids into its row of MRv2's draft store (rows it already holds)."""
    drafts = scheduler_output.scheduled_spec_decode_tokens
    if not drafts:
        return
    import torch

    states = runner.req_states
    for req_id, ids in drafts.items():
        row = states.req_id_to_index.get(req_id)
        if row is None or not ids:
            continue  # a request added this step: refused by the drafts_on_admission gate
        states.draft_tokens[row, : len(ids)] = torch.tensor(ids, dtype=states.draft_tokens.dtype)


def quiet_speculator(runner: Any) -> bool:
    """Replace the runner's speculator's propose by a silent one; False where the runner has no speculator."""
    speculator = getattr(runner, "speculator", None)
    if speculator is None or "propose" in vars(speculator):
        return False
    k = int(runner.num_speculative_steps)

    def propose(input_batch: Any, *args: Any, **kwargs: Any) -> Any:
        import torch

        return torch.zeros((input_batch.num_reqs, k), dtype=runner.req_states.draft_tokens.dtype)

    speculator.propose = propose
    return True


def restore_speculator(runner: Any) -> None:
    speculator = getattr(runner, "speculator", None)
    if speculator is not None:
        vars(speculator).pop("propose", None)
