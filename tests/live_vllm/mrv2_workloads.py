"""vLLM's model runner v2 (MRv2) served with slotmap's shadow checker: the workloads test_mrv2.py asserts on.

    python -m tests.live_vllm.mrv2_workloads OUT.json WORK_DIR     # from the repository root

Runs in a process of its own: MRv2 needs Triton, so `triton_cpu_stand_in.install()` must run before vLLM
is imported, and a pytest process may have imported vLLM already (the other live tests run the v1
runner). One process serves every workload, one engine each (vLLM's import, about 20 s here, is paid
once), and writes what happened to OUT.json; test_mrv2.py asserts on it. The workloads:

- `llama`: chunked prefill, prefix-cache hits, preemption and resumption (14 blocks); then, in the same
  engine, `llama_planted`: one slot shifted after MRv2's `BlockTables.compute_slot_mappings`, which the checker
  must name (step, request, `slot_mapping[0]`) with a reproduction script;
- `gemma2`: a sliding-window and a full-attention layer (two KV cache groups), window releases;
- `ngram`: n-gram drafts, some accepted, some rejected. MRv2's n-gram proposer is a Triton kernel the
  interpreter cannot run (`_ngram_finalize_kernel`: "mask has unsupported dtype"), so `HostNgramProposer`
  stands in for it: the same contract (drafts [num_reqs, k] from the request's own tokens), on the host;
  MRv2's own input preparation, rejection sampler and bookkeeping run unchanged. Then, in the same engine,
  `ngram_planted`: one draft's logits row moved a token early after MRv2's
  `combine_sampled_and_draft_tokens`, which the checker must name (`logits_indices`);
- `drive_v2`: MRv2 driven by the reference scheduler's steps instead of vLLM's scheduler (conformance.vllm_drive);
- `plugin`: SLOTMAP_SHADOW=1 and no attach call: the entry point attaches to MRv2's runner itself.

Each engine step is counted apart from the shadow (a wrapper around the executor's or the runner's
`execute_model`), so `steps_checked` can be held to the engine's own count.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tests.live_vllm import triton_cpu_stand_in

PREFIX = list(range(10, 10 + 64))  # two full blocks of 32: what a later request can find cached
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
MRV2 = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"


def classes(obj: Any) -> list[str]:
    return [f"{c.__module__}.{c.__qualname__}" for c in type(obj).__mro__]


def summary(shadow: Any, calls: Counter[str], num_groups: int, outputs: list[list[int]]) -> dict[str, Any]:
    from tests.live_vllm.engine import features

    return {
        "runner": classes(shadow.runner),
        "shadow": type(shadow).__name__,
        "steps_checked": shadow.steps_checked,
        "execute_model_calls": calls["execute_model"],
        "records": len(shadow.records),
        "reports": [str(r) for r in shadow.checker.reports],
        "windows": [g.sliding_window for g in shadow.config.kv_groups],
        "features": asdict(features(shadow.records, num_groups)),
        "output_lengths": [len(o) for o in outputs],
    }


def llama_then_planted(work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    from vllm.v1.worker.gpu.block_table import BlockTables

    from shadow.checker import ShadowMismatchError
    from tests.live_vllm.engine import engine, generate

    # 14 blocks of 32 tokens for 8 requests of up to 200 tokens: the scheduler must preempt and resume;
    # 64 tokens a step: prompts of 100..170 tokens arrive in chunks
    with engine("llama", work / "llama", num_gpu_blocks_override=14, max_model_len=320) as (llm, shadow, calls):
        tails = (40, 100, 7, 70, 30, 90, 3, 55)
        prompts = [PREFIX + list(range(200 + 13 * i, 200 + 13 * i + n)) for i, n in enumerate(tails)]
        llama = summary(shadow, calls, 1, generate(llm, prompts, max_tokens=48))

        runner, original = shadow.runner, BlockTables.compute_slot_mappings
        planted: dict[str, Any] = {}
        first = shadow.steps_checked + 3

        def shifted(self: Any, idx_mapping: Any, query_start_loc: Any, positions: Any, *a: Any, **kw: Any) -> Any:
            slots = original(self, idx_mapping, query_start_loc, positions, *a, **kw)  # [num_groups, num_tokens]
            n = int(idx_mapping.shape[0])
            if not planted and shadow.steps_checked >= first and n >= 2:
                token = int(query_start_loc[n - 1])  # the last batch row's first token
                slots[0, token] += 1
                req_id = runner.req_states.index_to_req_id[int(idx_mapping[n - 1])]
                planted.update(step=shadow.steps_checked, req_id=req_id, field="slot_mapping[0]")
            return slots

        BlockTables.compute_slot_mappings = shifted  # type: ignore[method-assign]
        try:
            generate(llm, [list(range(50, 50 + n)) for n in (30, 80, 5)], max_tokens=12)
            caught: dict[str, Any] = {"error": None}
        except ShadowMismatchError as error:
            caught = {"error": [error.step, error.req_id, error.field], "repro": str(error.repro_path)}
        finally:
            BlockTables.compute_slot_mappings = original  # type: ignore[method-assign]
    return llama, {"planted": planted, **caught}


def gemma2(work: Path) -> dict[str, Any]:
    from tests.live_vllm.engine import engine, generate

    with engine("gemma2", work / "gemma2", num_gpu_blocks_override=24, max_model_len=320) as (llm, shadow, calls):
        prompts = [list(range(20 + i, 20 + i + n)) for i, n in enumerate((150, 40, 90))]
        return summary(shadow, calls, 2, generate(llm, prompts, max_tokens=100))


class HostNgramProposer:
    """Stands in for MRv2's `NgramGPUSpeculator.propose` (see the module docstring): for each batch row that
    sampled, the k tokens after the rightmost earlier occurrence of its longest matching suffix (n-gram
    sizes prompt_lookup_min..max), the last sampled token where they run out or nothing matches."""

    def __init__(self, runner: Any) -> None:
        spec = runner.speculative_config
        self.states, self.k = runner.req_states, int(spec.num_speculative_tokens)
        self.sizes = range(int(spec.prompt_lookup_max), int(spec.prompt_lookup_min) - 1, -1)

    def __call__(self, input_batch: Any, _attn: Any, _slots: Any, _hidden: Any, _aux: Any, num_sampled: Any,
                 *args: Any, dummy_run: bool = False, **kwargs: Any) -> Any:  # fmt: skip
        import torch

        n = input_batch.num_reqs
        drafts = torch.zeros((n, self.k), dtype=torch.int64)  # [num_reqs, k] in batch order
        if dummy_run:
            return drafts
        sampled, last_sampled = num_sampled.tolist(), self.states.last_sampled_tokens.view(-1)
        for b, row in enumerate(input_batch.idx_mapping_np[:n].tolist()):
            last = int(last_sampled[row])
            tokens = self.states.all_token_ids.gpu[row, : int(self.states.total_len.gpu[row])].tolist()
            drafts[b] = torch.tensor(self.continuation(tokens, last) if sampled[b] > 0 else [last] * self.k)
        return drafts

    def continuation(self, tokens: list[int], last: int) -> list[int]:
        for size in self.sizes:
            suffix = tokens[len(tokens) - size :]
            for start in range(len(tokens) - size - 1, -1, -1):  # rightmost earlier occurrence first
                if tokens[start : start + size] == suffix:
                    follow = tokens[start + size : start + size + self.k]
                    return follow + [last] * (self.k - len(follow))
        return [last] * self.k


def ngram_then_planted(work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    import vllm.v1.worker.gpu.model_runner as mrv2

    from shadow.checker import ShadowMismatchError
    from tests.live_vllm.engine import engine, generate

    # prompts that repeat themselves give the proposer drafts; the random-weight model agrees with some of
    # them (its greedy output repeats too) and not with others
    prompts = [[7, 8, 9, 10, 11] * 8, [40, 41, 42] * 12 + [99, 40, 41], list(range(300, 340)) * 2, [5, 6] * 20]
    with engine("llama", work / "ngram", speculative_config=NGRAM) as (llm, shadow, calls):
        runner = shadow.runner
        runner.speculator.propose = HostNgramProposer(runner)
        result = summary(shadow, calls, 1, generate(llm, prompts, max_tokens=40))

        original, planted = mrv2.combine_sampled_and_draft_tokens, {}

        def shifted(input_ids: Any, idx_mapping: Any, *args: Any, **kwargs: Any) -> Any:
            logits_indices = original(input_ids, idx_mapping, *args, **kwargs)  # [num_reqs + num_drafts]
            cu_num_logits = args[5].tolist()  # [num_reqs + 1]
            rows = [b for b in range(len(cu_num_logits) - 1) if cu_num_logits[b + 1] - cu_num_logits[b] > 1]
            if not planted and rows:
                b = rows[0]  # the first batch row with drafts: its first draft's target row, one token early
                logits_indices[cu_num_logits[b]] -= 1
                req_id = runner.req_states.index_to_req_id[int(idx_mapping[b])]
                planted.update(step=shadow.steps_checked, req_id=req_id, field="logits_indices")
            return logits_indices

        mrv2.combine_sampled_and_draft_tokens = shifted
        try:
            generate(llm, [[7, 8, 9, 10, 11] * 8, [5, 6] * 20], max_tokens=24)
            caught: dict[str, Any] = {"error": None}
        except ShadowMismatchError as error:
            caught = {"error": [error.step, error.req_id, error.field], "repro": str(error.repro_path)}
        finally:
            mrv2.combine_sampled_and_draft_tokens = original
    return result, {"planted": planted, **caught}


def drive_v2(work: Path) -> dict[str, Any]:
    """MRv2 driven by the reference scheduler's steps (conformance.vllm_drive), vLLM's scheduler bypassed: few
    blocks (preemptions, resumptions on the next step), prefix hits, chunks, prompt-lookup drafts written into
    MRv2's draft store (conformance/vllm_drive/mrv2_drafts.py), every step checked."""
    from conformance.scheduler import SchedulerKnobs
    from conformance.vllm_drive import DrivePlan, EngineSpec, build_llm, drive, shutdown
    from shadow.vllm_attach import model_runner_of
    from tests.live_vllm.engine import MODELS

    llm = build_llm(EngineSpec(str(MODELS / "llama"), num_blocks=64, spec_tokens=3, runner="v2"))
    try:
        knobs = SchedulerKnobs(spec_tokens=3, max_chunk=40, reuse_freed_first=True)
        report = drive(llm, DrivePlan(knobs, seed=0, scheduler_blocks=12), steps=80, repro_dir=work / "drive")
        fields = ("steps", "steps_checked", "preemptions", "next_step_resumptions", "prefix_hits",
                  "chunked_prefills", "drafts_accepted", "drafts_rejected")  # fmt: skip
        return {"runner": classes(model_runner_of(llm)), **{f: getattr(report, f) for f in fields}}
    finally:
        shutdown(llm)


def plugin(work: Path) -> dict[str, Any]:
    from vllm import LLM

    from shadow.vllm_attach import model_runner_of
    from shadow.vllm_attach import plugin as entry_point
    from tests.live_vllm.engine import MODELS, generate

    os.environ[entry_point.ENV] = "1"
    os.environ["SLOTMAP_SHADOW_REPRO_DIR"] = str(work / "plugin")
    entry_point.register()  # what vLLM's load_general_plugins() does in each of its processes (once per process)
    llm = LLM(model=str(MODELS / "llama"), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              dtype="float32", block_size=32, max_model_len=256, max_num_batched_tokens=64,
              num_gpu_blocks_override=32)  # fmt: skip
    try:
        executor, calls = llm.llm_engine.engine_core.engine_core.model_executor, Counter[str]()
        own = executor.execute_model

        def counted(*a: Any, **kw: Any) -> Any:  # the engine's steps, counted outside the runner
            calls["execute_model"] += 1
            return own(*a, **kw)

        executor.execute_model = counted
        outputs = generate(llm, [list(range(30, 130)), [3, 4, 5]], max_tokens=8)
        runner = model_runner_of(llm)
        shadow = runner.__dict__.get("_slotmap_shadow")
        return {
            "runner": classes(runner),
            "shadow": type(shadow).__name__,
            "steps_checked": getattr(shadow, "steps_checked", 0),
            "checker_steps": shadow.checker.step_index if shadow else 0,
            "execute_model_calls": calls["execute_model"],
            "records": len(shadow.records) if shadow else -1,
            "repro_dir": str(shadow.checker.repro_dir) if shadow else None,
            "output_lengths": [len(o) for o in outputs],
        }
    finally:
        llm.llm_engine.engine_core.shutdown()


def main(out: Path, work: Path) -> None:
    triton_cpu_stand_in.install()  # before vLLM is imported
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for name, value in (("HF_HUB_OFFLINE", "1"), ("VLLM_CPU_KVCACHE_SPACE", "1"), ("OMP_NUM_THREADS", "1"),
                        ("NUMBA_NUM_THREADS", "1")):  # fmt: skip
        os.environ.setdefault(name, value)
    os.environ.pop("SLOTMAP_SHADOW", None)  # the plugin workload turns it on, last
    results: dict[str, Any] = {"seconds": {}}
    for name, run in (("llama", llama_then_planted), ("gemma2", gemma2), ("ngram", ngram_then_planted),
                      ("drive_v2", drive_v2), ("plugin", plugin)):  # fmt: skip
        start = time.perf_counter()
        result = run(work)
        if isinstance(result, tuple):
            results[name], results[f"{name}_planted"] = result
        else:
            results[name] = result
        results["seconds"][name] = round(time.perf_counter() - start, 1)
        out.write_text(json.dumps(results, indent=1))  # what finished so far, should a later workload fail


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
