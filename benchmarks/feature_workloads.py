"""Workloads of model kinds and scheduling modes beyond plain attention: a mamba group, a sliding window with drafts
under async scheduling, an encoder-decoder model. Each is a ReferenceScheduler setting (conformance/scheduler/), so
its steps follow every rule a real scheduler's must (window releases, optimistic counts, cross blocks at
admission); benchmarks/feature_trace.py records them.

- `hybrid-N`: N decodes over a full-attention group and a mamba group holding one state block per request (vLLM's
  hybrid models without prefix caching); `-async`: the same under async scheduling.
- `window-N-async-drafts`: N decodes over a full group and a sliding-window group drawing on one block pool (vLLM's
  form), async scheduling, up to `drafts` drafts per decode per step proposed on the device (vLLM's placeholders),
  the reference drafter's random counts and verdicts: some rejected, so each step's counts are corrected.
- `encdec-N`: an encoder-decoder model (a cross_attention group, Whisper's decoder length and encoder output) with
  N decodes, and each step one request finishing and a new one arriving with its encoder output's length.
- `mm-N`: a multimodal model with M-RoPE (Qwen2-VL's positions) with N decodes, and each step one request finishing
  and a new one arriving with an image prompt: its position table and delta (conformance/scheduler/mrope.py).

Prompts are random, so prefix caching would find nothing: it is off, and the warm-up prefills every prompt.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from benchmarks.workloads import VOCAB_SIZE
from conformance.scheduler import ReferenceScheduler, SchedulerKnobs, Workload, WorkloadRequest
from conformance.scheduler.mrope import position_table
from spec.mamba import MAMBA
from spec.types import KVCacheGroup, WorkerConfig

SEED = 1234
BLOCK_SIZE = 16
WINDOW = 1024  # as decode-256-pool2's window group
CONTEXT = (1024, 4096)  # a decode workload's prompt lengths, as benchmarks/workloads.py's contexts
# decodes outlast the warm-up and the timed steps: feature_trace's longest stream at 1 + drafts tokens a step
MAX_NEW_TOKENS = 1024
MAX_BATCHED_TOKENS = 8192  # vLLM's chunked-prefill budget: the warm-up prefills 64 prompts in about 20 steps
DECODER_LEN = 448  # Whisper's decoder max_model_len
DECODER_PROMPT = (4, 32)  # its decoder prompts: a few task and language tokens
ENCODER_LEN = (500, 1500)  # encoder output tokens per request; Whisper's is 1500 frames
IMAGE_PROMPT = (256, 1024)  # a multimodal prompt's tokens: an image's patches and a few text tokens
ARRIVING = ("encdec", "mm")  # models whose every steady step admits a request and finishes one


@dataclass(frozen=True)
class FeatureWorkload:
    name: str
    model: str  # "hybrid", "window", "encdec" or "mm"
    num_decodes: int
    async_scheduling: bool = False
    drafts: int = 0  # most drafts per decode per step (proposed on the device: async scheduling only)
    quick: bool = False  # in the CI subset (`-m quick`)

    @property
    def steady_shape(self) -> tuple[int, int, int]:
        """(new, cached, finished) requests of every output at the steady state the benchmark times."""
        return (1, self.num_decodes, 1) if self.model in ARRIVING else (0, self.num_decodes, 0)

    def scheduler(self, num_steps: int) -> ReferenceScheduler:
        """The reference scheduler over this workload, with requests enough for `num_steps` outputs."""
        rng = random.Random(f"{SEED} {self.name}")
        if self.model == "encdec":
            config, requests = self._encoder_decoder(num_steps, rng)
        elif self.model == "mm":
            config, requests = self._multimodal(num_steps, rng)
        else:
            config, requests = self._decodes(rng)
        knobs = SchedulerKnobs(enable_prefix_caching=False, spec_tokens=self.drafts, drafts_on_device=self.drafts > 0)
        return ReferenceScheduler(config, Workload(requests), knobs, seed=SEED)

    def _config(self, max_model_len: int, groups: tuple[KVCacheGroup, ...], one_block_pool: bool = False,
                max_encoder_len: int = 0, uses_mrope: bool = False) -> WorkerConfig:  # fmt: skip
        return WorkerConfig(
            max_num_reqs=max(2 * self.num_decodes, 8),
            max_model_len=max_model_len,
            max_num_batched_tokens=MAX_BATCHED_TOKENS,
            vocab_size=VOCAB_SIZE,
            kv_groups=groups,
            max_encoder_len=max_encoder_len,
            uses_mrope=uses_mrope,
            async_scheduling=self.async_scheduling,
            one_block_pool=one_block_pool,
        )

    def _decodes(self, rng: random.Random) -> tuple[WorkerConfig, tuple[WorkloadRequest, ...]]:
        """All requests arrive at once with long prompts; after the warm-up's prefills every step decodes them all."""
        max_model_len = CONTEXT[1] + MAX_NEW_TOKENS
        per_request = math.ceil(max_model_len / BLOCK_SIZE)
        if self.model == "hybrid":
            attention = KVCacheGroup(BLOCK_SIZE, 1 + self.num_decodes * per_request)
            # block_size >= max_model_len: one state block per request (spec/mamba.py), a row each and the null block
            states = KVCacheGroup(max_model_len, 2 * self.num_decodes + 1, kind=MAMBA)
            config = self._config(max_model_len, (attention, states))
        elif self.model == "window":
            pool = 1 + 2 * self.num_decodes * per_request  # one pool: both groups' blocks, so one num_blocks
            groups = (KVCacheGroup(BLOCK_SIZE, pool), KVCacheGroup(BLOCK_SIZE, pool, sliding_window=WINDOW))
            config = self._config(max_model_len, groups, one_block_pool=True)
        else:
            raise ValueError(f"{self.name}: unknown model {self.model!r}")
        requests = tuple(
            WorkloadRequest(f"d{i}", 0, _prompt(rng, *CONTEXT), MAX_NEW_TOKENS) for i in range(self.num_decodes)
        )
        return config, requests

    def _encoder_decoder(self, num_steps: int, rng: random.Random) -> tuple[WorkerConfig, tuple[WorkloadRequest, ...]]:
        """One arrival per step, each request prefilled in its first step and sampling num_decodes + 1 tokens: from
        step num_decodes on, each output decodes num_decodes requests, admits one and releases one."""
        rows = self.num_decodes + 2  # the running, the one arriving, the one whose row is released
        decoder = KVCacheGroup(BLOCK_SIZE, 1 + rows * math.ceil(DECODER_LEN / BLOCK_SIZE))
        cross = KVCacheGroup(BLOCK_SIZE, 1 + rows * math.ceil(ENCODER_LEN[1] / BLOCK_SIZE), kind="cross_attention")
        config = self._config(DECODER_LEN, (decoder, cross), max_encoder_len=ENCODER_LEN[1])
        requests = tuple(
            WorkloadRequest(f"e{i}", i, _prompt(rng, *DECODER_PROMPT), self.num_decodes + 1,
                            encoder_len=rng.randint(*ENCODER_LEN))
            for i in range(num_steps + 1)
        )  # fmt: skip
        return config, requests

    def _multimodal(self, num_steps: int, rng: random.Random) -> tuple[WorkerConfig, tuple[WorkloadRequest, ...]]:
        """One arrival per step, an image prompt with its position table, each request prefilled in its first step
        and sampling num_decodes + 1 tokens, as `_encoder_decoder`'s."""
        rows = self.num_decodes + 2
        max_model_len = IMAGE_PROMPT[1] + self.num_decodes + 1
        attention = KVCacheGroup(BLOCK_SIZE, 1 + rows * math.ceil(max_model_len / BLOCK_SIZE))
        config = self._config(max_model_len, (attention,), uses_mrope=True)
        requests = []
        for i in range(num_steps + 1):
            prompt = _prompt(rng, *IMAGE_PROMPT)
            table, delta = position_table(len(prompt), rng)
            requests.append(WorkloadRequest(f"m{i}", i, prompt, self.num_decodes + 1, mrope_positions=table,
                                            mrope_position_delta=delta))  # fmt: skip
        return config, tuple(requests)


def _prompt(rng: random.Random, lo: int, hi: int) -> tuple[int, ...]:
    return tuple(rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(lo, hi)))


def _cases(n: int, quick: bool) -> tuple[FeatureWorkload, ...]:
    return (
        FeatureWorkload(f"hybrid-{n}", "hybrid", n, quick=quick),
        FeatureWorkload(f"hybrid-{n}-async", "hybrid", n, async_scheduling=True, quick=quick),
        FeatureWorkload(f"window-{n}-async-drafts", "window", n, async_scheduling=True, drafts=2, quick=quick),
        FeatureWorkload(f"encdec-{n}", "encdec", n, quick=quick),
        FeatureWorkload(f"mm-{n}", "mm", n, quick=quick),
    )


FEATURE_WORKLOADS = (*_cases(8, quick=True), *_cases(64, quick=False))
