"""Drive a vLLM model runner with the reference scheduler, every step checked: a model config served offline.

    .venv-vllm/bin/python -m conformance.vllm_drive --runner v1 --model tests/live_vllm/models/llama --steps 400
    .venv-vllm/bin/python -m conformance.vllm_drive --model tests/live_vllm/models/gemma2 --scheduler-blocks 14 \\
        --knob null_lookahead=True --knob reuse_freed_first=True

`--model` is a folder with a Hugging Face `config.json` (random weights, token-id prompts: nothing downloaded).
`--spec-tokens K` builds the engine with a speculative config and lets the scheduler draft up to K tokens by
prompt lookup; `--scheduler-blocks N` gives the scheduler only N of the engine's blocks (preemption);
`--knob NAME=VALUE` sets any SchedulerKnobs field. Exit status 0: every step agreed; 1: a divergence or a runner
crash, printed with its step, request, field (or traceback) and a reproduction script; 2: a knob the runner
cannot take (with the reason) or a runner this vLLM cannot build.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import fields, replace
from typing import Any

from conformance.scheduler import SchedulerKnobs


def _knob(text: str) -> tuple[str, Any]:
    name, _, value = text.partition("=")
    names = [f.name for f in fields(SchedulerKnobs)]
    if name not in names or not value:
        raise argparse.ArgumentTypeError(f"{text!r}: NAME=VALUE with NAME one of {', '.join(names)}")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value  # a bare word: allocation_order=random


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.vllm_drive", description=__doc__.split("\n")[0])
    parser.add_argument("--runner", choices=("v1", "v2"), default="v1", help="vLLM's model runner to drive")
    parser.add_argument("--model", required=True, help="a folder with a config.json")
    parser.add_argument("--seed", type=int, default=0, help="the first round's workload and scheduler seed")
    parser.add_argument("--steps", type=int, default=500, help="scheduler steps to run (rounds of workloads)")
    parser.add_argument("--blocks", type=int, default=64, help="the engine's KV cache blocks")
    parser.add_argument("--scheduler-blocks", type=int, default=12, help="of them, those the scheduler uses (0: all)")
    parser.add_argument("--block-size", type=int, default=32, help="vLLM's CPU attention needs a multiple of 32")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=64, help="max_num_batched_tokens")
    parser.add_argument("--spec-tokens", type=int, default=3, help="most drafts per request per step (0: none)")
    parser.add_argument("--requests", type=int, default=8, help="requests per round")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--knob", type=_knob, action="append", default=[], help="NAME=VALUE of SchedulerKnobs")
    parser.add_argument("--drop-gated", action="store_true", help="reset knobs the runner cannot take, and say so")
    parser.add_argument("--repro-dir", default=None, help="where a failure's reproduction script goes")
    args = parser.parse_args(argv)

    from conformance.vllm_drive import (
        DriveError,
        DrivePlan,
        EngineSpec,
        KnobGateError,
        build_llm,
        drive,
        shutdown,
    )
    from conformance.vllm_drive.engine import RunnerKindError, set_offline_env
    from shadow.vllm_attach import UnsupportedVllmConfigError

    knobs = replace(SchedulerKnobs(spec_tokens=args.spec_tokens, max_chunk=args.chunk // 2 or None), **dict(args.knob))
    plan = DrivePlan(knobs, seed=args.seed, num_requests=args.requests, max_new_tokens=args.max_new_tokens,
                     scheduler_blocks=args.scheduler_blocks or None)  # fmt: skip
    engine = EngineSpec(args.model, num_blocks=args.blocks, block_size=args.block_size,
                        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.chunk, spec_tokens=max(args.spec_tokens, knobs.spec_tokens),
                        seed=args.seed, runner=args.runner)  # fmt: skip
    set_offline_env()
    try:
        llm = build_llm(engine)
    except RunnerKindError as other_kind:  # asked for v2 where vLLM builds v1
        print(f"slotmap: {other_kind}", file=sys.stderr)
        return 2
    try:
        report = drive(llm, plan, steps=args.steps, repro_dir=args.repro_dir, drop_gated=args.drop_gated)
    except (KnobGateError, UnsupportedVllmConfigError) as refused:  # a knob, or a setup attach refuses
        print(f"slotmap: {refused}", file=sys.stderr)
        return 2
    except DriveError as failure:
        print(f"slotmap: vLLM's model runner and spec disagree:\n{failure}\n{failure.report.summary()}")
        return 1
    finally:
        shutdown(llm)
    print(f"slotmap: {report.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
