"""A tiny DeepSeek-style MLA decoder on a backend's latent cache, and the same weights run densely.

Each layer's attention is multi-head latent attention (DeepSeek-V2's, without the query's low-rank step, as
V2-Lite): from the normed hidden state h,
    q = h @ wq -> per head [q_nope (P), q_pe (R)], q_pe rotated by RoPE at the token's position;
    h @ wkv_a -> [kv_c (L), k_pe (R)]: kv_c RMS-normed (the latent the cache keeps), k_pe rotated, one for all
    heads; kv_b [L, H * (P + V)] splits into W_UK [L, H, P] and W_UV [L, H, V] (vLLM's split_kv_b_proj).
Head h of token s then has key [kv_c[s] @ W_UK[:, h], k_pe[s]] and value kv_c[s] @ W_UV[:, h]; the softmax
scale is 1 / sqrt(P + R).

`forward_paged(batch, kv, is_prefilling)` is one engine step: kv_c and k_pe go to the mla group's slots with
the backend's write_mla_kv, and attention reads them back through slotmap/tiny/mla_caches.py (the absorbed
form for the rows split_mla_batch calls decodes, the prefill form for the rest). `forward_dense(token_ids)`
runs the same weights over one whole sequence with no cache and no absorption: each head's keys and values
up-projected from every position's latent, causal softmax. If every mapping is right the two agree at every
position; `generate_dense` is the greedy generation of the dense form.

Weights are deterministic random float32 (no download), widened exactly to the dtype a forward runs in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from slotmap.tiny.mla_caches import LatentKV
from spec.types import BatchInputs, KVCacheGroup


@dataclass(frozen=True)
class MlaModelConfig:
    vocab_size: int = 512
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 4
    kv_lora_rank: int = 16  # L: the latent's width (DeepSeek-V3: 512)
    qk_nope_head_dim: int = 8  # P (DeepSeek-V3: 128)
    qk_rope_head_dim: int = 4  # R, even (DeepSeek-V3: 64)
    v_head_dim: int = 8  # V (DeepSeek-V3: 128)
    intermediate_size: int = 64
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    seed: int = 0
    decode_threshold: int = 1  # reorder_batch_threshold: 1 + K with K drafts a step, or a backend's own
    treat_short_extends_as_decodes: bool = False  # vLLM 0.32's default outside context parallelism: True

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.qk_nope_head_dim + self.qk_rope_head_dim)


@dataclass
class _MlaLayer:
    attn_norm: torch.Tensor  # [D]
    wq: torch.Tensor  # [D, H * (P + R)]
    wkv_a: torch.Tensor  # [D, L + R]
    kv_a_norm: torch.Tensor  # [L]
    wkv_b: torch.Tensor  # [L, H * (P + V)]
    wo: torch.Tensor  # [H * V, D]
    mlp_norm: torch.Tensor  # [D]
    w_gate: torch.Tensor  # [D, I]
    w_up: torch.Tensor  # [D, I]
    w_down: torch.Tensor  # [I, D]

    def to(self, dtype: torch.dtype, device: torch.device) -> _MlaLayer:
        return _MlaLayer(**{k: v.to(dtype=dtype, device=device) for k, v in vars(self).items()})


class TinyMlaDecoder:
    def __init__(
        self, config: MlaModelConfig, kv_groups: Sequence[KVCacheGroup], device: torch.device | str = "cpu"
    ) -> None:
        found = [g for g, group in enumerate(kv_groups) if group.kind == "mla"]
        if len(found) != 1:
            raise ValueError(f"TinyMlaDecoder: the KV config needs one mla group, has {len(found)}")
        self.group = found[0]
        group = kv_groups[self.group]
        if (group.kv_lora_rank, group.qk_rope_head_dim) != (config.kv_lora_rank, config.qk_rope_head_dim):
            raise ValueError(
                f"TinyMlaDecoder: the mla group's widths ({group.kv_lora_rank}, {group.qk_rope_head_dim}) are not "
                f"the model's (kv_lora_rank {config.kv_lora_rank}, qk_rope_head_dim {config.qk_rope_head_dim})"
            )
        self.config, self.device = config, torch.device(device)
        self._embed, self._layers, self._norm, self._head = _init_weights(config)

    def _weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, list[_MlaLayer], torch.Tensor, torch.Tensor]:
        dev = self.device
        return (self._embed.to(dev, dtype), [la.to(dtype, dev) for la in self._layers],
                self._norm.to(dev, dtype), self._head.to(dev, dtype))  # fmt: skip

    def _attention_inputs(
        self, layer: _MlaLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """q_nope [T, H, P], q_pe [T, H, R] rotated, kv_c [T, L] normed, k_pe [T, R] rotated, W_UK, W_UV."""
        cfg = self.config
        heads, nope, rope, rank = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        h = _rms_norm(x, layer.attn_norm, cfg.rms_eps)
        q = (h @ layer.wq).view(x.shape[0], heads, nope + rope)
        kv = h @ layer.wkv_a  # [T, L + R]
        kv_c = _rms_norm(kv[:, :rank], layer.kv_a_norm, cfg.rms_eps)
        k_pe = _apply_rope(kv[:, None, rank:], cos, sin)[:, 0]  # one RoPE key part for every head
        kv_b = layer.wkv_b.view(rank, heads, nope + cfg.v_head_dim)
        w_uk, w_uv = kv_b[:, :, :nope], kv_b[:, :, nope:]
        return q[:, :, :nope], _apply_rope(q[:, :, nope:], cos, sin), kv_c, k_pe, w_uk, w_uv

    def forward_paged(
        self,
        batch: BatchInputs,
        kv: LatentKV,
        is_prefilling: Sequence[bool],  # [num_reqs] batch_idx -> num_computed_tokens < the prompt's length
    ) -> torch.Tensor:  # [num_reqs, vocab] in kv.dtype, at logits_indices
        cfg = self.config
        embed, layers, final_norm, lm_head = self._weights(kv.dtype)
        input_ids = _tensor(kv, batch.input_ids).long()  # [T]
        cos, sin = self._rope(_tensor(kv, batch.positions), kv.dtype)
        x = embed[input_ids]  # [T, D]
        for layer_idx, layer in enumerate(layers):
            q_nope, q_pe, kv_c, k_pe, w_uk, w_uv = self._attention_inputs(layer, x, cos, sin)
            kv.write(layer_idx, kv_c, k_pe, batch.slot_mappings[self.group])
            attn = kv.attend(
                layer_idx, q_nope, q_pe, w_uk, w_uv, batch, self.group, is_prefilling, scale=cfg.scale,
                decode_threshold=cfg.decode_threshold,
                treat_short_extends_as_decodes=cfg.treat_short_extends_as_decodes,
            )  # [T, H, V]  # fmt: skip
            x = x + attn.reshape(x.shape[0], -1) @ layer.wo
            x = x + _mlp(_rms_norm(x, layer.mlp_norm, cfg.rms_eps), layer)
        last = x[_tensor(kv, batch.logits_indices).long()]  # [num_reqs, D]
        return _rms_norm(last, final_norm, cfg.rms_eps) @ lm_head

    def forward_dense(self, token_ids: Sequence[int], dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Logits [S, vocab] at every position of one whole sequence, no cache: position p predicts token p + 1."""
        cfg = self.config
        embed, layers, final_norm, lm_head = self._weights(dtype)
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=self.device)  # [S]
        positions = torch.arange(ids.shape[0], device=self.device)  # [S]
        cos, sin = self._rope(positions, dtype)
        causal = positions[None, :] <= positions[:, None]  # [S, S] query -> visible key
        x = embed[ids]
        for layer in layers:
            q_nope, q_pe, kv_c, k_pe, w_uk, w_uv = self._attention_inputs(layer, x, cos, sin)
            keys = torch.einsum("sl,lhp->shp", kv_c, w_uk)  # [S, H, P] each head's no-RoPE key
            values = torch.einsum("sl,lhv->shv", kv_c, w_uv)  # [S, H, V]
            scores = torch.einsum("qhp,khp->hqk", q_nope, keys) + torch.einsum("qhr,kr->hqk", q_pe, k_pe)
            weights = torch.softmax((scores * cfg.scale).masked_fill(~causal, float("-inf")), dim=-1)
            attn = torch.einsum("hqk,khv->qhv", weights, values)  # [S, H, V]
            x = x + attn.reshape(x.shape[0], -1) @ layer.wo
            x = x + _mlp(_rms_norm(x, layer.mlp_norm, cfg.rms_eps), layer)
        return _rms_norm(x, final_norm, cfg.rms_eps) @ lm_head

    def generate_dense(self, prompt: Sequence[int], num_new: int) -> list[int]:
        """Greedy generation in float64, the whole sequence recomputed for every new token: prompt + num_new ids."""
        tokens = list(prompt)
        for _ in range(num_new):
            tokens.append(int(self.forward_dense(tokens)[-1].argmax()))
        return tokens

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, R/2] at `positions` [T], computed in float64 so both forwards see the same angles."""
        half = self.config.qk_rope_head_dim // 2
        inv_freq = self.config.rope_theta ** (-torch.arange(half, dtype=torch.float64, device=positions.device) / half)
        angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def _tensor(kv: LatentKV, array: object) -> torch.Tensor:
    """A BatchInputs array as a torch tensor on the model's device."""
    if isinstance(array, torch.Tensor):
        return array.to(kv.device)
    return torch.as_tensor(kv.backend.to_numpy(array), device=kv.device)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on x [T, heads, R] with cos/sin [T, R/2] (R = 0: nothing to rotate)."""
    if x.shape[-1] == 0:
        return x
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _mlp(x: torch.Tensor, layer: _MlaLayer) -> torch.Tensor:
    return (torch.nn.functional.silu(x @ layer.w_gate) * (x @ layer.w_up)) @ layer.w_down


def _init_weights(config: MlaModelConfig) -> tuple[torch.Tensor, list[_MlaLayer], torch.Tensor, torch.Tensor]:
    """float32 weights from a seeded generator: identical on every machine."""
    gen = torch.Generator().manual_seed(config.seed)
    d, heads, rank = config.hidden_size, config.num_heads, config.kv_lora_rank
    nope, rope, v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    def norm_weight(width: int) -> torch.Tensor:
        return 1.0 + normal(width, std=0.1)

    embed = normal(config.vocab_size, d, std=1.0)
    layers = [
        _MlaLayer(
            attn_norm=norm_weight(d),
            wq=normal(d, heads * (nope + rope), std=d**-0.5),
            wkv_a=normal(d, rank + rope, std=d**-0.5),
            kv_a_norm=norm_weight(rank),
            wkv_b=normal(rank, heads * (nope + v), std=rank**-0.5),
            wo=normal(heads * v, d, std=(heads * v) ** -0.5),
            mlp_norm=norm_weight(d),
            w_gate=normal(d, config.intermediate_size, std=d**-0.5),
            w_up=normal(d, config.intermediate_size, std=d**-0.5),
            w_down=normal(config.intermediate_size, d, std=config.intermediate_size**-0.5),
        )
        for _ in range(config.num_layers)
    ]
    return embed, layers, norm_weight(d), normal(d, config.vocab_size, std=d**-0.5)
