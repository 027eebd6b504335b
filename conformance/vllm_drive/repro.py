"""A drive's reproduction: a script that replays its scheduler outputs into a FRESH model runner and fails the same way.

    python <script>          # from the repository root, with vLLM installed (.venv-vllm)

The script holds the engine (`EngineSpec`: model folder, blocks, lengths, drafts, seed), each request's
max_tokens and every scheduler output the drive sent, up to the failing one, in spec's vLLM-form dataclasses
(spec/interop/vllm.py: their repr rebuilds them). `replay` builds the engine, attaches the shadow checker and
sends each output through the runner as the drive did (conformance/vllm_drive/runner_step.py): a divergence
raises the same ShadowMismatchError (step, request, field), a runner crash the same exception. A replay that
gets through every step raises AssertionError: the failure did not happen again. The samples are not replayed:
the fresh runner samples them again (same weights, seed and inputs: the same tokens, or the shadow refuses).

`replay` leaves its engine running (held in `REPLAYED`): shutting a vLLM engine down in-process tears down the
process-wide distributed state (`cleanup_dist_env_and_memory`) that every other engine of the process uses, so
a replay run inside a test (runpy, a bug planted in this process) must not. A script run as a process exits.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from conformance.vllm_drive.engine import EngineSpec, build_llm
from conformance.vllm_drive.mrv2_drafts import quiet_speculator
from conformance.vllm_drive.runner_step import run_step
from conformance.vllm_drive.vllm_output import to_vllm
from shadow.private_files import create_unique, private_dir
from spec.interop.vllm import VllmSchedulerOutput

REPLAYED: list[Any] = []  # the replays' engines, alive until the process ends (module docstring)


def replay(engine: EngineSpec, max_tokens: Mapping[str, int], steps: Sequence[VllmSchedulerOutput]) -> None:
    """Send `steps` through a fresh runner of `engine`, every step checked; raises what the drive raised."""
    from shadow.vllm_attach import attach, model_runner_of

    llm = build_llm(engine)
    REPLAYED.append(llm)
    runner = model_runner_of(llm)
    attach(llm, write_repro=False, keep_records=False)
    if engine.runner == "v2":
        quiet_speculator(runner)
    for form in steps:
        run_step(runner, to_vllm(form, max_tokens), engine.runner)
    raise AssertionError(f"replayed {len(steps)} scheduler outputs into a fresh runner without the failure")


def script(engine: EngineSpec, max_tokens: Mapping[str, int], steps: Sequence[VllmSchedulerOutput],
           failure: str) -> str:  # fmt: skip
    """The reproduction script's text."""
    body = [
        '"""Written by conformance.vllm_drive: replays a drive into a fresh vLLM model runner, which fails as it did:',
        "",
        *(f"    {line}" for line in failure.splitlines()),
        "",
        'Run from the repository root with vLLM installed (.venv-vllm/bin/python <this file>)."""',
        "",
        "from conformance.vllm_drive.engine import EngineSpec, set_offline_env",
        "",
        "set_offline_env()  # before vLLM is imported",
        "from conformance.vllm_drive.repro import replay  # noqa: E402",
        "from spec.interop.vllm import VllmCachedRequestData, VllmNewRequestData, VllmSchedulerOutput  # noqa: E402",
        "",
        f"engine = {engine!r}",
        f"max_tokens = {dict(max_tokens)!r}",
        "steps = [",
        *(f"    {s!r}," for s in steps),
        "]",
        "",
        'if __name__ in ("__main__", "<run_path>"):',
        "    replay(engine, max_tokens, steps)",
        "",
    ]
    return "\n".join(body)


def write(engine: EngineSpec, max_tokens: Mapping[str, int], steps: Sequence[VllmSchedulerOutput], failure: str,
          folder: str | Path | None) -> Path:  # fmt: skip
    """Write the script (shadow/private_files.py: a new file, in `folder` or a fresh private directory)."""
    where = Path(folder) if folder is not None else private_dir("slotmap-drive-")
    where.mkdir(mode=0o700, parents=True, exist_ok=True)
    stem = f"drive_repro_step{len(steps) - 1}"
    return create_unique(where, stem, ".py", script(engine, max_tokens, steps, failure))


if __name__ == "__main__":  # pragma: no cover - the scripts call replay themselves
    sys.exit("run a reproduction script written by conformance.vllm_drive, not this module")
