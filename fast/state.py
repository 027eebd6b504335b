"""Stage 1 on the device: the pool's persistent tensors, and the host mirror validation reads.

The device holds what the kernels read: token ids, block tables, block counts and num_computed_tokens.
The host keeps a `spec.state.PoolState` (fast.pool owns it) (no token ids) so that validation, batch ordering and the
choice of what to upload never need a device->host copy.

All groups' block tables live in ONE flat int32 tensor, group g's table being the contiguous
[R, max_blocks_per_req(g)] slice starting at R * table_offset(g). One buffer means one kernel
argument for every group, so a single launch can address all of them.
"""

from __future__ import annotations

import numpy as np
import torch

from spec.types import WorkerConfig

# Rows of DeviceState.group_meta, each indexed by group.
META_BLOCK_SIZE = 0
META_WIDTH = 1  # max_blocks_per_req(g)
META_OFFSET = 2  # sum of the widths of the groups before g
META_ROWS = 3


class DeviceState:
    def __init__(self, config: WorkerConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        rows, groups = config.max_num_reqs, len(config.kv_groups)
        widths = np.array([config.max_blocks_per_req(g) for g in range(groups)], np.int64)
        offsets = np.concatenate([[0], np.cumsum(widths)[:-1]]).astype(np.int64)
        self.widths_np = widths  # [G] max_blocks_per_req(g)
        self.offsets_np = offsets  # [G] table_offset(g), in units of rows' widths
        self.block_sizes_np = np.array([g.block_size for g in config.kv_groups], np.int64)  # [G]
        self.total_width = int(widths.sum())
        self.group_meta = torch.from_numpy(  # [META_ROWS, G] int64, see META_*
            np.stack([self.block_sizes_np, widths, offsets])
        ).to(device)
        self.token_ids = torch.zeros((rows, config.max_model_len), dtype=torch.int64, device=device)  # [R, L]
        self.tables = torch.zeros(rows * self.total_width, dtype=torch.int32, device=device)  # all groups, flat
        self.num_blocks = torch.zeros((groups, rows), dtype=torch.int32, device=device)  # [G, R] filled entries
        self.num_computed = torch.zeros(rows, dtype=torch.int64, device=device)  # [R]

        self._table_views = tuple(  # per group: a contiguous [R, max_blocks_per_req(g)] view of `tables`
            self.tables[rows * int(off) : rows * int(off + width)].view(rows, int(width))
            for off, width in zip(offsets, widths, strict=True)
        )

    def table(self, group: int) -> torch.Tensor:
        """Group g's persistent block table, [R, max_blocks_per_req(g)] int32, sharing `tables`' memory."""
        return self._table_views[group]
