"""The tiny hybrid model's recurrent sublayer: one state per request, kept in the mamba group's state blocks.

The recurrence is a diagonal linear one, the shape of a Mamba layer's SSM without its input-dependent gates:

    u_t = rms_norm(x_t) @ w_in              [state_size]
    h_t = decay * h_{t-1} + u_t             decay in (0.3, 0.8) per state channel, h_{-1} = 0
    y_t = h_t @ w_out                       added to the residual stream

A paged step (`recurrent_step`) runs it over each batch row's tokens from the state the row reads,
`states[mamba_prev_state_indices[b]]` (zero where -1: no prior state), and stores the state after the row's
last non-draft token at `mamba_state_indices[b, 0]` and after its i-th draft at column i (spec/mamba.py).
The state cache, `PagedKV.states` (one [num_blocks, state_size] tensor per layer), starts as NaN: a read of a
block nobody wrote (the null block, a stale row's, a state never kept) poisons the logits. `dense_recurrence`
runs the same recurrence over a whole sequence from zero. The state update itself stands in for the model's
Mamba kernels, which are not slotmap's: slotmap defines which block each step reads and writes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from slotmap.tiny.kv_caches import PagedKV
from spec.types import BatchInputs


@dataclass
class RecurrentLayer:
    norm: torch.Tensor  # [D]
    w_in: torch.Tensor  # [D, S]
    decay: torch.Tensor  # [S] in (0.3, 0.8)
    w_out: torch.Tensor  # [S, D]

    def to(self, dtype: torch.dtype, device: torch.device) -> RecurrentLayer:
        return RecurrentLayer(**{k: v.to(dtype=dtype, device=device) for k, v in vars(self).items()})


def init_recurrent_weights(num_layers: int, hidden_size: int, state_size: int, seed: int) -> list[RecurrentLayer]:
    """float32 weights from their own seeded generator (the attention weights stay those of the plain model)."""
    gen = torch.Generator().manual_seed(seed + 1009)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    return [
        RecurrentLayer(
            norm=1.0 + normal(hidden_size, std=0.1),
            w_in=normal(hidden_size, state_size, std=hidden_size**-0.5),
            decay=0.3 + 0.5 * torch.rand(state_size, generator=gen, dtype=torch.float32),
            w_out=normal(state_size, hidden_size, std=state_size**-0.5),
        )
        for _ in range(num_layers)
    ]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def recurrent_step(
    layers: list[RecurrentLayer], batch: BatchInputs, kv: PagedKV, group: int, num_blocks: int, eps: float
) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """layer -> its recurrent sublayer for this step, reading and writing `kv.states[layer]` through group g's
    state indices."""
    if batch.mamba_state_indices is None or batch.mamba_state_indices[group] is None:
        raise ValueError(f"a hybrid model needs BatchInputs.mamba_state_indices for its mamba group {group}")
    written = kv.index_tensor(batch.mamba_state_indices[group]).long()  # [num_reqs, 1 + S]
    read = kv.index_tensor(batch.mamba_prev_state_indices[group]).long()  # [num_reqs]
    qsl = kv.index_tensor(batch.query_start_loc).long().tolist()  # [num_reqs + 1]
    drafts = (written >= 0).sum(dim=1) - 1  # [num_reqs] each row's drafts
    state_size = layers[0].decay.shape[0]
    while len(kv.states) < len(layers):  # the state cache, allocated on the first step
        kv.states.append(torch.full((num_blocks, state_size), float("nan"), dtype=kv.dtype, device=kv.device))

    def sublayer(layer_idx: int, x: torch.Tensor) -> torch.Tensor:
        layer, states = layers[layer_idx], kv.states[layer_idx]
        u = _rms_norm(x, layer.norm, eps) @ layer.w_in  # [T, S]
        y = torch.zeros_like(u)
        initial = [states[int(read[b])] if read[b] >= 0 else torch.zeros_like(layer.decay) for b in range(len(read))]
        kept: list[tuple[int, torch.Tensor]] = []  # (state block, state), stored once every row has read its own
        for b, h in enumerate(initial):
            first, end = qsl[b], qsl[b + 1]
            k = int(drafts[b])
            for t in range(first, end):
                h = layer.decay * h + u[t]
                y[t] = h
                column = t - (end - 1 - k)  # 0 at the last non-draft token, i at the i-th draft
                if column >= 0:
                    kept.append((int(written[b, column]), h))
        for block, h in kept:
            states[block] = h
        return y @ layer.w_out

    return sublayer


def dense_recurrence(layer: RecurrentLayer, x: torch.Tensor, eps: float) -> torch.Tensor:  # [L, D]
    """The sublayer over one whole sequence x [L, D], from a zero state."""
    u = _rms_norm(x, layer.norm, eps) @ layer.w_in  # [L, S]
    h = torch.zeros_like(layer.decay)
    out = torch.empty_like(u)
    for t in range(u.shape[0]):
        h = layer.decay * h + u[t]
        out[t] = h
    return out @ layer.w_out
