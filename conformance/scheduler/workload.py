"""Workloads: which requests arrive when, with which prompts (sharing prefixes), how long they run.

`make_workload(seed, ...)` draws one from a seed; conformance.strategies draws the same type from
Hypothesis. Token contents come from a seeded generator either way, so shrinking acts on the
structure (counts, lengths, arrivals), not on thousands of token ids.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from spec.types import WorkerConfig


@dataclass(frozen=True)
class WorkloadRequest:
    req_id: str
    arrival_step: int  # first scheduler step that may admit it
    prompt_token_ids: tuple[int, ...]  # 1 <= len <= max_model_len - max_new_tokens
    max_new_tokens: int  # >= 1: finishes after this many sampled tokens
    stop_token_ids: frozenset[int] = frozenset()  # also finishes when it samples one of these
    encoder_len: int = 0  # encoder output tokens (conformance/scheduler/encoder.py; 0: a decoder-only model)
    # a multimodal request's M-RoPE table [3][prompt_len] and delta (conformance/scheduler/mrope.py); None: text
    mrope_positions: tuple[tuple[int, ...], ...] | None = None
    mrope_position_delta: int = 0


@dataclass(frozen=True)
class Workload:
    requests: tuple[WorkloadRequest, ...]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)


@dataclass(frozen=True)
class RequestShape:
    """The structural part of one request; tokens are filled in by `build_workload`."""

    arrival_step: int
    prompt_len: int
    max_new_tokens: int
    prefix: int | None = None  # index of the shared prefix the prompt starts with
    prefix_len: int = 0  # how much of that prefix it uses (clipped to prompt_len)
    num_stop_tokens: int = 0


@dataclass(frozen=True)
class WorkloadShape:
    requests: tuple[RequestShape, ...]
    prefix_lens: tuple[int, ...] = ()
    token_seed: int = 0


def build_workload(shape: WorkloadShape, config: WorkerConfig) -> Workload:
    """Fill a shape with tokens: shared prefixes first, then per-request random suffixes."""
    rng = random.Random(shape.token_seed)
    vocab = config.vocab_size
    prefixes = [tuple(rng.randrange(vocab) for _ in range(n)) for n in shape.prefix_lens]
    out = []
    for i, req in enumerate(shape.requests):
        max_new = max(1, min(req.max_new_tokens, config.max_model_len - 1))
        prompt_len = max(1, min(req.prompt_len, config.max_model_len - max_new))
        head: tuple[int, ...] = ()
        if req.prefix is not None and prefixes:
            head = prefixes[req.prefix % len(prefixes)][: min(req.prefix_len, prompt_len)]
        tail = tuple(rng.randrange(vocab) for _ in range(prompt_len - len(head)))
        stops = frozenset(rng.randrange(vocab) for _ in range(req.num_stop_tokens))
        out.append(WorkloadRequest(f"req-{i}", req.arrival_step, head + tail, max_new, stops))
    return Workload(tuple(out))


def make_workload(
    seed: int,
    config: WorkerConfig,
    *,
    num_requests: int = 8,
    max_arrival_step: int = 8,
    num_prefixes: int = 2,
    shared_prefix_prob: float = 0.5,
    max_prompt_len: int | None = None,
    max_new_tokens: int = 12,
    stop_token_prob: float = 0.3,
) -> Workload:
    rng = random.Random(seed)
    longest = max_prompt_len or max(1, config.max_model_len - 1)
    aligned = math.lcm(*(g.block_size for g in config.kv_groups))
    prefix_lens = tuple(
        # half the prefixes are whole blocks in every group: prompts equal to them can be fully cached
        n // aligned * aligned if n >= aligned and rng.random() < 0.5 else n
        for n in (rng.randint(1, longest) for _ in range(num_prefixes))
    )
    shapes = []
    for _ in range(num_requests):
        shared = num_prefixes > 0 and rng.random() < shared_prefix_prob
        prefix = rng.randrange(num_prefixes) if shared else None
        prompt_len = rng.randint(1, longest)
        if shared and rng.random() < 0.3 and prefix is not None:
            prompt_len = prefix_lens[prefix]  # the whole prompt is a prefix: a full cache hit later
        shapes.append(
            RequestShape(
                arrival_step=rng.randint(0, max_arrival_step),
                prompt_len=prompt_len,
                max_new_tokens=rng.randint(1, max_new_tokens),
                prefix=prefix,
                prefix_len=prefix_lens[prefix] if prefix is not None else 0,
                num_stop_tokens=int(rng.random() < stop_token_prob),
            )
        )
    return build_workload(WorkloadShape(tuple(shapes), prefix_lens, token_seed=rng.randrange(2**32)), config)
