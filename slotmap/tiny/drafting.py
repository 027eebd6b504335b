"""Speculative decoding for the tiny decoder: an n-gram drafter, an oracle of known accuracy, greedy verification.

The drafter looks up the request's last n tokens earlier in its own sequence and proposes what followed
them there (vLLM's n-gram proposer does the same). Greedy verification keeps a draft while it equals the
target's argmax at the position before it, then appends the target's argmax at the first mismatch (or
after the last draft): so a speculative run generates exactly the tokens of a plain greedy run, whatever
the drafts, and only takes fewer steps when they are right.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


class NgramDrafter:
    def __init__(self, max_drafts: int, min_n: int = 1, max_n: int = 3) -> None:
        if max_drafts < 0 or not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram drafter needs max_drafts >= 0 and 1 <= min_n <= max_n, got {max_drafts}, "
                             f"{min_n}, {max_n}")  # fmt: skip
        self.max_drafts, self.min_n, self.max_n = max_drafts, min_n, max_n

    def propose(self, tokens: Sequence[int], room: int) -> list[int]:
        """Up to min(max_drafts, room) tokens that followed the latest earlier occurrence of the longest suffix."""
        k = min(self.max_drafts, room)
        if k <= 0:
            return []
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = list(tokens[-n:])
            for start in range(len(tokens) - n - 1, -1, -1):  # latest match first, never the suffix itself
                if list(tokens[start : start + n]) == suffix:
                    return list(tokens[start + n : start + n + k])
        return []


class NoisyOracle:
    """A drafter that is sometimes right: a plain run's next tokens, each replaced by another with chance 1/3."""

    def __init__(self, plain: Iterable[Sequence[int]], max_drafts: int, vocab_size: int, seed: int) -> None:
        self.plain = [list(tokens) for tokens in plain]  # each request's tokens in the plain run
        self.max_drafts, self.vocab_size = max_drafts, vocab_size
        self.rng = np.random.default_rng(seed)

    def propose(self, tokens: Sequence[int], room: int) -> list[int]:
        ahead = next(p[len(tokens) :] for p in self.plain if p[: len(tokens)] == list(tokens))
        drafts = ahead[: min(self.max_drafts, room)]
        return [t if self.rng.random() < 2 / 3 else (t + 1) % self.vocab_size for t in drafts]


def greedy_verify(
    argmax: np.ndarray,  # [num_reqs + num_drafts] the target's argmax at each logits row
    num_draft_tokens: np.ndarray | None,  # [num_reqs], None: no drafts this step
    draft_token_ids: np.ndarray | None,  # [num_drafts]
) -> list[tuple[int, ...]]:
    """Per batch row, the tokens greedy decoding keeps: the drafts that match, then one argmax token."""
    if num_draft_tokens is None or draft_token_ids is None:
        return [(int(t),) for t in argmax]
    kept, row, draft = [], 0, 0
    for k in num_draft_tokens.tolist():
        targets, drafts = argmax[row : row + k + 1], draft_token_ids[draft : draft + k]
        accepted = 0
        while accepted < k and targets[accepted] == drafts[accepted]:
            accepted += 1
        kept.append(tuple(int(t) for t in targets[: accepted + 1]))  # the matched drafts equal their targets
        row, draft = row + k + 1, draft + k
    return kept
