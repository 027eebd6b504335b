"""The reference scheduler's speculative decoding: a drafter that proposes random drafts, and the rejection
step that decides, per request, how many of them the target accepts.

Acceptance is drawn, not computed from a model: with a chosen rate each draft is accepted in turn until
the first rejection, and some steps accept every draft or none, so both ends of the rollback are always
exercised. The token after the accepted drafts is the target's own (a correction where a draft was
rejected, so never equal to it; the bonus token where all were accepted).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol


class Proposer(Protocol):
    """What the scheduler asks for drafts: at most `room` draft ids for a request holding `tokens`."""

    def propose(self, tokens: Sequence[int], room: int) -> list[int]: ...


class Drafter:
    def __init__(self, max_drafts: int, acceptance_rate: float, vocab_size: int, seed: int) -> None:
        if max_drafts < 0 or not 0.0 <= acceptance_rate <= 1.0:
            raise ValueError(f"drafter needs max_drafts >= 0 and a rate in [0, 1], got {max_drafts}, {acceptance_rate}")
        self.max_drafts = max_drafts
        self.acceptance_rate = acceptance_rate
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)

    def propose(self, tokens: Sequence[int], room: int) -> list[int]:
        """Up to min(max_drafts, room) random draft ids (sometimes none, as a real drafter that finds no match).

        `tokens` (the request's known tokens) is what a real drafter reads; random drafts ignore it.
        """
        k = self.rng.randint(0, min(self.max_drafts, max(room, 0)))
        return [self.rng.randrange(self.vocab_size) for _ in range(k)]

    def accept(self, drafts: Sequence[int], target: int) -> tuple[int, ...]:
        """The rejection step: accepted drafts, then `target` (changed if it would equal the rejected draft)."""
        mode = self.rng.random()
        if mode < 0.2:
            accepted = len(drafts)  # a step where every draft is right
        elif mode < 0.4:
            accepted = 0  # and one where none is
        else:
            accepted = 0
            while accepted < len(drafts) and self.rng.random() < self.acceptance_rate:
                accepted += 1
        if accepted < len(drafts) and target == drafts[accepted]:
            target = (target + 1) % self.vocab_size  # the target disagreed with this draft: its token differs
        return (*drafts[:accepted], target)
