"""The live tests need vLLM (`.venv-vllm`, made by scripts/setup-vllm); the main `.venv` has none.

Without vLLM importable these files are not collected at all (finding the package is enough: importing
vLLM takes tens of seconds). With it, vLLM runs in this process: the engine core, its scheduler and
its model runner (VLLM_ENABLE_V1_MULTIPROCESSING=0), offline (HF_HUB_OFFLINE=1), one thread.
"""

from __future__ import annotations

import importlib.util
import os
import sys

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]  # run them with .venv-vllm/bin/python -m pytest tests/live_vllm
else:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # vLLM on CPU ignores torch.set_num_threads
    if "numba" in sys.modules:  # imported by the conformance plugin already: its config has read the environment,
        import numba  # and a NUMBA_NUM_THREADS changed now fails vLLM's n-gram proposer at its first compile

        numba.set_num_threads(1)
    else:
        os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM on CPU otherwise sizes its KV cache to most of RAM
