"""write_kv and paged_attention accept and refuse the same inputs in spec and fast (every mode), with a
ValueError naming the argument, and give the same answer on non-finite inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import spec
from fast.attention import paged_attention
from fast.kv_cache import write_kv


def _kv_inputs() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {
        "key_cache": torch.zeros(4, 4, 2, 8),
        "value_cache": torch.zeros(4, 4, 2, 8),
        "key": torch.randn(3, 2, 8, generator=gen),
        "value": torch.randn(3, 2, 8, generator=gen),
        "slot_mapping": torch.tensor([5, -1, 9]),
    }


KV_BAD: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "mixed dtype": (lambda a: a.update(key=a["key"].double(), value=a["value"].double()), "key is float64"),
    "value_cache dtype": (lambda a: a.update(value_cache=a["value_cache"].double()), "value_cache is float64"),
    "int caches": (
        lambda a: a.update({k: a[k].long() for k in ("key_cache", "value_cache", "key", "value")}),
        "key_cache must hold floats",
    ),
    "float slots": (lambda a: a.update(slot_mapping=a["slot_mapping"].double()), "slot_mapping must be int32"),
    "int16 slots": (lambda a: a.update(slot_mapping=a["slot_mapping"].short()), "slot_mapping must be int32"),
    "short slots": (lambda a: a.update(slot_mapping=a["slot_mapping"][:2]), "slot_mapping"),
    "3-d cache": (lambda a: a.update(key_cache=a["key_cache"][0], value_cache=a["value_cache"][0]), "4-d"),
    "key heads": (lambda a: a.update(key=a["key"][:, :1], value=a["value"][:, :1]), "key/value"),
    "cache strides differ": (
        lambda a: a.update(value_cache=a["value_cache"].transpose(0, 1).contiguous().transpose(0, 1)),
        "value_cache strides",
    ),
    "head_dim strided": (
        lambda a: a.update(**{k: torch.zeros(4, 4, 2, 16)[..., ::2] for k in ("key_cache", "value_cache")}),
        "contiguous along head_dim",
    ),
}


def _numpy(args: dict[str, Any]) -> dict[str, Any]:
    return {k: v.numpy() for k, v in args.items()}


@pytest.mark.parametrize("case", list(KV_BAD))
def test_write_kv_refuses_alike(mode: str, case: str) -> None:
    args = _kv_inputs()
    mutate, message = KV_BAD[case]
    mutate(args)
    with pytest.raises(ValueError, match=message):
        spec.write_kv(**_numpy(args))
    with pytest.raises(ValueError, match=message):
        write_kv(**args)


def test_write_kv_lands_in_a_non_mergeable_view(mode: str) -> None:
    """`cache[:, :2]`: block and offset axes cannot merge into one slot axis; both backends write in place."""
    args = _kv_inputs()
    parents = {k: torch.zeros(4, 8, 2, 8) for k in ("key_cache", "value_cache")}
    views = {k: p[:, :4] for k, p in parents.items()}
    arrays = {k: p.numpy().copy() for k, p in parents.items()}
    spec.write_kv(arrays["key_cache"][:, :4], arrays["value_cache"][:, :4], args["key"].numpy(),
                  args["value"].numpy(), args["slot_mapping"].numpy())  # fmt: skip
    write_kv(views["key_cache"], views["value_cache"], args["key"], args["value"], args["slot_mapping"])
    for k in parents:
        np.testing.assert_array_equal(parents[k].numpy(), arrays[k])
    assert torch.equal(parents["key_cache"][1, 1], args["key"][0])  # slot 5 = block 1, offset 1
    assert torch.equal(parents["value_cache"][2, 1], args["value"][2])  # slot 9 = block 2, offset 1


def test_write_kv_accepts_strided_new_keys(mode: str) -> None:
    """key/value with any strides (spec takes any NumPy layout): fast copies them for the kernel if needed."""
    args = _kv_inputs()
    wide = torch.randn(3, 2, 16)
    args["key"], args["value"] = wide[..., ::2], wide[..., 1::2]
    want = _numpy(args)
    want = {k: v.copy() for k, v in want.items()}
    spec.write_kv(**want)
    write_kv(**args)
    np.testing.assert_array_equal(args["key_cache"].numpy(), want["key_cache"])
    np.testing.assert_array_equal(args["value_cache"].numpy(), want["value_cache"])


def _attention_inputs() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    return {
        "query": torch.randn(5, 4, 8, generator=gen),
        "key_cache": torch.randn(6, 4, 2, 8, generator=gen),
        "value_cache": torch.randn(6, 4, 2, 8, generator=gen),
        "block_table": torch.tensor([[1, 2, 0], [3, 4, 5]], dtype=torch.int32),
        "seq_lens": torch.tensor([7, 10], dtype=torch.int32),
        "query_start_loc": torch.tensor([0, 1, 5], dtype=torch.int32),
        "scale": 0.35,
    }


ATTENTION_BAD: dict[str, tuple[dict[str, Any], str]] = {
    "softcap 0": ({"softcap": 0.0}, "softcap must be a finite number > 0"),
    "softcap -1": ({"softcap": -1.0}, "softcap must be a finite number > 0"),
    "softcap nan": ({"softcap": float("nan")}, "softcap must be a finite number > 0"),
    "softcap inf": ({"softcap": float("inf")}, "softcap must be a finite number > 0"),
    "window 0": ({"sliding_window": 0}, "sliding_window must be an int >= 1"),
    "window 1.5": ({"sliding_window": 1.5}, "sliding_window must be an int >= 1"),
    "window True": ({"sliding_window": True}, "sliding_window must be an int >= 1"),
    "scale str": ({"scale": "1"}, "scale must be a real number"),
}


def _mixed(args: dict[str, Any]) -> None:
    args["key_cache"] = args["key_cache"].double()


ATTENTION_BAD_TENSORS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "mixed dtype": (_mixed, "key_cache is float64, query float32"),
    "int query": (
        lambda a: a.update({k: a[k].long() for k in ("query", "key_cache", "value_cache")}),
        "query must hold floats",
    ),
    "float table": (lambda a: a.update(block_table=a["block_table"].float()), "block_table must be int32"),
    "short query_start_loc": (lambda a: a.update(query_start_loc=a["query_start_loc"][:2]), "query_start_loc"),
    "heads": (lambda a: a.update(query=a["query"][:, :3]), "does not fit"),
    "cache strides differ": (
        lambda a: a.update(value_cache=a["value_cache"].transpose(0, 1).contiguous().transpose(0, 1)),
        "value_cache strides",
    ),
    "out rows": (lambda a: a.update(out=torch.zeros(6, 4, 8)), r"out must be \(5, 4, 8\) float32 like query"),
    "out dtype": (lambda a: a.update(out=torch.zeros(5, 4, 8, dtype=torch.float64)), "got .* float64"),
}


def _run_both(args: dict[str, Any]) -> tuple[Callable[[], Any], Callable[[], Any]]:
    tensors = {k: v for k, v in args.items() if isinstance(v, torch.Tensor)}
    options = {k: v for k, v in args.items() if not isinstance(v, torch.Tensor)}
    return (lambda: spec.paged_attention(**_numpy(tensors), **options), lambda: paged_attention(**args))


@pytest.mark.parametrize("case", list(ATTENTION_BAD) + list(ATTENTION_BAD_TENSORS))
def test_paged_attention_refuses_alike(mode: str, case: str) -> None:
    args = _attention_inputs()
    if case in ATTENTION_BAD:
        update, message = ATTENTION_BAD[case]
        args.update(update)
    else:
        mutate, message = ATTENTION_BAD_TENSORS[case]
        mutate(args)
    for run in _run_both(args):
        with pytest.raises(ValueError, match=message):
            run()


def test_paged_attention_out_receives_the_answer(mode: str) -> None:
    """Both backends write into `out` (full of an earlier call's values here) and return it: the same answer."""
    args = _attention_inputs()
    expected_spec, expected_fast = (run() for run in _run_both(args))
    args["out"] = torch.full_like(args["query"], float("nan"))
    spec_args = {k: v for k, v in args.items() if k != "out"}
    spec_out = args["out"].numpy().copy()
    tensors = {k: v for k, v in spec_args.items() if isinstance(v, torch.Tensor)}
    options = {k: v for k, v in spec_args.items() if not isinstance(v, torch.Tensor)}
    assert spec.paged_attention(**_numpy(tensors), **options, out=spec_out) is spec_out
    np.testing.assert_array_equal(spec_out, expected_spec)
    assert paged_attention(**args) is args["out"]
    assert torch.equal(args["out"], expected_fast)


@pytest.mark.parametrize("what", ["nan query", "nan scale", "inf query"])
def test_paged_attention_non_finite_inputs_agree(mode: str, what: str) -> None:
    """A NaN (or inf) in a row's logits makes the row NaN in spec; fast's torch path (SDPA gave zeros) and the
    kernel agree element for element on which outputs are NaN. Batch row 0 decodes, row 1 has 4 queries."""
    args = _attention_inputs()
    if what == "nan query":
        args["query"][0, 1, 3] = float("nan")  # the decode row's head 1
        args["query"][3, 2, 0] = float("nan")  # a prefill row's head 2
    elif what == "inf query":
        args["query"][2, 0, 5] = float("inf")
    else:
        args["scale"] = float("nan")
    spec_run, fast_run = _run_both(args)
    want = np.isnan(spec_run())
    assert want.any()
    np.testing.assert_array_equal(torch.isnan(fast_run()).numpy(), want)
