"""What this CPU multiplies fast, asked before a dtype or kernel is chosen for it.

`bf16_native()`: whether torch's bf16 matmul runs on the CPU's own bf16 instructions (AVX512-BF16 or AMX, through
oneDNN) as oneDNN is allowed to use them here: ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA) capped below
AVX512_CORE_BF16 makes the answer no, as it makes oneDNN's kernels (how a test forces the lower ISA).
`slow_bf16()` says why not, with the bf16 and fp32 matmul rates measured here at a decode step's shape;
`refuse_slow_bf16(config, where)` is the check stages run at `align check`: a sampling block's `dtype: bfloat16`
or a `train: {bf16: true}` is refused on a machine without a GPU whose CPU lacks native bf16, where both run
far slower than fp32 (measured: docs/performance.md); `warn_slow_bf16()` is the sampler's word at run time.
`torch_threads(count)`: torch's CPU thread count set for a block and restored after it.
Limits: on x86 a CPU counts only with AVX512-BF16 or AMX (one with AVX2-VNNI-2 or plain AVX-512, on which oneDNN
converts bf16 to fp32, counts as without); on other architectures torch's own oneDNN check is the answer.
"""

from __future__ import annotations

import os
import platform
import time
from contextlib import contextmanager
from functools import cache

import torch
from pydantic import BaseModel

from ..config.sampling import SamplingSpec
from ..errors import UserError
from .dist import get_logger

log = get_logger(__name__)

# oneDNN's ISA caps (its ONEDNN_MAX_CPU_ISA values) that leave out its native bf16 kernels; every other value,
# DEFAULT and ALL included, allows them (an unknown value is ignored by oneDNN, so it caps nothing).
BELOW_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")
ISA_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def isa_cap() -> str | None:
    """The ISA cap the environment gives oneDNN, upper-cased ("AVX2"), or None."""
    for name in ISA_VARIABLES:
        if value := os.environ.get(name, "").strip():
            return value.upper()
    return None


def x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def bf16_native() -> bool:
    """Whether torch multiplies bf16 on this CPU's own bf16 instructions: oneDNN runs torch's bf16 matmul here, the
    CPU has AVX512-BF16 or AMX (x86), and no ISA cap leaves them out."""
    onednn = (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported")
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )
    if not onednn or not x86():
        return onednn
    has_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return has_bf16 and isa_cap() not in BELOW_BF16


def why_not_native() -> str:
    """Why `bf16_native()` is false here, in words."""
    cap = isa_cap()
    if cap in BELOW_BF16 and x86() and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()):
        return f"ONEDNN_MAX_CPU_ISA={cap} keeps oneDNN off this CPU's bf16 instructions"
    where = f"{platform.machine()} CPU (torch sees {torch.backends.cpu.get_cpu_capability()})"
    return (
        f"this {where} has neither AVX512-BF16 nor AMX"
        if x86()
        else f"torch runs no native bf16 matmul on this {where}"
    )


@cache
def matmul_rates(batch: int = 8, fan_in: int = 512, fan_out: int = 512, seconds: float = 0.02) -> dict[str, float]:
    """GFLOP/s of a [batch, fan_in] x [fan_in, fan_out] product in fp32 and in bf16 on one thread here: a decode
    step's shape, each type's rate the best of 3 windows of `seconds` (at least one product each) after a warm-up.
    One thread, as threads that wait on each other on a busy machine would time the waiting, not the kernel."""
    rates = {}
    with torch_threads(1):
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            a, w = torch.randn(batch, fan_in, dtype=dtype), torch.randn(fan_in, fan_out, dtype=dtype)
            torch.matmul(a, w)
            best = float("inf")
            for _ in range(3):
                runs, start = 0, time.perf_counter()
                while runs == 0 or time.perf_counter() - start < seconds:
                    torch.matmul(a, w)
                    runs += 1
                best = min(best, (time.perf_counter() - start) / runs)
            rates[name] = 2 * batch * fan_in * fan_out / best / 1e9
    return rates


@contextmanager
def torch_threads(count: int):
    """torch's CPU thread count set to `count` inside the block, and restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def slow_bf16() -> str | None:
    """None where bf16 is the fast type for a model on this CPU (it multiplies bf16 natively); else why not, with
    the rates of both types measured here (`matmul_rates`)."""
    if bf16_native():
        return None
    rates = matmul_rates()
    return (
        f"{why_not_native()}: bf16 matmul ran at {rates['bfloat16']:.1f} GFLOP/s here against fp32's "
        f"{rates['float32']:.1f} (a [8, 512] x [512, 512] product, one thread)"
    )


def bf16_requests(config, where: str) -> list[tuple[str, str]]:
    """(key, what it asks) of every bf16 request in `config` (a stage's or suite's spec, walked through its nested
    specs, lists and dicts): sampling blocks with `dtype: bfloat16` on the transformers backend (vLLM picks its own
    type), and a `train:` block of TRL knobs with `bf16: true`."""
    found = []
    if isinstance(config, SamplingSpec) and config.dtype == "bfloat16" and config.backend == "transformers":
        found.append((f"{where}.dtype", "samples on a bf16 copy of the weights"))
    if isinstance(config, BaseModel):
        for name in type(config).model_fields:
            value = getattr(config, name)
            if name == "train" and isinstance(value, dict) and value.get("bf16"):
                found.append((f"{where}.train.bf16", "trains in bf16 mixed precision"))
            found += bf16_requests(value, f"{where}.{name}")
    elif isinstance(config, (list, tuple)):
        for i, item in enumerate(config):
            found += bf16_requests(item, f"{where}.{i}")
    elif isinstance(config, dict):
        for key, item in config.items():
            found += bf16_requests(item, f"{where}.{key}")
    return found


def refuse_slow_bf16(config, where: str) -> None:
    """UserError naming the first bf16 request of `config` (`bf16_requests`) where bf16 is slow here (`slow_bf16`),
    with the reason and the alternative; nothing where there is none or bf16 is fast."""
    requests = bf16_requests(config, where)
    if not requests or torch.cuda.is_available() or (why := slow_bf16()) is None:
        return
    key, what = requests[0]
    fix = (
        "drop `dtype` (the model samples in its own type, fp32 on CPU)"
        if key.endswith(".dtype")
        else "drop `bf16` (the stages train in fp32 on CPU)"
    )
    raise UserError(
        f"{key}: {what}, which is fast only on a CPU that multiplies bf16 natively (AVX512-BF16 or AMX) "
        f"or on a GPU; {why}. Here fp32 is the faster choice: {fix}. Measurements: docs/performance.md."
    )


_warned = False  # whether `warn_slow_bf16` has spoken in this process


def warn_slow_bf16() -> None:
    """Log once per process, where bf16 is slow on this CPU (`slow_bf16`), that a bf16 sampling call runs here: it
    samples as asked, as a program may ask, where `align check` refuses it for a recipe."""
    global _warned
    if _warned or (why := slow_bf16()) is None:
        return
    _warned = True
    log.warning(
        f"sampling with `dtype: bfloat16` on this CPU, which is slower than fp32 here: {why}. Drop `dtype` "
        "to sample in the model's own type (measured: docs/performance.md)."
    )
