"""mmserve's CPU kernels for the decode step (`csrc/`): built on first use, then loaded.

Why our own: on this CPU the step spent 1.3-2x its GEMM floor in small eager ops and in gathering every
request's K/V out of the pool for SDPA. The libraries that ship fused CPU kernels for this (Intel's extension
for PyTorch, SGLang's and vLLM's CPU kernels) are each built against their own pinned torch and do not load
beside torch 2.13, so mmserve carries small kernels of its own (see the headers of cpu_ops.cpp,
decode_layers.cpp and vision_ops.cpp, the towers' one).

The library is compiled once per machine with torch's extension builder (g++ and ninja, ~1 min) into
torch's extension cache (`TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`) and re-used after; the
build is keyed on the sources and flags, the headers' digest among the flags, so any edit rebuilds.
It is compiled for the host's instruction sets (-march=native), so its name carries the CPU's signature
(`cpu_info.cpu_signature`): machines of different CPUs that share a home directory each build and load their
own, and none loads a library with instructions its CPU lacks. Without a compiler the engine logs why and runs
the eager ops (`--disable-cpu-kernels` chooses that path on purpose).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

from mmserve.cpu_info import cpu_signature

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / "cpu_ops.cpp",
    CSRC / "decode_attention.cpp",
    CSRC / "decode_layers.cpp",
    CSRC / "vision_ops.cpp",
    CSRC / "linear_state.cpp",
    CSRC / "gemma_ops.cpp",
    CSRC / "quant_linear.cpp",
]
HEADERS = sorted(CSRC.glob("*.h"))  # torch keys its build on sources and flags only
# -O3 and the host's vector ISA (the library is built on the machine that runs it); no fused multiply-add
# where the eager ops round twice (-ffp-contract=off); OpenMP for at::parallel_for and `omp simd` loops.
CFLAGS = [
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fopenmp",
]


class CpuKernels:
    """The loaded ops, called as methods (torch.ops.mmserve_cpu.*)."""

    def __init__(self) -> None:
        ops = torch.ops.mmserve_cpu
        self.rms_norm = ops.rms_norm
        self.add_rms_norm = ops.add_rms_norm
        self.rope_ = ops.rope_
        self.silu_mul = ops.silu_mul
        self.decode_attention_ = ops.decode_attention_
        self.store_kv_ = ops.store_kv_
        self.decode_layers = ops.decode_layers
        self.decode_layers_quant = ops.decode_layers_quant
        self.greedy_argmax = ops.greedy_argmax
        self.vision_rope = ops.vision_rope
        self.bf16_lookup = ops.bf16_lookup
        self.gated_delta_step_ = ops.gated_delta_step_
        self.gemma_rms_norm = ops.gemma_rms_norm
        self.quant_linear = ops.quant_linear
        self.dequantize_weight = ops.dequantize_weight
        self.quant_linear_amx = bool(ops.quant_linear_amx())  # bf16 quantized rows on AMX tiles here


def library_name() -> str:
    """The library's name in torch's extension cache: one per CPU kind (the module docstring says why)."""
    return f"mmserve_cpu_ops_{cpu_signature()}"


def header_digest() -> str:
    """A digest of the headers, passed as a define so that editing one alone rebuilds the library."""
    return hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]


@functools.cache  # one build and load per process: the ops live in torch's global registry
def load_cpu_kernels() -> CpuKernels | None:
    """The kernels, building them if this machine has not yet; None (with the reason logged) if they cannot be
    built here."""
    try:
        from torch.utils.cpp_extension import load

        load(
            name=library_name(),
            sources=[str(s) for s in SOURCES],
            extra_cflags=[*CFLAGS, f"-DMMSERVE_HEADER_DIGEST={header_digest()}"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=os.environ.get("MMSERVE_KERNELS_VERBOSE") == "1",
        )
        return CpuKernels()
    except Exception as exc:  # no compiler, no ninja, a torch without headers: the eager ops still work
        log.warning("mmserve CPU kernels unavailable, running the eager ops: %s", exc)
        return None


KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def kernels_for(device: torch.device, dtype: torch.dtype, enabled: bool) -> CpuKernels | None:
    """The kernels an engine on `device` in `dtype` uses: only on the CPU, in fp32 or bf16 (an fp16 engine runs
    the eager ops), only when enabled, only if they build."""
    if not enabled or device.type != "cpu" or dtype not in KERNEL_DTYPES:
        return None
    return load_cpu_kernels()


if __name__ == "__main__":  # `python -m mmserve.engine.cpu_kernels`: build now (set-up does this once)
    logging.basicConfig(level=logging.INFO)
    if load_cpu_kernels() is None:
        raise SystemExit("mmserve: the CPU kernels did not build (the reason is above)")
    print(f"mmserve CPU kernels ready ({', '.join(s.name for s in SOURCES)}, torch {torch.__version__})")
