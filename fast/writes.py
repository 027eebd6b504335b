"""What one step changes on the device, packed into one int64 buffer and applied in one go.

The host mirror is updated first; what goes to the device is only the final value of every entry the
step touched, so the device writes need no order among themselves (a row freed and refilled in the
same step is a single write of its new contents, with the stale tail zeroed).

Packed layout (int64), the argument of fast.kernels.apply_writes:
    table_ops [n_t, 6]  row, group, lo, hi, count, data index: table[row, lo:hi] = data[...], count -> num_blocks
    prompt_ops [n_p, 3] row, length, data index: token_ids[row, :length] = data[...]
    computed  [n_c, 2]  row, value: num_computed_tokens[row] = value
    data      [D]       block ids, then prompt tokens
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fast.kernels.apply_writes import apply_writes_triton
from fast.state import DeviceState

TABLE_OP_FIELDS = 6
PROMPT_OP_FIELDS = 3
COMPUTED_FIELDS = 2


@dataclass(frozen=True)
class StepWrites:
    table_ops: np.ndarray  # [n_t, 6] int64, see module docstring
    prompt_ops: np.ndarray  # [n_p, 3] int64
    computed: np.ndarray  # [n_c, 2] int64
    data: np.ndarray  # [D] int64

    @property
    def empty(self) -> bool:
        return not (len(self.table_ops) or len(self.prompt_ops) or len(self.computed))

    def packed(self) -> np.ndarray:  # [6 n_t + 3 n_p + 2 n_c + D] int64
        parts = (self.table_ops, self.prompt_ops, self.computed, self.data)
        return np.concatenate([p.reshape(-1) for p in parts]).astype(np.int64, copy=False)


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """One host->device copy that does not wait for the device (pinned staging on CUDA)."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def apply_writes(dev: DeviceState, writes: StepWrites) -> None:
    """Kernel 1, for pools whose device state is separate from the host mirror (CUDA, or the interpreter).

    A plain-CPU pool shares its tensors with the mirror, so committing the plan already wrote them.
    """
    if writes.empty:
        return  # nothing to launch
    apply_writes_triton(dev, upload(writes.packed(), dev.device), writes)


def ranges(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ranges of the given lengths laid end to end: (range index, index within range) per element."""
    which = np.repeat(np.arange(lengths.shape[0]), lengths)
    within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return which, within


def writes_from_ops(
    table_ops: np.ndarray,  # [n_t, 6] int64
    table_data: np.ndarray,  # [D_t] int64
    prompts: list[tuple[int, tuple[int, ...]]],  # (row, prompt token ids) of new requests
    computed_rows: np.ndarray,  # [n_c] int64
    computed_values: np.ndarray,  # [n_c] int64
) -> StepWrites:
    lengths = np.array([len(p) for _, p in prompts], np.int64)
    prompt_ops = np.stack(
        [np.array([r for r, _ in prompts], np.int64), lengths, table_data.size + np.cumsum(lengths) - lengths], axis=1
    ).reshape(-1, PROMPT_OP_FIELDS)
    prompt_data = np.fromiter((t for _, p in prompts for t in p), np.int64, int(lengths.sum()))
    return StepWrites(
        table_ops=table_ops.reshape(-1, TABLE_OP_FIELDS),
        prompt_ops=prompt_ops,
        computed=np.stack([computed_rows, computed_values], axis=1).astype(np.int64).reshape(-1, COMPUTED_FIELDS),
        data=np.concatenate([table_data, prompt_data]).astype(np.int64),
    )


def table_diff_ops(
    rows: np.ndarray,  # [k] int64, rows the step touched
    before: list[np.ndarray],  # per group [k, width_g], those rows' tables before the step
    after: list[np.ndarray],  # per group [R, width_g], the host mirror's tables after the step
    counts_after: np.ndarray,  # [G, R] filled entries after the step
) -> tuple[np.ndarray, np.ndarray]:
    """Table ops that turn `before` into `after` on the touched rows: one op per (row, group)."""
    ops, data = [], []
    data_len = 0
    for g, (old, new_table) in enumerate(zip(before, after, strict=True)):
        new = new_table[rows]
        for i, row in enumerate(rows.tolist()):
            changed = np.flatnonzero(old[i] != new[i])
            lo, hi = (int(changed[0]), int(changed[-1]) + 1) if changed.size else (0, 0)
            ops.append([row, g, lo, hi, int(counts_after[g, row]), data_len])
            data.append(new[i, lo:hi].astype(np.int64))
            data_len += hi - lo
    table_ops = np.array(ops, np.int64).reshape(-1, TABLE_OP_FIELDS)
    return table_ops, np.concatenate(data) if data else np.zeros(0, np.int64)
