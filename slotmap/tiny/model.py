"""A tiny Llama-style decoder that runs on a backend's paged KV pipeline, and the same weights run densely.

`TinyDecoder.forward_paged(batch, kv)` is one engine step: it embeds `input_ids`, applies RoPE at
`positions`, writes K/V with the backend's `write_kv` at `slot_mappings[g]`, attends with its
`paged_attention` over `block_tables[g]` / `seq_lens` / `query_start_loc`, and returns logits at
`logits_indices`. `forward_dense(token_ids)` runs the same weights over one whole sequence with no
cache (causal, the same window per layer): if every mapping is right, the two agree at every position.

Weights are deterministic random float32 (no download). The dense forward casts them to float64
exactly, so it is the high-precision reference for the float32 paged run.

With `cross_attention` the model is an encoder-decoder (spec/cross_attention.py): a tiny encoder (embedding,
sinusoidal positions, RMS norm) turns each request's encoder input ids into L states, and every layer adds
a cross-attention sublayer after its self-attention: its encoder K/V are written through
`cross_slot_mapping` on the step the request's encoder runs, and every step reads all L of them through
the cross group's table and `encoder_seq_lens`. The dense forward computes the same from the whole input.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from slotmap.tiny.kv_caches import PagedKV
from slotmap.tiny.recurrent import RecurrentLayer, dense_recurrence, init_recurrent_weights, recurrent_step
from spec.types import BatchInputs, KVCacheGroup

FLOAT32_EPS = float(np.finfo(np.float32).eps)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 2048
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    layer_groups: tuple[int, ...] = (0, 1, 0)  # layer -> KV cache group (a group may have a sliding window)
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    seed: int = 0
    # M-RoPE (spec/mrope.py): the rotary frequency pairs read from the temporal, height and width position
    # rows, in order (Qwen2-VL's mrope_section; they sum to head_dim // 2). None: plain RoPE at `positions`
    mrope_section: tuple[int, int, int] | None = None
    # encoder-decoder: every layer also cross-attends to the request's encoder output, held in the KV config's
    # cross_attention group (spec/cross_attention.py)
    cross_attention: bool = False
    # hybrid: every layer also runs a recurrent sublayer (slotmap/tiny/recurrent.py) whose per-request state lives
    # in the state blocks of the KV config's mamba group (spec/mamba.py)
    mamba: bool = False
    state_size: int = 16

    @property
    def num_layers(self) -> int:
        return len(self.layer_groups)


@dataclass
class _Layer:
    attn_norm: torch.Tensor  # [D]
    wq: torch.Tensor  # [D, H * hd]
    wk: torch.Tensor  # [D, KVH * hd]
    wv: torch.Tensor  # [D, KVH * hd]
    wo: torch.Tensor  # [H * hd, D]
    mlp_norm: torch.Tensor  # [D]
    w_gate: torch.Tensor  # [D, I]
    w_up: torch.Tensor  # [D, I]
    w_down: torch.Tensor  # [I, D]

    def to(self, dtype: torch.dtype, device: torch.device) -> _Layer:
        return _Layer(**{k: v.to(dtype=dtype, device=device) for k, v in vars(self).items()})


class TinyDecoder:
    def __init__(
        self, config: ModelConfig, kv_groups: Sequence[KVCacheGroup], device: torch.device | str = "cpu"
    ) -> None:
        if config.num_heads % config.num_kv_heads:
            raise ValueError(f"num_heads {config.num_heads} must be a multiple of num_kv_heads {config.num_kv_heads}")
        if max(config.layer_groups) >= len(kv_groups) or min(config.layer_groups) < 0:
            raise ValueError(f"layer_groups {config.layer_groups} name groups outside the {len(kv_groups)} KV groups")
        if config.mrope_section is not None and sum(config.mrope_section) != config.head_dim // 2:
            raise ValueError(f"mrope_section {config.mrope_section} must sum to head_dim // 2 = {config.head_dim // 2}")
        self.config = config
        self.kv_groups = tuple(kv_groups)
        self.windows = tuple(self.kv_groups[g].sliding_window for g in config.layer_groups)  # [num_layers]
        self.device = torch.device(device)
        self.cross_group = next((g for g, group in enumerate(self.kv_groups) if group.kind == "cross_attention"), None)
        if self.cross_group in config.layer_groups:
            raise ValueError(f"layer_groups {config.layer_groups}: group {self.cross_group} holds the encoder's KV")
        if config.cross_attention and self.cross_group is None:
            raise ValueError("cross_attention needs a cross_attention KV group for the encoder's KV")
        self._weights32 = _init_weights(config)
        self._cross32 = _init_cross_weights(config) if config.cross_attention else []
        self.mamba_group = next((g for g, group in enumerate(self.kv_groups) if group.kind == "mamba"), None)
        if self.mamba_group in config.layer_groups or (config.mamba and self.mamba_group is None):
            raise ValueError(f"a mamba group holds the recurrent sublayers' states, not a layer's KV: {config}")
        recurrent = (config.num_layers, config.hidden_size, config.state_size, config.seed)
        self._recurrent32 = init_recurrent_weights(*recurrent) if config.mamba else []
        self._by_dtype: dict[torch.dtype, tuple[torch.Tensor, list[_Layer], torch.Tensor, torch.Tensor]] = {}

    def _weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, list[_Layer], torch.Tensor, torch.Tensor]:
        if dtype not in self._by_dtype:
            embed, layers, norm, head = self._weights32
            dev = self.device
            self._by_dtype[dtype] = (embed.to(dev, dtype), [la.to(dtype, dev) for la in layers],
                                     norm.to(dev, dtype), head.to(dev, dtype))  # fmt: skip
        return self._by_dtype[dtype]

    def forward_paged(
        self,
        batch: BatchInputs,
        kv: PagedKV,
        encoder_ids: Sequence[int] = (),  # [sum(scheduled_encoder_lens)] the encoder inputs of the rows it runs for
    ) -> torch.Tensor:  # [num_reqs, vocab] in kv.dtype
        """One engine step in the caches' dtype (float32 normally; float64 to replay a step as a reference)."""
        cfg = self.config
        embed, layers, final_norm, lm_head = self._weights(kv.dtype)
        cross = self._cross_step(batch, kv, encoder_ids) if cfg.cross_attention else None
        recur = self._recurrent_step(batch, kv) if cfg.mamba else None
        input_ids = kv.index_tensor(batch.input_ids)  # [T]
        positions = kv.index_tensor(batch.positions)  # [T]
        num_tokens = input_ids.shape[0]
        if cfg.mrope_section is not None:  # the three M-RoPE rows instead (spec/mrope.py)
            if batch.mrope_positions is None:
                raise ValueError("mrope_section needs BatchInputs.mrope_positions (WorkerConfig.uses_mrope)")
            positions = kv.index_tensor(batch.mrope_positions)  # [3, T]
        cos, sin = self._rope(positions, kv.dtype)
        x = embed[input_ids]  # [T, D]
        for layer_idx, (layer, window) in enumerate(zip(layers, self.windows, strict=True)):
            g = cfg.layer_groups[layer_idx]
            h = _rms_norm(x, layer.attn_norm, cfg.rms_eps)
            q = _apply_rope((h @ layer.wq).view(num_tokens, cfg.num_heads, cfg.head_dim), cos, sin)
            k = _apply_rope((h @ layer.wk).view(num_tokens, cfg.num_kv_heads, cfg.head_dim), cos, sin)
            v = (h @ layer.wv).view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            kv.write(layer_idx, k, v, batch.slot_mappings[g])
            attn = kv.attend(
                layer_idx, q, batch.block_tables[g], batch.seq_lens, batch.query_start_loc,
                scale=1.0 / math.sqrt(cfg.head_dim), sliding_window=window,
            )  # [T, H, hd]  # fmt: skip
            x = x + attn.reshape(num_tokens, cfg.num_heads * cfg.head_dim) @ layer.wo
            if cross is not None:
                x = x + cross(layer_idx, x)
            if recur is not None:
                x = x + recur(layer_idx, x)
            x = x + _mlp(_rms_norm(x, layer.mlp_norm, cfg.rms_eps), layer)
        last = x[kv.index_tensor(batch.logits_indices).long()]  # [num_reqs, D]: only rows that sample
        return _rms_norm(last, final_norm, cfg.rms_eps) @ lm_head

    def _cross_step(
        self, batch: BatchInputs, kv: PagedKV, encoder_ids: Sequence[int]
    ) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """Write the step's encoder K/V at cross_slot_mapping; return layer -> its cross-attention sublayer."""
        cfg, cross = self.config, self._cross_weights(kv.dtype)
        lens = kv.index_tensor(batch.scheduled_encoder_lens).long()  # [num_reqs] encoder tokens written now
        if len(encoder_ids) != int(lens.sum()):
            raise ValueError(f"{len(encoder_ids)} encoder ids for {int(lens.sum())} encoder tokens written this step")
        ids = torch.as_tensor(list(encoder_ids), dtype=torch.long, device=self.device)  # [n_enc]
        starts = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)  # [n_enc] each token's row start
        states = self._encode(ids, torch.arange(ids.numel(), device=self.device) - starts, kv.dtype)  # [n_enc, D]
        g, n = self.cross_group, ids.numel()
        if g is None:  # refused when the model is built; here for the type checker
            raise ValueError("cross_attention needs a cross_attention KV group")
        for layer_idx, c in enumerate(cross):
            k = (states @ c.wk).view(n, cfg.num_kv_heads, cfg.head_dim)
            v = (states @ c.wv).view(n, cfg.num_kv_heads, cfg.head_dim)
            kv.write_cross(layer_idx, k, v, batch.cross_slot_mapping)

        def sublayer(layer_idx: int, x: torch.Tensor) -> torch.Tensor:
            c = cross[layer_idx]
            q = (_rms_norm(x, c.norm, cfg.rms_eps) @ c.wq).view(x.shape[0], cfg.num_heads, cfg.head_dim)
            out = kv.attend_cross(layer_idx, q, batch.block_tables[g], batch.encoder_seq_lens, batch.query_start_loc,
                                  scale=1.0 / math.sqrt(cfg.head_dim))  # fmt: skip
            return out.reshape(x.shape[0], cfg.num_heads * cfg.head_dim) @ c.wo

        return sublayer

    def _recurrent_weights(self, dtype: torch.dtype) -> list[RecurrentLayer]:
        return [r.to(dtype, self.device) for r in self._recurrent32]

    def _recurrent_step(self, batch: BatchInputs, kv: PagedKV) -> Callable[[int, torch.Tensor], torch.Tensor]:
        g = self.mamba_group
        if g is None:  # refused when the model is built; here for the type checker
            raise ValueError("a hybrid model needs a mamba KV group for its states")
        layers = self._recurrent_weights(kv.dtype)
        return recurrent_step(layers, batch, kv, g, self.kv_groups[g].num_blocks, self.config.rms_eps)

    def _encode(self, ids: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The tiny encoder: embedding plus sinusoidal positions (within each request's input), RMS-normed."""
        embed = self._weights(dtype)[0]
        d = self.config.hidden_size
        freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64, device=self.device) / d)  # [D/2]
        angles = positions.to(torch.float64)[:, None] * freq[None, :]  # [n, D/2]
        sinusoid = torch.cat([angles.sin(), angles.cos()], dim=-1).to(dtype)  # [n, D]
        return _rms_norm(embed[ids] + sinusoid, torch.ones(d, dtype=dtype, device=self.device), self.config.rms_eps)

    def _cross_weights(self, dtype: torch.dtype) -> list[_CrossLayer]:
        return [c.to(dtype, self.device) for c in self._cross32]

    def forward_dense(
        self,
        token_ids: Sequence[int],
        dtype: torch.dtype = torch.float64,
        mrope_positions: np.ndarray | None = None,
        encoder_ids: Sequence[int] = (),  # with cross_attention: the request's whole encoder input
    ) -> torch.Tensor:
        """Logits [L, vocab] at every position of one whole sequence, no cache: position p predicts token p+1.

        With mrope_section, `mrope_positions` [3, L] are the rotary positions (sequence_mrope_positions)."""
        cfg = self.config
        embed, layers, final_norm, lm_head = self._weights(dtype)
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=self.device)  # [L]
        length = ids.shape[0]
        positions = torch.arange(length, device=self.device)  # [L]
        if cfg.mrope_section is not None and mrope_positions is None:
            raise ValueError("a model with mrope_section needs the sequence's mrope_positions [3, L]")
        rotary = positions if cfg.mrope_section is None else torch.as_tensor(mrope_positions, device=self.device)
        cos, sin = self._rope(rotary, dtype)
        x = embed[ids]
        group = cfg.num_heads // cfg.num_kv_heads
        cross = self._cross_weights(dtype)
        recurrent = self._recurrent_weights(dtype)
        if cfg.cross_attention:
            enc_ids = torch.as_tensor(list(encoder_ids), dtype=torch.long, device=self.device)  # [L_enc]
            states = self._encode(enc_ids, torch.arange(enc_ids.numel(), device=self.device), dtype)  # [L_enc, D]
        for layer_idx, (layer, window) in enumerate(zip(layers, self.windows, strict=True)):
            h = _rms_norm(x, layer.attn_norm, cfg.rms_eps)
            q = _apply_rope((h @ layer.wq).view(length, cfg.num_heads, cfg.head_dim), cos, sin)
            k = _apply_rope((h @ layer.wk).view(length, cfg.num_kv_heads, cfg.head_dim), cos, sin)
            v = (h @ layer.wv).view(length, cfg.num_kv_heads, cfg.head_dim)
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, H, hd]
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(cfg.head_dim)
            visible = positions[None, :] <= positions[:, None]  # [L, L] causal
            if window is not None:
                visible &= positions[None, :] > positions[:, None] - window
            weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            attn = torch.einsum("hqk,khd->qhd", weights, v)
            x = x + attn.reshape(length, cfg.num_heads * cfg.head_dim) @ layer.wo
            if cross:  # every position sees every encoder state: no mask
                c = cross[layer_idx]
                q = (_rms_norm(x, c.norm, cfg.rms_eps) @ c.wq).view(length, cfg.num_heads, cfg.head_dim)
                ek = (states @ c.wk).view(-1, cfg.num_kv_heads, cfg.head_dim).repeat_interleave(group, dim=1)
                ev = (states @ c.wv).view(-1, cfg.num_kv_heads, cfg.head_dim).repeat_interleave(group, dim=1)
                w = torch.softmax(torch.einsum("qhd,khd->hqk", q, ek) / math.sqrt(cfg.head_dim), dim=-1)
                x = x + torch.einsum("hqk,khd->qhd", w, ev).reshape(length, cfg.num_heads * cfg.head_dim) @ c.wo
            if recurrent:
                x = x + dense_recurrence(recurrent[layer_idx], x, cfg.rms_eps)
            x = x + _mlp(_rms_norm(x, layer.mlp_norm, cfg.rms_eps), layer)
        return _rms_norm(x, final_norm, cfg.rms_eps) @ lm_head

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, hd/2] at `positions` [T] (or M-RoPE's [3, T]: frequency pair i rotates by the row its
        mrope_section gives it, as vLLM's MRotaryEmbedding), in float64 so both forwards see the same angles."""
        half = self.config.head_dim // 2
        inv_freq = self.config.rope_theta ** (-torch.arange(half, dtype=torch.float64, device=positions.device) / half)
        if positions.dim() == 1:
            angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
        else:
            section = self.config.mrope_section or (half, 0, 0)
            row_of_pair = torch.repeat_interleave(torch.arange(3, device=positions.device), torch.tensor(section))
            angles = positions.to(torch.float64)[row_of_pair].T * inv_freq[None, :]  # [T, hd/2]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def dense_logit_tolerance(reference_logits: torch.Tensor, config: ModelConfig) -> float:
    """Largest |float32 paged logit - float64 dense logit| accepted, for logits of scale `reference_logits`.

    Rounding error of a float32 forward grows with the length of each dot product (~sqrt(n) eps for
    random-sign terms) and with the number of matmuls chained in sequence (4 per layer: qkv, o,
    gate/up, down; plus the head), relative to the logits' scale:
        tol = 2 * eps32 * sqrt(widest dot product) * chained matmuls * max(1, max|logit|)
    the 2 covering the paged kernels' different summation order (per block, online softmax). For the
    default config that is ~3.5e-5 * scale; observed errors are 50-100x smaller, while a wrong slot,
    position, table entry or window moves logits by O(0.1-1).
    """
    chained = 4 * config.num_layers + 1
    width = max(config.hidden_size, config.intermediate_size, config.num_heads * config.head_dim)
    scale = max(1.0, float(reference_logits.abs().max()))
    return 2.0 * FLOAT32_EPS * math.sqrt(width) * chained * scale


def sequence_mrope_positions(table: object, delta: int, length: int) -> np.ndarray:
    """[3, length] int64: a whole sequence's M-RoPE positions for the dense forward, from its request's table
    (None for text) and delta: the table over the prompt, then p + delta on every row."""
    prompt = np.zeros((3, 0), np.int64) if table is None else np.asarray(table, np.int64)
    past = np.arange(prompt.shape[1], length, dtype=np.int64) + delta  # [length - prompt_len]
    return np.concatenate([prompt, np.broadcast_to(past, (3, past.size))], axis=1)


def encoder_input_ids(prompt: Sequence[int], length: int, vocab_size: int) -> tuple[int, ...]:
    """A request's encoder input, derived from its prompt (a stand-in for audio frames or image patches)."""
    return tuple((7 * prompt[i % len(prompt)] + i) % vocab_size for i in range(length)) if prompt else ()


@dataclass
class _CrossLayer:
    norm: torch.Tensor  # [D]
    wq: torch.Tensor  # [D, H * hd]
    wk: torch.Tensor  # [D, KVH * hd], applied to the encoder's states
    wv: torch.Tensor  # [D, KVH * hd]
    wo: torch.Tensor  # [H * hd, D]

    def to(self, dtype: torch.dtype, device: torch.device) -> _CrossLayer:
        return _CrossLayer(**{k: v.to(dtype=dtype, device=device) for k, v in vars(self).items()})


def _init_cross_weights(config: ModelConfig) -> list[_CrossLayer]:
    """The cross-attention sublayers' weights, from a generator of their own: the decoder's stay as they were."""
    gen = torch.Generator().manual_seed(config.seed + 1)
    d = config.hidden_size
    q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    return [
        _CrossLayer(
            norm=1.0 + normal(d, std=0.1),
            wq=normal(d, q_width, std=d**-0.5),
            wk=normal(d, kv_width, std=d**-0.5),
            wv=normal(d, kv_width, std=d**-0.5),
            wo=normal(q_width, d, std=q_width**-0.5),
        )
        for _ in range(config.num_layers)
    ]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on x [T, heads, hd] with cos/sin [T, hd/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _mlp(x: torch.Tensor, layer: _Layer) -> torch.Tensor:
    return (torch.nn.functional.silu(x @ layer.w_gate) * (x @ layer.w_up)) @ layer.w_down


def _init_weights(config: ModelConfig) -> tuple[torch.Tensor, list[_Layer], torch.Tensor, torch.Tensor]:
    """float32 weights from a seeded generator: identical on every machine and device."""
    gen = torch.Generator().manual_seed(config.seed)
    d, i = config.hidden_size, config.intermediate_size
    q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    def norm_weight() -> torch.Tensor:
        return 1.0 + normal(d, std=0.1)

    embed = normal(config.vocab_size, d, std=1.0)
    layers = [
        _Layer(
            attn_norm=norm_weight(),
            wq=normal(d, q_width, std=d**-0.5),
            wk=normal(d, kv_width, std=d**-0.5),
            wv=normal(d, kv_width, std=d**-0.5),
            wo=normal(q_width, d, std=q_width**-0.5),
            mlp_norm=norm_weight(),
            w_gate=normal(d, i, std=d**-0.5),
            w_up=normal(d, i, std=d**-0.5),
            w_down=normal(i, d, std=i**-0.5),
        )
        for _ in range(config.num_layers)
    ]
    return embed, layers, norm_weight(), normal(d, config.vocab_size, std=d**-0.5)
