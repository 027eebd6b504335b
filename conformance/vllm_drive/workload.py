"""Workloads for a drive: repetitive prompts (so prompt lookup finds drafts), shared prefixes (prefix-cache
hits, some whole blocks), long prompts (chunked prefill) and request ids unique per drive round.

    workload = lookup_workload(seed, config, tag="d3", num_requests=8)

Each prompt is an optional shared prefix, then a body that repeats a short motif (with a token changed here and
there), or, for a share of the requests, random tokens. Token ids are below `config.vocab_size`; every prompt
leaves room for its max_new_tokens within `config.max_model_len`.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

from conformance.scheduler import Workload, WorkloadRequest
from spec.types import WorkerConfig


def lookup_workload(
    seed: int,
    config: WorkerConfig,
    *,
    tag: str,
    num_requests: int = 8,
    max_arrival_step: int = 8,
    max_prompt_len: int | None = None,
    max_new_tokens: int = 24,
    num_prefixes: int = 2,
    random_share: float = 0.25,
    stop_token_prob: float = 0.2,
) -> Workload:
    rng = random.Random(seed)
    vocab = config.vocab_size
    longest = max(1, min(max_prompt_len or config.max_model_len, config.max_model_len - 1))
    aligned = math.lcm(*(g.block_size for g in config.kv_groups))
    prefixes = []
    for _ in range(num_prefixes):
        n = rng.randint(1, longest)
        if n >= aligned and rng.random() < 0.6:
            n = n // aligned * aligned  # whole blocks in every group: a prompt equal to it is a full hit later
        prefixes.append(_body(rng, n, vocab, random_share))
    requests = []
    for i in range(num_requests):
        max_new = rng.randint(1, max(1, min(max_new_tokens, config.max_model_len - 1)))
        room = max(1, min(longest, config.max_model_len - max_new))
        head: list[int] = []
        if prefixes and rng.random() < 0.5:
            head = list(rng.choice(prefixes))[:room]
        if head and rng.random() < 0.25:
            prompt = head  # the whole prompt is a prefix
        else:
            total = rng.randint(len(head) + 1, room) if len(head) < room else room
            prompt = head + _body(rng, total - len(head), vocab, random_share)
        prompt = prompt[:room] or [rng.randrange(vocab)]
        stops = frozenset({rng.randrange(vocab)}) if rng.random() < stop_token_prob else frozenset()
        requests.append(WorkloadRequest(f"{tag}-{i}", rng.randint(0, max_arrival_step), tuple(prompt), max_new, stops))
    return Workload(tuple(requests))


def retagged(workload: Workload, tag: str) -> Workload:
    """`workload` with each request id prefixed by `tag` (ids unique across the rounds one runner serves)."""
    return Workload(tuple(replace(r, req_id=f"{tag}-{r.req_id}") for r in workload.requests))


def _body(rng: random.Random, n: int, vocab: int, random_share: float) -> list[int]:
    if n <= 0:
        return []
    if rng.random() < random_share:
        return [rng.randrange(vocab) for _ in range(n)]
    motif = [rng.randrange(vocab) for _ in range(rng.randint(1, 7))]
    body = [motif[j % len(motif)] for j in range(n)]
    for _ in range(rng.randint(0, max(0, n // 16))):  # a few changed tokens: lookups that mislead
        body[rng.randrange(n)] = rng.randrange(vocab)
    return body
