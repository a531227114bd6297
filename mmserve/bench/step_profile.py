"""What a decode step costs next to its floor, and where the rest goes (`mmserve bench engine`).

The floor: the language model's own linear layers (every projection and `lm_head`, with the checkpoint's
weights and dtype, packed as the engine packs them) applied to as many rows as the step decodes, nothing
else. On a CPU a decode step streams all of those weights from memory, so this is what no engine can beat;
the step's time over it is the price of attention, element-wise ops, sampling, scheduling and Python.

The breakdown profiles a few steps (torch.profiler) and splits each into GEMM (the linear layers' kernels),
attention (the KV pool's writes, gathers and SDPA), sampler and scheduler (the engine's `mmserve::` labels),
and other (norms, RoPE, activations, Python), scaled to the unprofiled step time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mmserve.engine.packed_linear import PackedLinear
from mmserve.quant.linear import QuantLinear, weight_bytes

GEMM_OPS = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::_addmm_activation",
    "mkldnn::_linear_pointwise",
    "mmserve_cpu::quant_linear",  # and its many-row path, which dequantizes and calls one of the above
    "mmserve_cpu::dequantize_weight",
)
ATTENTION_OPS = (  # and every SDPA kernel
    "aten::index_select",
    "aten::index_copy_",
    "aten::index_put_",
    "mmserve_cpu::decode_attention_",
    "mmserve_cpu::store_kv_",
)
LABELS = {"scheduler": "mmserve::schedule", "sampler": "mmserve::sample"}


@dataclass
class StepCost:
    rows: int  # requests decoding in each step
    step_ms: float  # median wall time of one engine step
    gemm_floor_ms: float  # the same rows through the linear layers alone
    breakdown_ms: dict[str, float]  # gemm / attention / sampler / scheduler / other, summing to step_ms

    @property
    def over_floor(self) -> float:
        return self.step_ms / self.gemm_floor_ms

    def to_json(self) -> dict:
        return {
            "rows": self.rows,
            "step_ms": self.step_ms,
            "gemm_floor_ms": self.gemm_floor_ms,
            "step_over_gemm_floor": self.over_floor,
            "breakdown_ms": self.breakdown_ms,
        }


def linear_layers(runner) -> list[torch.nn.Module]:
    """Every linear layer of the language model and `lm_head`: plain, packed (engine.packed_linear) or quantized
    (mmserve.quant.linear)."""
    kinds = (torch.nn.Linear, PackedLinear, QuantLinear)
    return [m for m in runner.language_model.modules() if isinstance(m, kinds)] + [runner.lm_head]


def streamed_bytes(runner) -> int:
    """The linear layers' weight bytes: what one decode step streams from memory at least."""
    return sum(weight_bytes(m) for m in linear_layers(runner))


def gemm_call(layer: torch.nn.Module, x: torch.Tensor):
    """(op, args): the GEMM `layer(x)` runs, called without the module around it."""
    if isinstance(layer, QuantLinear):
        w = layer.qweight
        if layer.kernels is not None and w.perm is None and x.shape[0] <= layer.kernel_rows(x.dtype):
            args = (x, w.data, w.scales, w.zeros, layer.kind_code, w.group, layer.bias)
            return layer.kernels.quant_linear, args  # what the decode stack calls
        return layer, (x,)  # act-order inputs gathered, or a prefill's rows: the layer's own dispatch
    if isinstance(layer, PackedLinear):
        return torch.ops.mkldnn._linear_pointwise.default, (x, layer.packed, layer.bias, "none", [], "")
    return torch._C._nn.linear, (x, layer.weight, layer.bias)


class GemmFloor:
    """The language model's linear layers applied to `rows` rows, in order, on fixed inputs: one pass is the
    floor of a decode step of as many rows. Each GEMM is called as the op itself, without the module's Python
    call around it (about 1 ms a pass), since the engine's decode step calls them from C++ (DecodeStack)."""

    def __init__(self, runner, rows: int) -> None:
        layers = linear_layers(runner)
        inputs = {
            n: torch.randn(rows, n, dtype=runner.dtype, device=runner.device)
            for n in {m.in_features for m in layers}
        }
        self.calls = [gemm_call(m, inputs[m.in_features]) for m in layers]
        self()  # warms the kernels' caches

    @torch.no_grad()
    def __call__(self) -> float:
        """Seconds of one pass."""
        start = time.perf_counter()
        for op, args in self.calls:
            op(*args)
        return time.perf_counter() - start


def timed_steps(engine, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        if not engine.has_work:
            break
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def steps_beside_floor(engine, steps: int, floor: GemmFloor) -> tuple[list[float], list[float]]:
    """Seconds of up to `steps` engine steps and of as many floor passes, one after the other, alternately.
    This machine's memory bandwidth drifts from one minute to the next (the one-row floor has read 84 to 163
    ms on one day), so each step is compared with a floor measured beside it, not minutes apart."""
    step_times, floor_times = [], []
    for _ in range(steps):
        times = timed_steps(engine, 1)
        if not times:
            break
        step_times += times
        floor_times.append(floor())
    return step_times, floor_times


def breakdown(engine, steps: int, step_s: float) -> dict[str, float]:
    """Milliseconds per step by category, from `steps` profiled steps scaled to `step_s`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        done = len(timed_steps(engine, steps))
        profiled_s = time.perf_counter() - start
    if not done:
        return {}
    sums = dict.fromkeys(("gemm", "attention", "sampler", "scheduler"), 0.0)
    for event in prof.key_averages():
        name = event.key
        if name in GEMM_OPS:
            sums["gemm"] += event.self_cpu_time_total
        elif name in ATTENTION_OPS or "scaled_dot_product" in name:
            sums["attention"] += event.self_cpu_time_total
        for category, label in LABELS.items():
            if name == label:
                sums[category] += event.cpu_time_total  # the region, all ops in it
    scale = step_s / (profiled_s / done)  # the profiler slows every op; shares are what it tells
    out = {k: v / 1e3 / done * scale for k, v in sums.items()}
    out["other"] = max(0.0, step_s * 1e3 - sum(out.values()))
    return out
