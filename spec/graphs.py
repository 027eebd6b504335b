"""Captured graphs and the descriptor of the one a batch replays: "which graph does this batch run?"

`CapturedGraphs` is the capture configuration (vLLM's CompilationConfig cudagraph_capture_sizes and
cudagraph_mode, 1 + num_speculative_tokens, max_num_seqs, and the attention backend's padding profile);
`dispatch` picks the runtime mode and padded shape of one batch as vLLM 0.32's V1 `CudagraphDispatcher.dispatch`
(vllm/v1/cudagraph_dispatcher.py; keys from `initialize_cudagraph_keys`, `_create_padded_batch_descriptor`)
does, with one change: `uniform` comes from spec/classify.py's progress-based classification (MRv2's
`decode_graph_eligible`), not from V1's shape test, so a 1 + K-token prompt chunk never replays a uniform
decode graph (vLLM #53051's class).

The rules, with S the sorted capture sizes, T the batch's tokens, uq = uniform_decode_query_len:
- mode NONE, T == 0, or T > max(S): no graph (NONE), nothing padded.
- T_pad = the smallest size in S that is >= T (vLLM's `_bs_to_padded_graph_size`).
- FULL graphs: mode FULL captures every size in S for mixed batches with num_reqs = min(size, max_num_reqs);
  FULL_DECODE_ONLY and FULL_AND_PIECEWISE capture, for uniform decodes only, every size in S within
  [uq, uq * max_num_reqs] that uq divides, with num_reqs = size // uq (vLLM asserts divisibility; a size that
  is not a multiple is skipped here). A uniform batch under a separate decode routine takes that graph,
  its request rows padded to T_pad // uq; any other batch under mode FULL takes the mixed FULL graph, its rows
  padded to min(T_pad, max_num_reqs) (FA3's scheduler metadata is sized by num_reqs, vLLM #35918).
- PIECEWISE graphs (mode PIECEWISE, or FULL_AND_PIECEWISE's mixed routine): every size in S, any number of
  requests: tokens padded to T_pad, request rows not padded (vLLM's num_reqs=None).
- otherwise (FULL_DECODE_ONLY and a batch that is not a uniform decode): NONE.

The padding itself (what each padded token and request row holds) is spec/padding.py's.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from spec.classify import RowClasses
from spec.padding_profiles import FLASH_ATTENTION, PaddingProfile
from spec.types import is_integral

# vLLM's CUDAGraphMode names that matter here: the configured modes, and (the first three) the runtime ones
GRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
RUNTIME_MODES = ("NONE", "PIECEWISE", "FULL")
_DECODE_ROUTINE = {"FULL_DECODE_ONLY": "FULL", "FULL_AND_PIECEWISE": "FULL"}  # a separate uniform-decode routine
_MIXED_ROUTINE = {"PIECEWISE": "PIECEWISE", "FULL": "FULL", "FULL_AND_PIECEWISE": "PIECEWISE"}  # mixed batches'


@dataclass(frozen=True)
class CapturedGraphs:
    capture_sizes: tuple[int, ...]  # [S] token counts with a captured graph, ascending, distinct, positive
    max_num_reqs: int  # requests a FULL graph was captured for at most (vLLM's max_num_seqs)
    mode: str = "FULL_AND_PIECEWISE"  # one of GRAPH_MODES (vLLM's default in 0.32)
    uniform_decode_query_len: int = 1  # 1 + K, K = num_speculative_tokens
    profile: PaddingProfile = field(default=FLASH_ATTENTION)  # what padded request rows hold (spec/padding.py)
    # full_keys(), computed once: dispatch asks for them every step
    _full_keys: frozenset[tuple[int, int, bool]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sizes = self.capture_sizes
        if not isinstance(sizes, Sequence) or not all(is_integral(s) for s in sizes):
            raise ValueError(f"CapturedGraphs.capture_sizes must be a sequence of integers, got {sizes!r}")
        object.__setattr__(self, "capture_sizes", tuple(int(s) for s in sizes))
        sizes = self.capture_sizes
        if any(s < 1 for s in sizes):
            raise ValueError(f"CapturedGraphs.capture_sizes must be positive, got {list(sizes)}")
        if any(b <= a for a, b in pairwise(sizes)):
            raise ValueError(f"CapturedGraphs.capture_sizes must be ascending with no repeat, got {list(sizes)}")
        if self.mode not in GRAPH_MODES:
            raise ValueError(f"CapturedGraphs.mode must be one of {GRAPH_MODES}, got {self.mode!r}")
        if self.mode != "NONE" and not sizes:
            raise ValueError(f"CapturedGraphs.capture_sizes is empty with mode {self.mode}")
        for name in ("max_num_reqs", "uniform_decode_query_len"):
            value = getattr(self, name)
            if not is_integral(value) or value < 1:
                raise ValueError(f"CapturedGraphs.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.profile, PaddingProfile):
            raise ValueError(f"CapturedGraphs.profile must be a PaddingProfile, got {self.profile!r}")
        object.__setattr__(self, "_full_keys", self._captured_full_keys())

    def full_keys(self) -> frozenset[tuple[int, int, bool]]:
        """The FULL graphs captured, as (num_tokens, num_reqs, uniform) (vLLM's FULL BatchDescriptor keys)."""
        return self._full_keys

    def _captured_full_keys(self) -> frozenset[tuple[int, int, bool]]:
        keys: set[tuple[int, int, bool]] = set()
        if _MIXED_ROUTINE.get(self.mode) == "FULL":
            keys.update((s, min(s, self.max_num_reqs), False) for s in self.capture_sizes)
        if self.mode in _DECODE_ROUTINE:
            uq = self.uniform_decode_query_len
            for s in self.capture_sizes:
                if uq <= s <= uq * self.max_num_reqs and s % uq == 0:
                    keys.add((s, s // uq, True))
        return frozenset(keys)


@dataclass(frozen=True)
class BatchDescriptor:
    """The graph one batch runs (vLLM's BatchDescriptor with the runtime CUDAGraphMode beside it)."""

    mode: str  # one of RUNTIME_MODES
    num_tokens: int  # padded token count T_pad (the batch's own where nothing is padded)
    num_reqs: int  # padded request rows (the batch's own where requests are not padded: PIECEWISE, NONE)
    uniform: bool  # a uniform-decode graph (by progress, spec/classify.py)
    max_query_len: int  # the batch's longest query (its real rows'; padded rows schedule 0)


def dispatch(graphs: CapturedGraphs | None, num_tokens: int, num_reqs: int, classes: RowClasses) -> BatchDescriptor:
    """The descriptor of a batch of `num_tokens` tokens in `num_reqs` rows, classified as `classes`."""
    eager = BatchDescriptor("NONE", num_tokens, num_reqs, False, classes.max_query_len)
    if graphs is None or graphs.mode == "NONE" or num_tokens == 0 or num_tokens > graphs.capture_sizes[-1]:
        return eager
    if classes.uniform_decode and classes.decode_query_len != graphs.uniform_decode_query_len:
        raise ValueError(
            f"dispatch: the batch was classified with 1 + K = {classes.decode_query_len}, "
            f"the graphs were captured for {graphs.uniform_decode_query_len}"
        )
    sizes = graphs.capture_sizes
    padded = sizes[bisect.bisect_left(sizes, num_tokens)]  # the smallest captured size >= num_tokens
    uniform = classes.uniform_decode and graphs.mode in _DECODE_ROUTINE
    if uniform:
        rows = min(padded // graphs.uniform_decode_query_len, graphs.max_num_reqs)
    else:
        rows = min(padded, graphs.max_num_reqs)
    if (padded, rows, uniform) in graphs.full_keys() and rows >= num_reqs:
        return BatchDescriptor("FULL", padded, rows, uniform, classes.max_query_len)
    if _MIXED_ROUTINE.get(graphs.mode) == "PIECEWISE":
        return BatchDescriptor("PIECEWISE", padded, num_reqs, False, classes.max_query_len)
    return eager


def check_descriptor(descriptor: BatchDescriptor, num_tokens: int, num_reqs: int) -> None:
    """A descriptor a batch can be padded to: a runtime mode, and no smaller than the batch in tokens or rows."""
    if descriptor.mode not in RUNTIME_MODES:
        raise ValueError(f"descriptor.mode must be one of {RUNTIME_MODES}, got {descriptor.mode!r}")
    if descriptor.num_tokens < num_tokens:
        raise ValueError(f"descriptor.num_tokens {descriptor.num_tokens} < the batch's {num_tokens} tokens")
    if descriptor.num_reqs < num_reqs:
        raise ValueError(f"descriptor.num_reqs {descriptor.num_reqs} < the batch's {num_reqs} requests")
