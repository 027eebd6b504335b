"""Prompt lookup (n-gram) drafts: the scheduler's Proposer for a drive, so a real runner accepts some and rejects some.

    sched = ReferenceScheduler(config, workload, knobs, seed=seed, proposer=NgramProposer(knobs.spec_tokens))

What vLLM's `ngram` method does, on the request's known tokens: the longest suffix of 1..max_n tokens
(at least min_n) that occurred earlier in the sequence, and the tokens that followed that occurrence are the
drafts. The latest earlier occurrence with a full continuation wins, else the latest one (its continuation runs
into the suffix, so it is shorter). No occurrence: no drafts. With random weights and greedy sampling the
target often repeats itself, so lookups in repetitive prompts and outputs are right sometimes and wrong
other times: the runner's rejection sampler, not a drawn acceptance rate, decides.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramProposer:
    def __init__(self, max_drafts: int, min_n: int = 1, max_n: int = 3) -> None:
        if max_drafts < 0 or not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram proposer needs max_drafts >= 0 and 1 <= min_n <= max_n, got "
                             f"{max_drafts}, {min_n}, {max_n}")  # fmt: skip
        self.max_drafts, self.min_n, self.max_n = max_drafts, min_n, max_n

    def propose(self, tokens: Sequence[int], room: int) -> list[int]:
        """At most min(max_drafts, room) drafts: what followed the longest earlier match of the sequence's end."""
        k = min(self.max_drafts, room)
        if k <= 0:
            return []
        seq = list(tokens)
        end = len(seq)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            suffix = seq[end - n :]
            best: list[int] = []
            for start in range(end - n - 1, -1, -1):  # latest first; the suffix itself is not a match
                if seq[start : start + n] == suffix:
                    follow = seq[start + n : start + n + k]
                    if len(follow) > len(best):
                        best = follow
                    if len(best) == k:
                        break
            if best:
                return best
        return []
