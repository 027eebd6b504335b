"""Every Triton kernel of fast.kernels compiled ahead of time for real GPUs (sm_80, sm_90), with no GPU present.

Triton's interpreter accepts code and resource use that compiled Triton may reject or run slowly, so each
configuration fast launches is compiled with the ptxas Triton ships and its resource use read from the
cubin: it must compile, use no stack (no spill), and stay within the kernel's register budget.

The launch arguments are not written here: each case calls the real launcher (on meta or small CPU tensors)
with the kernel's launch intercepted, so the constexprs, tile sizes, num_warps and the integer widths Triton
specialises on (an int64 slot count past 2**31, say) are exactly what fast would launch. Cases that
compile to the same kernel (head_dim 96 and 128 share BLOCK_D, for one) are compiled once per session.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import itertools
import os
import pkgutil
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from fast.runtime import HAVE_TRITON, Kernel, interpret
from spec.types import KVCacheGroup, WorkerConfig

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="Triton is not installed on this platform")

ARCHS = (80, 90)  # A100, H100/H200
# Registers per thread each kernel may use: with the 4 warps (128 threads) of a CTA that leaves room for
# at least 4 resident CTAs per SM (65536 registers) for attention, and many more for the memory-bound ones.
REGISTER_BUDGET = {
    "_paged_attention_kernel": 128,
    "_write_kv_kernel": 64,
    "_prepare_kernel": 64,
    "_apply_writes_kernel": 64,
    "_check_sampled_kernel": 64,
    "_append_sampled_kernel": 64,
    "_mrope_positions_kernel": 64,
    "_mamba_state_indices_kernel": 64,
    "_cp_slot_mapping_kernel": 64,
    "_write_mla_kv_kernel": 64,
    "_mla_decode_kernel": 192,  # 8 warps: a [16, 512] float32 accumulator and query tile live across the loop
}


@dataclass(frozen=True)
class Launch:
    kernel: Kernel
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @property
    def jit(self) -> Any:  # the triton.jit function (HAVE_TRITON is checked by the module's skip mark)
        return self.kernel.compiled


@contextlib.contextmanager
def captured_launches() -> Iterator[list[Launch]]:
    """Launchers run as written, but `kernel[grid](...)` records its arguments instead of running."""
    launches: list[Launch] = []
    original = Kernel.__getitem__

    def record(self: Kernel, grid: Any) -> Callable[..., None]:
        return lambda *args, **kwargs: launches.append(Launch(self, args, kwargs))

    Kernel.__getitem__ = record  # type: ignore[method-assign]
    try:
        with interpret(False):  # the compiled flavour's choices (FP32_DOT differs under the interpreter)
            yield launches
    finally:
        Kernel.__getitem__ = original  # type: ignore[method-assign]


def _only(launches: list[Launch]) -> Launch:
    if len(launches) != 1:
        raise AssertionError(f"expected one launch, got {len(launches)}")
    return launches[0]


# ---- the configurations fast launches, each through its launcher -------------------------------------------------


def write_kv_launch(
    dtype: torch.dtype, head_dim: int, num_kv_heads: int, slot_dtype: torch.dtype, slots: int
) -> Launch:
    from fast.kernels.write_kv import write_kv_triton

    block_size = 16
    cache = torch.empty((slots // block_size, block_size, num_kv_heads, head_dim), dtype=dtype, device="meta")
    key = torch.empty((4, num_kv_heads, head_dim), dtype=dtype, device="meta")
    with captured_launches() as launches:
        write_kv_triton(cache, cache, key, key, torch.empty(4, dtype=slot_dtype, device="meta"))
    return _only(launches)


def attention_launch(dtype: torch.dtype, head_dim: int, group: int, window: bool, softcap: bool) -> Launch:
    from fast.kernels.paged_attention import paged_attention_triton

    num_kv_heads, num_reqs, num_tokens = 2, 2, 6
    query = torch.empty((num_tokens, num_kv_heads * group, head_dim), dtype=dtype, device="meta")
    cache = torch.empty((64, 16, num_kv_heads, head_dim), dtype=dtype, device="meta")
    index = functools.partial(torch.empty, dtype=torch.int32, device="meta")
    with captured_launches() as launches:
        paged_attention_triton(
            torch.empty_like(query), query, cache, cache, index((num_reqs, 8)), index(num_reqs), index(num_reqs + 1),
            scale=0.1, sliding_window=64 if window else None, softcap=30.0 if softcap else None,
        )  # fmt: skip
    return _only(launches)


def fp8_write_kv_launch(fmt_name: str, dtype: torch.dtype, head_dim: int, num_kv_heads: int) -> Launch:
    """write_kv into an fp8 cache (uint8 codes) of more than 2**31 elements: the encoder and int64 offsets."""
    from fast.kernels.write_kv import write_kv_triton
    from spec.fp8 import E4M3, E5M2

    block_size, slots = 16, INT64_SLOTS
    cache = torch.empty((slots // block_size, block_size, num_kv_heads, head_dim), dtype=torch.uint8, device="meta")
    key = torch.empty((4, num_kv_heads, head_dim), dtype=dtype, device="meta")
    scale = torch.empty(num_kv_heads, dtype=torch.float32, device="meta")
    with captured_launches() as launches:
        write_kv_triton(cache, cache, key, key, torch.empty(4, dtype=torch.int32, device="meta"),
                        fmt=E4M3 if fmt_name == "e4m3" else E5M2, k_scale=scale, v_scale=scale)  # fmt: skip
    return _only(launches)


def fp8_attention_launch(fmt_name: str, dtype: torch.dtype, head_dim: int, group: int) -> Launch:
    """paged attention over an fp8 cache: the decoder, the folded scales."""
    from fast.kernels.paged_attention import paged_attention_triton
    from spec.fp8 import E4M3, E5M2

    num_kv_heads, num_reqs, num_tokens = 2, 2, 6
    query = torch.empty((num_tokens, num_kv_heads * group, head_dim), dtype=dtype, device="meta")
    cache = torch.empty((64, 16, num_kv_heads, head_dim), dtype=torch.uint8, device="meta")
    scale = torch.empty(num_kv_heads, dtype=torch.float32, device="meta")
    index = functools.partial(torch.empty, dtype=torch.int32, device="meta")
    with captured_launches() as launches:
        paged_attention_triton(
            torch.empty_like(query), query, cache, cache, index((num_reqs, 8)), index(num_reqs), index(num_reqs + 1),
            scale=0.1, sliding_window=None, softcap=None, fmt=E4M3 if fmt_name == "e4m3" else E5M2,
            k_scale=scale, v_scale=scale,
        )  # fmt: skip
    return _only(launches)


def _device_state(num_groups: int, num_blocks: int) -> Any:
    from fast.state import DeviceState

    groups = tuple(KVCacheGroup(16 + g, num_blocks) for g in range(num_groups))
    return DeviceState(WorkerConfig(8, 4096, 8192, 32000, groups), torch.device("meta"))


def prepare_launch(num_groups: int, num_blocks: int) -> Launch:
    from fast.kernels.prepare import output_sizes, prepare_triton

    num_reqs = 4
    batch = torch.empty(3 * num_reqs + 1, dtype=torch.int32, device="meta")
    dev = _device_state(num_groups, num_blocks)
    size64, size32 = output_sizes(dev, num_reqs, 128)
    out64 = torch.empty(size64, dtype=torch.int64, device="meta")
    out32 = torch.empty(size32, dtype=torch.int32, device="meta")
    with captured_launches() as launches:
        prepare_triton(dev, batch, num_reqs, 100, 128, out64, out32)
    return _only(launches)


def apply_writes_launch(num_groups: int) -> Launch:
    from fast.kernels.apply_writes import apply_writes_triton

    n_t, n_p, n_c, num_data = 2, 1, 3, 40  # ops of each kind, and data entries after them
    packed = torch.empty(6 * n_t + 4 * n_p + 2 * n_c + num_data, dtype=torch.int64, device="meta")
    with captured_launches() as launches:
        apply_writes_triton(_device_state(num_groups, 1000), packed, n_t, n_p, n_c, num_data)
    return _only(launches)


def record_ahead_launch(which: int, one_per_row: bool) -> Launch:
    """Async scheduling's record_sampled: launch `which` (0 check, 1 append), ids as [n] or [n, width]."""
    from fast.kernels.record_ahead import record_ahead_triton

    index = functools.partial(torch.empty, dtype=torch.int64, device="meta")
    m, rows = 6, 16
    tokens, store = index((8, 1 if one_per_row else 4)), torch.empty((rows, 256), dtype=torch.int32, device="meta")
    with captured_launches() as launches:
        record_ahead_triton(tokens, index(m), index(m), index(m), index(m), index(13), index(rows), index(rows),
                            store, one_per_row, 3, 32000, 4096)  # fmt: skip
    return launches[which]


def mrope_launch(num_tokens: int) -> Launch:
    """M-RoPE positions (fast/kernels/mrope.py) for a batch of 4 rows, tables of a 4096-column capacity."""
    from fast.kernels.mrope import mrope_positions_triton

    num_reqs, index = 4, functools.partial(torch.empty, device="meta")
    with captured_launches() as launches:
        mrope_positions_triton(
            index((3, num_tokens), dtype=torch.int64), index(num_tokens, dtype=torch.int64),
            index(num_reqs + 1, dtype=torch.int32), index(num_reqs, dtype=torch.int32),
            index((2, num_reqs), dtype=torch.int64), index((8, 3, 4096), dtype=torch.int64),
        )  # fmt: skip
    return _only(launches)


def mamba_state_indices_launch(num_speculative_blocks: int) -> Launch:
    from fast.kernels.mamba import mamba_state_indices_triton

    index = functools.partial(torch.empty, dtype=torch.int32, device="meta")
    with captured_launches() as launches:
        mamba_state_indices_triton(index((16, 10)), index(4), index(4), index(4), torch.empty((4, 4), dtype=torch.int64,
                                   device="meta"), 64, num_speculative_blocks)  # fmt: skip
    return _only(launches)


def cp_slot_mapping_launch(interleave: int) -> Launch:
    from fast.kernels.context_parallel import cp_slot_mapping_triton

    positions, index = torch.empty(300, dtype=torch.int64, device="meta"), functools.partial(torch.empty, device="meta")
    with captured_launches() as launches:
        cp_slot_mapping_triton(torch.empty_like(positions), positions, index(5, dtype=torch.int32),
                               index((4, 16), dtype=torch.int32), 16, 4, 1, interleave)  # fmt: skip
    return _only(launches)


def write_mla_kv_launch(dtype: torch.dtype, rank: int, rope_dim: int, slots: int) -> Launch:
    """MLA's latent write (fast/kernels/mla_cache.py): DeepSeek's 512 + 64, a NoPE latent, an int64 slot count."""
    from fast.kernels.mla_cache import write_mla_kv_triton

    cache = torch.empty((slots // 64, 64, rank + rope_dim), dtype=dtype, device="meta")
    with captured_launches() as launches:
        write_mla_kv_triton(cache, torch.empty((4, rank), dtype=dtype, device="meta"),
                            torch.empty((4, rope_dim), dtype=dtype, device="meta"),
                            torch.empty(4, dtype=torch.int64, device="meta"))  # fmt: skip
    return _only(launches)


def mla_decode_launch(dtype: torch.dtype, num_heads: int, rope_dim: int, fmt_name: str | None,
                      dcp: bool = False) -> Launch:  # fmt: skip
    """MLA's absorbed decode (fast/kernels/mla_attention.py) at DeepSeek's kv_lora_rank 512: its 16 heads per
    device under tensor parallelism, all 128 of one device, a NoPE latent, fp8 codes; with `dcp` one rank's
    partial state under decode context parallelism (DCP's positions, the LSE stored)."""
    from fast.kernels.mla_attention import mla_decode_triton
    from spec.context_parallel import ContextParallel
    from spec.fp8 import E4M3, E5M2

    num_reqs, num_tokens, rank = 2, 6, 512
    q_latent = torch.empty((num_tokens, num_heads, rank), dtype=dtype, device="meta")
    q_pe = torch.empty((num_tokens, num_heads, rope_dim), dtype=dtype, device="meta")
    cache = torch.empty((64, 16, rank + rope_dim), dtype=dtype if fmt_name is None else torch.uint8, device="meta")
    fmt = None if fmt_name is None else (E4M3 if fmt_name == "e4m3" else E5M2)
    index = functools.partial(torch.empty, dtype=torch.int32, device="meta")
    lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device="meta")  # [T, H]: the partial state's
    with captured_launches() as launches:
        mla_decode_triton(torch.empty_like(q_latent), q_latent, q_pe, cache, index((num_reqs, 8)), index(num_reqs),
                          index(num_reqs + 1), scale=0.1, fmt=fmt, k_scale=0.5,
                          cp=ContextParallel(4, 1, 2) if dcp else None, lse=lse if dcp else None)  # fmt: skip
    return _only(launches)


DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
HEAD_DIMS = (64, 96, 128)  # 96: not a power of two, the kernels mask the padded lanes
INT64_SLOTS = 2**31 + 2**20  # a cache with more slots than int32 holds: Triton passes the count as int64


GROUPS = (1, 4, 8)
FLAGS = tuple(itertools.product((False, True), (False, True)))  # (sliding window, softcap)
# SLOTMAP_COMPILE_ALL=1 compiles the full product (about 4 CPU-minutes); by default each arch gets a covering
# subset that fits CI: every dtype x head_dim x (window, softcap) on sm_90 (on sm_80 window and softcap both on
# or both off), the group rotating so that every pair of dtype, group and flags still meets, and write_kv's
# slot widths on one head count. Without a Triton cache that is about 50 CPU-seconds.
COMPILE_ALL = os.environ.get("SLOTMAP_COMPILE_ALL", "0") not in ("", "0")


def _cases() -> dict[str, tuple[Callable[[], Launch], tuple[int, ...]]]:
    """name -> (launch, archs)."""
    cases: dict[str, tuple[Callable[[], Launch], tuple[int, ...]]] = {}
    for (i, (name, dtype)), (j, head_dim), (k, group), (f, (window, softcap)) in itertools.product(
        enumerate(DTYPES.items()), enumerate(HEAD_DIMS), enumerate(GROUPS), enumerate(FLAGS)
    ):
        if not COMPILE_ALL and k != (i + j + f) % len(GROUPS):
            continue
        flags = f"{'window' if window else 'nowindow'}-{'softcap' if softcap else 'nosoftcap'}"
        launch = functools.partial(attention_launch, dtype, head_dim, group, window, softcap)
        archs = ARCHS if COMPILE_ALL or window == softcap else (90,)  # sm_80: both on, both off
        cases[f"attention-{name}-d{head_dim}-g{group}-{flags}"] = (launch, archs)
    for (name, dtype), head_dim, heads, (slot_name, slot_dtype), slots in itertools.product(
        DTYPES.items(), HEAD_DIMS, (1, 8, 32), (("i32", torch.int32), ("i64", torch.int64)), (2**16, INT64_SLOTS)
    ):
        if slot_dtype == torch.int32 and slots > 2**31:
            continue  # int32 slot ids cannot address such a cache
        if not COMPILE_ALL and (slot_dtype, slots) != (torch.int64, 2**16) and heads != 8:
            continue
        launch = functools.partial(write_kv_launch, dtype, head_dim, heads, slot_dtype, slots)
        cases[f"write_kv-{name}-d{head_dim}-h{heads}-{slot_name}slots-{slots}"] = (launch, ARCHS)
    for (i, fmt_name), (j, (name, dtype)) in itertools.product(enumerate(("e4m3", "e5m2")), enumerate(DTYPES.items())):
        head_dim, group = HEAD_DIMS[(i + j) % len(HEAD_DIMS)], GROUPS[(i + j) % len(GROUPS)]  # rotating, as above
        cases[f"write_kv-fp8{fmt_name}-{name}-d{head_dim}"] = (
            functools.partial(fp8_write_kv_launch, fmt_name, dtype, head_dim, 8),
            ARCHS,
        )
        cases[f"attention-fp8{fmt_name}-{name}-d{head_dim}-g{group}"] = (
            functools.partial(fp8_attention_launch, fmt_name, dtype, head_dim, group),
            ARCHS,
        )
    for groups, blocks in itertools.product((1, 3), (1000, 2**26 + 5)):  # 2**26 blocks of 16+: slots past 2**31
        cases[f"prepare-g{groups}-blocks{blocks}"] = (functools.partial(prepare_launch, groups, blocks), ARCHS)
    for groups in (1, 3):
        cases[f"apply_writes-g{groups}"] = (functools.partial(apply_writes_launch, groups), ARCHS)
    for spec_blocks in (0, 2):
        launch = functools.partial(mamba_state_indices_launch, spec_blocks)
        cases[f"mamba_state_indices-s{spec_blocks}"] = (launch, ARCHS)
    for interleave in (1, 4):
        cases[f"cp_slot_mapping-i{interleave}"] = (functools.partial(cp_slot_mapping_launch, interleave), ARCHS)
    for which, one_per_row in itertools.product((0, 1), (False, True)):
        form = "one-per-row" if one_per_row else "accepted"
        kind = ("check", "append")[which]
        cases[f"record_ahead-{kind}-{form}"] = (functools.partial(record_ahead_launch, which, one_per_row), ARCHS)
    for (name, dtype), (rank, rope_dim), slots in itertools.product(
        (*DTYPES.items(), ("fp8codes", torch.uint8)), ((512, 64), (512, 0)), (2**16, INT64_SLOTS)
    ):
        if not COMPILE_ALL and slots > 2**31 and (name, rope_dim) != ("bf16", 64):
            continue
        launch = functools.partial(write_mla_kv_launch, dtype, rank, rope_dim, slots)
        cases[f"write_mla_kv-{name}-l{rank}-r{rope_dim}-slots{slots}"] = (launch, ARCHS)
    for (name, dtype), heads, rope_dim, fmt_name in (
        *((d, 16, 64, None) for d in DTYPES.items()),
        (("bf16", torch.bfloat16), 128, 64, None),
        (("fp16", torch.float16), 16, 0, None),
        (("bf16", torch.bfloat16), 16, 64, "e4m3"),
        (("fp32", torch.float32), 16, 64, "e5m2"),
    ):
        launch = functools.partial(mla_decode_launch, dtype, heads, rope_dim, fmt_name)
        cases[f"mla_decode-{name}-h{heads}-l512-r{rope_dim}-{fmt_name or 'auto'}"] = (launch, ARCHS)
    for (name, dtype), fmt_name in ((("bf16", torch.bfloat16), None), (("bf16", torch.bfloat16), "e4m3")):
        launch = functools.partial(mla_decode_launch, dtype, 16, 64, fmt_name, dcp=True)
        cases[f"mla_decode-{name}-h16-l512-r64-{fmt_name or 'auto'}-dcp"] = (launch, ARCHS)
    for num_tokens in (5, 8192):  # a tile below BLOCK_TOKENS and the full one
        cases[f"mrope_positions-t{num_tokens}"] = (functools.partial(mrope_launch, num_tokens), ARCHS)
    return cases


CASES = _cases()


# ---- ahead-of-time compilation ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Resources:
    registers: int
    stack: int  # bytes of per-thread stack: spills land here
    local: int


def _specialise(launch: Launch, arch: int) -> tuple[Any, Any, Any, Any, Any]:
    """What Triton's own launch path does before compiling: bind, specialise on values, pack options."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.jit
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound, specialization, options)
    return target, options, signature, constexprs, attrs


@functools.cache
def _compile(key: str, arch: int) -> Resources:
    import triton

    target, options, signature, constexprs, attrs = _COMPILE_INPUTS[key, arch]
    fn = CASES_BY_KEY[key].jit
    compiled = triton.compile(triton.compiler.ASTSource(fn, signature, constexprs, attrs), target=target,
                              options=options.__dict__)  # fmt: skip
    return _resources(compiled.asm["cubin"])


def _resources(cubin: bytes) -> Resources:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True)
    fields = {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", usage.stdout)}
    return Resources(fields["REG"], fields["STACK"], fields["LOCAL"])


_COMPILE_INPUTS: dict[tuple[str, int], tuple[Any, ...]] = {}
CASES_BY_KEY: dict[str, Launch] = {}


def compile_case(name: str, arch: int) -> tuple[str, Resources]:
    """(kernel name, resources); cases that specialise identically share one compilation."""
    launch = CASES[name][0]()
    inputs = _specialise(launch, arch)
    _, options, signature, constexprs, attrs = inputs
    fn = launch.jit
    key = repr((fn.__name__, sorted(signature.items()), sorted(constexprs.items()), sorted(attrs.items()), options))
    _COMPILE_INPUTS[key, arch] = inputs
    CASES_BY_KEY.setdefault(key, launch)
    return fn.__name__, _compile(key, arch)


@pytest.fixture(scope="module", autouse=True)
def _fp_fusion_default() -> Iterator[None]:
    """Triton 3.9 warns unless the FP-fusion default is set; keep its current default (fusion on) explicitly."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_DEFAULT_FP_FUSION", os.environ.get("TRITON_DEFAULT_FP_FUSION", "1"))
        yield


@pytest.mark.parametrize(
    ("name", "arch"),
    [pytest.param(name, arch, id=f"{name}-sm_{arch}") for name, (_, archs) in CASES.items() for arch in archs],
)
def test_kernel_compiles_without_spilling(name: str, arch: int) -> None:
    kernel_name, used = compile_case(name, arch)
    assert used.stack == 0 and used.local == 0, f"{name} on sm_{arch} spills: {used}"
    budget = REGISTER_BUDGET[kernel_name]
    assert used.registers <= budget, f"{name} on sm_{arch}: {used.registers} registers > budget {budget}"


def test_every_kernel_is_compiled() -> None:
    """A kernel added to fast.kernels without a case here would escape the checks above."""
    import fast.kernels

    modules = [importlib.import_module(f"fast.kernels.{m.name}") for m in pkgutil.iter_modules(fast.kernels.__path__)]
    defined = {name for m in modules for name, obj in vars(m).items() if isinstance(obj, Kernel)}
    covered = {launch().kernel.fn.__name__ for launch, _ in CASES.values()}
    assert defined == covered == set(REGISTER_BUDGET)
