"""/proc/cpuinfo as mmserve reads it (mmserve.cpu_info), on written copies of an Intel, an AMD and an Arm CPU's:
the maker (fp32 GEMM choice), the flags (native bf16) and the signature that names the kernel build."""

from __future__ import annotations

from mmserve.cpu_info import cpu_flags, cpu_signature, cpu_vendor, cpuinfo_field
from mmserve.engine.cpu_kernels import library_name

INTEL = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C
flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile

processor\t: 1
vendor_id\t: GenuineIntel
flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile
"""
AMD = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx2 fma
"""
ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd bf16 sve
CPU implementer\t: 0x41
"""


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_maker_and_flags(tmp_path):
    intel, amd, arm = (write(tmp_path, n, t) for n, t in (("intel", INTEL), ("amd", AMD), ("arm", ARM)))
    assert cpu_vendor(intel) == "GenuineIntel" and cpu_vendor(amd) == "AuthenticAMD" and cpu_vendor(arm) == ""
    assert {"avx512_bf16", "amx_bf16"} <= cpu_flags(intel)
    assert cpu_flags(amd) == {"fpu", "sse2", "avx2", "fma"}
    assert "bf16" in cpu_flags(arm)  # Arm's line is `Features`
    assert cpuinfo_field("model name", path=intel) == "Intel(R) Xeon(R) Platinum 8481C"
    missing = str(tmp_path / "absent")
    assert cpu_vendor(missing) == "" and cpu_flags(missing) == frozenset()


def test_signature_follows_the_instruction_sets(tmp_path):
    intel, amd = write(tmp_path, "intel", INTEL), write(tmp_path, "amd", AMD)
    reordered = write(tmp_path, "amd2", AMD.replace("fpu sse2 avx2 fma", "fma avx2 fpu sse2"))
    assert cpu_signature(intel) != cpu_signature(amd)  # an AVX-512 build is never loaded on the AMD CPU
    assert cpu_signature(amd) == cpu_signature(reordered)
    assert len(cpu_signature(intel)) == 12
    assert library_name() == f"mmserve_cpu_ops_{cpu_signature()}"  # this machine's build
