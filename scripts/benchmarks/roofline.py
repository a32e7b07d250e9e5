"""The decode section's roofline: this machine's matmul rate (GFLOP/s) at the shapes of one decode step, by
each kernel torch has for them here, and its table row. A ceiling: only the model's matmuls, each weight hot
in cache (a real step streams every weight from memory), attention, sampling and Python left out.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def linear_shapes(config) -> list[tuple[int, int, int]]:
    """(in, out, count) of every matmul one decode step runs per token: each layer's q, k, v, o, gate, up and
    down projections, and the LM head once."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = config.num_key_value_heads * head_dim
    layers, inter = config.num_hidden_layers, config.intermediate_size
    return [
        (hidden, heads * head_dim, layers),
        (hidden, kv, 2 * layers),
        (heads * head_dim, hidden, layers),
        (hidden, inter, 2 * layers),
        (inter, hidden, layers),
        (hidden, config.vocab_size, 1),
    ]


def matmul_kernels(a, w, device) -> dict[str, Callable[[], object]]:
    """The ways torch multiplies a [batch, in] input by a weight [in, out] here: `torch.matmul` everywhere, and on
    CPU with the weight laid out once for the kernel ("prepacked"): oneDNN's bf16 kernel where the CPU runs bf16
    natively (what the sampler's bf16 linear layers run, `samples.prepacked_linears`), MKL's packed sgemm for fp32
    (which the sampler does not use: its sums are not always `F.linear`'s, so the loop's fp32 logits would no
    longer be `generate`'s)."""
    import torch

    from alignment.sampling.samples import onednn_linear, onednn_runs_bf16

    kernels = {"torch.matmul": lambda: torch.matmul(a, w)}
    if device.type != "cpu":
        return kernels
    weight = w.t().contiguous()  # [out, in], as a linear layer holds it
    if a.dtype == torch.bfloat16 and onednn_runs_bf16():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        kernels["prepacked"] = lambda: onednn_linear(a, packed, None)
    elif a.dtype == torch.float32 and torch.backends.mkl.is_available():
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, a.shape[0])
        kernels["prepacked"] = lambda: torch.ops.mkl._mkl_linear(a, packed, weight, None, a.shape[0])
    return kernels


def matmul_roofline(config, batch: int, dtype, device, seconds: float = 0.5, repeats: int = 5) -> dict[str, float]:
    """This machine's matmul rate (GFLOP/s) at the decode step's shapes: [batch, in] x [in, out] for each linear
    shape of the model, by each of `matmul_kernels`; a kernel's rate is all the step's FLOPs over the time its
    matmuls take (shapes weighted by how often a step runs them), each shape's time the best of `repeats` timings
    of `seconds` / `repeats` after a warm-up: a ceiling, so the fastest run is the one that counts (a single timing
    moves between runs even on a quiet machine). "best" takes each shape's fastest kernel: the
    roofline. The rate a sampler would reach if nothing but the model's matmuls took time (attention, sampling and
    Python excluded), with each weight hot in cache, where a real step streams every weight from memory once."""
    import torch

    flops, step_time, best_time = 0.0, {}, 0.0
    for fan_in, fan_out, count in linear_shapes(config):
        a = torch.randn(batch, fan_in, dtype=dtype, device=device)
        w = torch.randn(fan_in, fan_out, dtype=dtype, device=device)
        shape_times = []
        for name, kernel in matmul_kernels(a, w, device).items():
            kernel()  # warm-up
            best = float("inf")
            for _ in range(repeats):
                runs, start = 0, time.perf_counter()
                while time.perf_counter() - start < seconds / repeats:
                    kernel()
                    runs += 1
                if device.type == "cuda":
                    torch.cuda.synchronize()
                best = min(best, (time.perf_counter() - start) / runs)
            step_time[name] = step_time.get(name, 0.0) + best * count
            shape_times.append(best)
        flops += 2 * batch * fan_in * fan_out * count
        best_time += min(shape_times) * count
    return {**{name: flops / t / 1e9 for name, t in step_time.items()}, "best": flops / best_time / 1e9}


def roofline_row(batch: int, dtype, rates: list[dict[str, float]], seconds: float, mib: float) -> dict:
    """The roofline of one type: the median over rounds of each shape's fastest kernel (`matmul_roofline`'s
    "best"), and each kernel's own median in `kernels`."""
    kind = str(dtype).removeprefix("torch.")
    best = [r["best"] for r in rates]
    rate = statistics.median(best)
    kernels = {name: round(statistics.median(r[name] for r in rates), 2) for name in rates[0] if name != "best"}
    each = " / ".join(f"{name} {value:.0f}" for name, value in kernels.items())
    return {
        "section": "decode",
        "variant": f"roofline: the faster per decode shape of {each} GFLOP/s, batch {batch}, {kind}",
        "rate": round(rate, 2),
        "unit": "GFLOP/s",
        "peak_mib": round(mib, 1),
        "seconds": round(seconds, 2),
        "mfu": None,
        "gflops": round(rate, 3),
        "of_roofline": 1.0,
        "rates": [round(r, 2) for r in best],
        "kernels": kernels,
    }
