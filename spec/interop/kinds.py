"""Which groups an engine's attention layouts describe: those holding KV per token, not a mamba group's states."""

from __future__ import annotations

from spec.mamba import MAMBA
from spec.types import WorkerConfig


def refuse_state_group(config: WorkerConfig, group: int, where: str) -> None:
    """An attention layout (vLLM's flash-attention metadata, SGLang's req_to_token) of a mamba group is a misuse."""
    if config.kv_groups[group].kind == MAMBA:
        raise ValueError(f"{where}: group {group} holds Mamba states (spec/mamba.py), not KV per token")
