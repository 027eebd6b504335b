"""The tiny MLA model's engine loop: scheduler -> pool -> model on the latent cache -> greedy -> record_sampled.

`generate_paged` drives a scheduler to completion through a backend's pool and TinyMlaDecoder, greedy: each
step's logits (one row per batch row, plus one per draft token when the scheduler sends drafts) are verified
greedily (slotmap.tiny.drafting.greedy_verify: the matching drafts, then the target's token), recorded in the
pool and handed to the scheduler. A row is prefilling (the MLA split's flag, spec/mla_split.py) while its
num_computed_tokens is below its prompt's length, vLLM's `num_computed_tokens < prefill_len`. Returns every
request's tokens, prompt first, so that a dense greedy recompute can be compared token for token.
"""

from __future__ import annotations

import numpy as np
import torch

from conformance.backends import BackendHandle
from conformance.scheduler import ReferenceScheduler
from slotmap.tiny.drafting import greedy_verify
from slotmap.tiny.mla import TinyMlaDecoder
from slotmap.tiny.mla_caches import LatentKV
from spec.drafts import pad_accepted
from spec.types import WorkerConfig


def generate_paged(
    backend: BackendHandle,
    config: WorkerConfig,
    model: TinyMlaDecoder,
    scheduler: ReferenceScheduler,
    dtype: torch.dtype = torch.float32,  # the paged run's; spec computes in float64 too, fast in float32
    max_steps: int = 1000,
) -> dict[str, list[int]]:  # req_id -> prompt + generated tokens
    pool = backend.make_pool(config)
    kv = LatentKV(backend, config.kv_groups[model.group], model.config.num_layers, dtype, model.device)
    tokens: dict[str, list[int]] = {}
    prompt_len: dict[str, int] = {}
    steps = 0
    while not scheduler.done():
        if steps == max_steps:
            raise RuntimeError(f"generate_paged: the scheduler did not drain in {max_steps} steps")
        out = scheduler.schedule()
        pad_to = scheduler.pad_to(out)
        pool.apply(out)
        for new in out.new_requests:
            tokens[new.req_id], prompt_len[new.req_id] = list(new.prompt_token_ids), len(new.prompt_token_ids)
        steps += 1
        if out.total_num_scheduled_tokens == 0:  # nothing runnable: an engine runs no model
            scheduler.update(out, {})
            continue
        batch = pool.prepare(out, pad_to)
        seq_lens = np.asarray(backend.to_numpy(batch.seq_lens), np.int64)  # [num_reqs]
        scheduled = np.asarray(backend.to_numpy(batch.num_scheduled_tokens), np.int64)  # [num_reqs]
        is_prefilling = [int(seq_lens[b] - scheduled[b]) < prompt_len[r] for b, r in enumerate(batch.req_ids)]
        logits = model.forward_paged(batch, kv, is_prefilling)  # [num_reqs + num_drafts, vocab]
        argmax = logits.argmax(dim=-1).cpu().numpy().astype(np.int64)
        drafting = batch.num_draft_tokens is not None
        num_drafts = np.asarray(backend.to_numpy(batch.num_draft_tokens)) if drafting else None
        draft_ids = np.asarray(backend.to_numpy(batch.draft_token_ids)) if drafting else None
        kept = greedy_verify(argmax, num_drafts, draft_ids)  # [num_reqs] per batch row
        pool.record_sampled(batch, backend.asarray(pad_accepted([list(k) for k in kept]) if drafting else argmax))
        takes = set(scheduler.sampling_req_ids(out))
        sampled = {r: kept[b] for b, r in enumerate(batch.req_ids) if r in takes}
        for req_id, new_tokens in sampled.items():
            tokens[req_id].extend(new_tokens)
        scheduler.update(out, sampled)
    return tokens
