"""What shadow/vllm_attach/hook.py reads of vLLM's model runner exists under those names in the installed
vLLM: a vLLM that renamed one fails here by name, not as a silent gap in what is checked. (Async scheduling
is off on CPU, so its path is held to vLLM's names here rather than run.)"""

from __future__ import annotations

import inspect


def test_the_wrapped_methods_take_what_the_hook_reads() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.utils import AttentionGroup

    def params(fn: object) -> list[str]:
        return list(inspect.signature(fn).parameters)  # type: ignore[arg-type]

    assert params(GPUModelRunner.execute_model)[:3] == ["self", "scheduler_output", "intermediate_tensors"]
    assert params(GPUModelRunner._prepare_inputs) == ["self", "scheduler_output", "num_scheduled_tokens"]
    assert {"num_reqs", "slot_mappings"} <= set(params(GPUModelRunner._build_attention_metadata))
    assert {"input_ids", "positions"} <= set(params(GPUModelRunner._model_forward))
    assert params(AttentionGroup.build_metadata)[:3] == ["self", "common_attn_metadata", "ubatch_idx"]
    assert "sample_tokens" in vars(GPUModelRunner)


def test_the_async_output_holds_what_the_hook_reads() -> None:
    from vllm.v1.worker.gpu_model_runner import AsyncGPUModelRunnerOutput

    source = inspect.getsource(AsyncGPUModelRunnerOutput.__init__)
    for name in ("self._model_runner_output", "self._invalid_req_indices", "self.sampled_token_ids_cpu",
                 "self.async_copy_ready_event"):  # fmt: skip
        assert name in source, name


def test_the_metadata_fields_read_exist() -> None:
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    common = set(CommonAttentionMetadata.__dataclass_fields__)
    assert {"query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping", "num_reqs"} <= common
    spec_decode = set(SpecDecodeMetadata.__dataclass_fields__)
    assert {"num_draft_tokens", "cu_num_draft_tokens", "cu_num_sampled_tokens", "draft_token_ids",
            "target_logits_indices", "bonus_logits_indices"} <= spec_decode  # fmt: skip


def test_importing_the_attach_package_imports_no_vllm() -> None:
    import subprocess
    import sys

    code = "import sys, shadow.vllm_attach; print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
