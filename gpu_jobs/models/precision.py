"""Which precision a machine runs fast: what the `auto` of `actor.dtype` and
`rollout.engine_options.dtype` resolves to.

bf16 where the hardware has bf16 arithmetic (a CUDA GPU that supports it; an x86 CPU with
AVX512_BF16 or AMX, an Arm CPU with the BF16 extension), else fp32: on a CPU without those
instructions bf16 matmuls are emulated and slower than fp32. Measured on an AMD EPYC with
AVX512_BF16 (docs/guide/real-model.md): the SmolLM2 example's 30 iterations took 0.86x the
fp32 wall time in bf16, with the same held-out curve.

    native_bf16()            # True / False for this machine
    resolve_dtype("auto", "trainer", ("fp32", "bf16"))   # "bf16" or "fp32"
"""

from __future__ import annotations

import functools

__all__ = ["AUTO", "native_bf16", "resolve_dtype"]

AUTO = "auto"
# CPU flags (/proc/cpuinfo: x86 "flags", Arm "Features") that mean bf16 arithmetic in hardware.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
# The names each side spells its two precisions with.
NAMES = {"trainer": ("bf16", "fp32"), "rollout": ("bfloat16", "float32")}


def cpu_flags(cpuinfo: str) -> set[str]:
    """Every flag listed in a /proc/cpuinfo text (x86 `flags`, Arm `Features` lines)."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return flags


@functools.cache
def native_bf16() -> bool:
    """Whether this machine computes in bf16 natively: a CUDA device that supports bf16 when
    torch sees one (the run trains there), else the CPU's flags."""
    import torch

    if torch.cuda.is_available():
        return bool(torch.cuda.is_bf16_supported())
    try:
        with open("/proc/cpuinfo") as f:
            return bool(cpu_flags(f.read()) & BF16_CPU_FLAGS)
    except OSError:  # not Linux: no flags to read, so no claim of fast bf16
        return False


def resolve_dtype(value: str, side: str, choices: tuple[str, ...]) -> str:
    """`value` unless it is "auto": then bf16 or fp32 for this machine, spelled as `side`
    ("trainer": bf16/fp32, "rollout": bfloat16/float32) spells them. A value neither "auto" nor
    one of the field's ``choices`` is refused with all of them named (pydantic's own message
    would not list "auto")."""
    if value != AUTO:
        if value not in choices:
            raise ValueError(f"{value!r} is not a precision: use {', '.join(map(repr, (AUTO, *choices)))}")
        return value
    bf16, fp32 = NAMES[side]
    return bf16 if native_bf16() else fp32
