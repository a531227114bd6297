"""What this machine's CPU is, read from Linux's /proc/cpuinfo: the facts that choose a dtype (native bf16), a
GEMM library (the maker) and a kernel build (the instruction sets). Every core lists the same, so the first
one's lines are read. Elsewhere (another OS, no /proc) each answer is the one that is always correct."""

from __future__ import annotations

import hashlib
import platform

CPUINFO = "/proc/cpuinfo"


def cpuinfo_field(*keys: str, path: str = CPUINFO) -> str:
    """The value of the first line whose key is one of `keys` ("" where there is none)."""
    try:
        with open(path) as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() in keys:
                    return value.strip()
    except OSError:
        pass
    return ""


def cpu_flags(path: str = CPUINFO) -> frozenset[str]:
    """The CPU's feature flags (x86 `flags`, Arm `Features`)."""
    return frozenset(cpuinfo_field("flags", "Features", path=path).split())


def cpu_vendor(path: str = CPUINFO) -> str:
    """The x86 maker's string (GenuineIntel, AuthenticAMD, ...); "" on other architectures."""
    return cpuinfo_field("vendor_id", path=path)


def cpu_signature(path: str = CPUINFO) -> str:
    """A short digest of the architecture and the feature flags: equal on CPUs that run the same instructions.
    Code compiled with -march=native is only safe to load where this is the one it was built under."""
    flags = " ".join(sorted(cpu_flags(path)))
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:12]
