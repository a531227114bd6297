"""Where time to first token goes, part by part, against each part's floor (`mmserve bench stages`).

Two stages decide TTFT: the tower's forward over a request's images, and the language model's prefill chunk.
Each is run as the server runs it (the encoder's tower with its packed weights and kernels; one engine step
over a fresh prompt), with hooks that time, by wall clock (a CPU runs every op synchronously):
- every linear layer (plain, packed, quantized) and single-window convolution, by the part it belongs to
  (patch embedding, the blocks' GEMMs, the merger; the language model's GEMMs, `lm_head`);
- every SDPA call (`torch.nn.functional.scaled_dot_product_attention`, which both transformers' attention
  and the pool attention call), and for the prefill the whole pool attention (KV write and gather around it);
- the blocks / decoder layers as a whole, so what lies between their GEMMs and attention (norms, rotary,
  activations, residual adds) is their time less those.
The floor of a part is the same calls, with the same shapes, kernels and weights, on fixed inputs, back to
back: what the part would cost with nothing around its GEMMs and attention. Parts that the floor has none of
(norms, copies, sampling) have no floor: they are what an engine at its floor would not spend.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mmserve.bench.step_profile import gemm_call
from mmserve.engine.packed_linear import PackedLinear
from mmserve.quant.linear import QuantLinear

LINEARS = (torch.nn.Linear, PackedLinear, QuantLinear)
CONVS = (torch.nn.Conv2d, torch.nn.Conv3d)


@dataclass
class Part:
    name: str
    ms: float
    floor_ms: float | None = None  # None: nothing of this part is in the floor

    @property
    def ratio(self) -> float | None:
        return self.ms / self.floor_ms if self.floor_ms else None


@dataclass
class StageCost:
    stage: str  # e.g. "tower, 1 x 448x448 (1024 patches)" or "prefill, 283 tokens"
    parts: list[Part]
    total_ms: float
    floor_ms: float
    detail: dict = field(default_factory=dict)

    @property
    def over_floor(self) -> float:
        return self.total_ms / self.floor_ms

    def to_json(self) -> dict:
        return {
            "stage": self.stage,
            "total_ms": self.total_ms,
            "floor_ms": self.floor_ms,
            "over_floor": self.over_floor,
            "parts": [{"name": p.name, "ms": p.ms, "floor_ms": p.floor_ms} for p in self.parts],
            **self.detail,
        }


class Recorder:
    """Times the hooked modules and SDPA calls of a forward by part, and keeps each call's shapes (while
    `keep_calls`) so the floor can replay them. Only shapes are kept during the forward: the replay's inputs are
    made after it (`floor`), so that making them is not timed as the forward's."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: list[tuple[str, object]] = []  # (part, () -> (replay fn, args))
        self._replays: list[tuple[str, object, tuple]] | None = None
        self._starts: dict[int, list[float]] = defaultdict(list)
        self._handles: list = []
        self.recording = True
        self.keep_calls = True

    def time_module(self, module: torch.nn.Module, part: str, replay: bool) -> None:
        def pre(mod, args):
            self._starts[id(mod)].append(time.perf_counter())

        def post(mod, args, out):
            start = self._starts[id(mod)].pop()
            if not self.recording:
                return
            self.seconds[part] += time.perf_counter() - start
            if replay and self.keep_calls:
                shape, dtype = tuple(args[0].shape), args[0].dtype
                self.calls.append((part, lambda m=mod: replay_of(m, shape, dtype)))

        self._handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    @contextlib.contextmanager
    def sdpa(self, part: str):
        """Every SDPA call inside, timed into `part` and kept for replay."""
        real = F.scaled_dot_product_attention

        def timed(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
            start = time.perf_counter()
            out = real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
            if self.recording:
                self.seconds[part] += time.perf_counter() - start
            if self.recording and self.keep_calls:
                shapes = [(tuple(t.shape), t.dtype) for t in (q, k, v)]
                mask = None if attn_mask is None else attn_mask.clone()
                kwargs = dict(attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

                def build(shapes=shapes, kwargs=kwargs):
                    inputs = tuple(torch.randn(shape, dtype=dtype) for shape, dtype in shapes)
                    return (lambda *a: real(*a, **kwargs)), inputs

                self.calls.append((part, build))
            return out

        F.scaled_dot_product_attention = timed
        try:
            yield
        finally:
            F.scaled_dot_product_attention = real

    def floor(self) -> dict[str, float]:
        """Seconds per part of one replay of every kept call, back to back (inputs made on the first)."""
        if self._replays is None:
            self._replays = [(part, *build()) for part, build in self.calls]
        out: dict[str, float] = defaultdict(float)
        with torch.no_grad():
            for part, fn, args in self._replays:
                start = time.perf_counter()
                fn(*args)
                out[part] += time.perf_counter() - start
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def replay_of(module: torch.nn.Module, shape: tuple[int, ...], dtype: torch.dtype):
    """(fn, args) that run the module's GEMM on a fixed input of that shape: the op the module calls, without
    the module around it (step_profile.gemm_call). A single-window convolution's floor is its GEMM."""
    if isinstance(module, CONVS):
        weight = module.weight.reshape(module.out_channels, -1).contiguous()
        inputs = torch.randn(shape[0], weight.shape[1], dtype=dtype)
        return torch._C._nn.linear, (inputs, weight, module.bias)
    rows = 1
    for n in shape[:-1]:
        rows *= n
    return gemm_call(module, torch.randn(rows, shape[-1], dtype=dtype))


def hook_linears(recorder: Recorder, root: torch.nn.Module, part_of) -> None:
    """Every linear layer and single-window convolution under `root`, timed into `part_of(name)`. A PatchLinear
    (encoder.patch_linear) keeps its convolution as a child for other inputs: only what ran is timed."""
    for name, module in root.named_modules():
        if isinstance(module, (*LINEARS, *CONVS)):
            recorder.time_module(module, part_of(name), replay=True)


def blocks_of(root: torch.nn.Module) -> torch.nn.ModuleList:
    """The longest ModuleList under `root`: a tower's blocks, a text model's decoder layers."""
    lists = [m for m in root.modules() if isinstance(m, torch.nn.ModuleList)]
    return max(lists, key=len)


def median_ms(samples: list[float]) -> float:
    samples = sorted(samples)
    return samples[len(samples) // 2] * 1e3
