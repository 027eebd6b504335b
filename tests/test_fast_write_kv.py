"""fast.write_kv against spec.write_kv, bit for bit, in both CPU modes (host mode and Triton's interpreter)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spec
from fast.kv_cache import write_kv
from fast.runtime import HAVE_TRITON, interpret
from spec.types import PAD_SLOT_ID

_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _bits(x: torch.Tensor) -> np.ndarray:
    """The raw bits as NumPy integers: spec copies them like any array, and NaN payloads compare exactly."""
    return x.view(_BITS[x.dtype]).numpy()


def _case(
    seed: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, num_tokens: int,
    num_pad: int, dtype: torch.dtype,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    rng = np.random.default_rng(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = (torch.from_numpy(rng.standard_normal(shape)).to(dtype) for _ in range(2))
    key, value = (torch.from_numpy(rng.standard_normal((num_tokens, num_kv_heads, head_dim))).to(dtype) for _ in "kv")
    slots = rng.choice(num_blocks * block_size, size=num_tokens, replace=False)  # no two tokens share a slot
    slots[rng.permutation(num_tokens)[:num_pad]] = PAD_SLOT_ID
    return key_cache, value_cache, key, value, torch.from_numpy(slots.astype(np.int64))


def _check_against_spec(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    # spec in float32 (NumPy has no bfloat16): every float16/bfloat16 value is exact in float32, and a write
    # is a copy, so the float32 images must be equal bit for bit
    expected_k, expected_v = key_cache.float().numpy().copy(), value_cache.float().numpy().copy()
    spec.write_kv(expected_k, expected_v, key.float().numpy(), value.float().numpy(), slot_mapping.numpy())
    write_kv(key_cache, value_cache, key, value, slot_mapping)
    np.testing.assert_array_equal(key_cache.float().numpy(), expected_k)
    np.testing.assert_array_equal(value_cache.float().numpy(), expected_v)


@pytest.mark.parametrize(
    ("num_blocks", "block_size", "num_kv_heads", "head_dim", "num_tokens", "num_pad"),
    [
        (6, 4, 2, 12, 9, 3),  # head_dim not a power of two
        (5, 16, 3, 80, 20, 0),  # 3 heads, head_dim 80
        (3, 5, 1, 64, 15, 15),  # odd block size; every token is padding
        (8, 2, 4, 7, 1, 0),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_kv_matches_spec(
    mode: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, num_tokens: int, num_pad: int,
    dtype: torch.dtype,
) -> None:  # fmt: skip
    _check_against_spec(*_case(num_tokens, num_blocks, block_size, num_kv_heads, head_dim, num_tokens, num_pad, dtype))


@settings(deadline=None)  # the CPU's speed is shared with other jobs: no per-example deadline
@given(
    seed=st.integers(0, 2**32 - 1),
    num_blocks=st.integers(2, 8),
    block_size=st.integers(1, 8),
    num_kv_heads=st.integers(1, 4),
    head_dim=st.integers(1, 40),
    data=st.data(),
)
def test_write_kv_matches_spec_property(
    seed: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, data: st.DataObject
) -> None:
    num_tokens = data.draw(st.integers(0, num_blocks * block_size), label="num_tokens")
    num_pad = data.draw(st.integers(0, num_tokens), label="num_pad")
    with interpret(False):  # the interpreter is too slow for many examples; the parametrized test covers it
        _check_against_spec(*_case(seed, num_blocks, block_size, num_kv_heads, head_dim, num_tokens, num_pad,
                                   torch.float32))  # fmt: skip


def test_write_kv_strided_cache(mode: str) -> None:
    """A cache whose blocks are padded (not contiguous) is addressed through its strides."""
    key_cache, value_cache, key, value, slots = _case(7, 6, 4, 2, 12, 10, 2, torch.float32)
    padded_k = torch.full((6, 5, 2, 12), 7.0)
    padded_v = torch.full((6, 5, 2, 12), 7.0)
    strided_k, strided_v = padded_k[:, :4], padded_v[:, :4]
    strided_k.copy_(key_cache)
    strided_v.copy_(value_cache)
    assert not strided_k.is_contiguous()
    _check_against_spec(strided_k, strided_v, key, value, slots)
    assert (padded_k[:, 4] == 7.0).all() and (padded_v[:, 4] == 7.0).all()  # the padding stays untouched


def test_write_kv_int32_slots(mode: str) -> None:
    """int32 slot mappings (with padding and without) write what spec writes with the same slots."""
    for num_pad in (0, 4):
        key_cache, value_cache, key, value, slots = _case(11 + num_pad, 6, 4, 2, 12, 10, num_pad, torch.float16)
        _check_against_spec(key_cache, value_cache, key, value, slots.to(torch.int32))


@pytest.mark.parametrize("num_pad", [0, 2])  # without padding, and with it (the path that selects real tokens)
@pytest.mark.parametrize("bad_slot", [6 * 4, -2])
def test_write_kv_rejects_slots_outside_the_cache(mode: str, bad_slot: int, num_pad: int) -> None:
    key_cache, value_cache, key, value, slots = _case(3, 6, 4, 2, 12, 5, 0, torch.float32)
    slots[:num_pad] = PAD_SLOT_ID
    slots[2] = bad_slot
    before_k, before_v = key_cache.clone(), value_cache.clone()
    with pytest.raises(ValueError, match="outside"):
        write_kv(key_cache, value_cache, key, value, slots)
    with pytest.raises(ValueError, match="outside"):
        spec.write_kv(key_cache.numpy().copy(), value_cache.numpy().copy(), key.numpy(), value.numpy(), slots.numpy())
    assert torch.equal(key_cache, before_k) and torch.equal(value_cache, before_v)


def test_write_kv_rejects_bad_shapes_and_dtypes(mode: str) -> None:
    key_cache, value_cache, key, value, slots = _case(4, 6, 4, 2, 12, 5, 0, torch.float32)
    with pytest.raises(ValueError, match="key/value"):
        write_kv(key_cache, value_cache, key[:, :1], value[:, :1], slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(key_cache, value_cache, key, value, slots[:4])
    with pytest.raises(ValueError, match="key is float16, key_cache float32"):
        write_kv(key_cache, value_cache, key.half(), value.half(), slots)
    with pytest.raises(ValueError, match="int64"):
        write_kv(key_cache, value_cache, key, value, slots.float())


@pytest.mark.interpret
@pytest.mark.skipif(not HAVE_TRITON, reason="Triton is not installed on this platform")
def test_write_kv_kernel_slot_beyond_int32() -> None:
    """A slot past 2**31 in a cache of 2**31 + 32 slots, without allocating it: every block aliases one block
    of memory (block stride 0), so only the kernel's slot arithmetic (load, // and % in int64) is exercised.
    A slot truncated to int32 would turn negative and be skipped as padding; this test would then fail."""
    block_size, num_kv_heads, head_dim = 16, 2, 12
    num_blocks = 2**31 // block_size + 2
    shape, strides = (num_blocks, block_size, num_kv_heads, head_dim), (0, num_kv_heads * head_dim, head_dim, 1)
    key_memory, value_memory = (torch.zeros(block_size * num_kv_heads * head_dim) for _ in "kv")
    key_cache = torch.as_strided(key_memory, shape, strides)
    value_cache = torch.as_strided(value_memory, shape, strides)
    key, value = torch.randn(2, num_kv_heads, head_dim), torch.randn(2, num_kv_heads, head_dim)
    slot = 2**31 + 5  # block 2**27, offset 5
    with interpret(True):
        write_kv(key_cache, value_cache, key, value, torch.tensor([slot, PAD_SLOT_ID]))
    expected_k = torch.zeros(block_size, num_kv_heads, head_dim)
    expected_k[slot % block_size] = key[0]
    expected_v = torch.zeros(block_size, num_kv_heads, head_dim)
    expected_v[slot % block_size] = value[0]
    assert torch.equal(key_memory.view(block_size, num_kv_heads, head_dim), expected_k)
    assert torch.equal(value_memory.view(block_size, num_kv_heads, head_dim), expected_v)
