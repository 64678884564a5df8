"""What the process does with the C heap's memory a pass frees (ActorConfig.host_memory).

    from gpu_jobs.train.memory import set_host_memory, trim_heap
    set_host_memory("keep")   # PolicyTrainer does this from its config
    trim_heap()               # after an update: under "release" the freed pages leave the resident set

On CPU, torch allocates tensors with the C library's malloc, and glibc serves a request in one of
two ways: from heaps it keeps (below its mmap threshold, which grows to the largest block freed so
far, at most 32 MiB), or from a fresh mmap that free() unmaps (above it: a SmolLM2 logits chunk, its
gradient, the embedding's gradient). Either way the update touches memory the kernel has to fault
in page by page:

- "release" (glibc's own settings): after each pass ``malloc_trim(0)`` hands every free page of
  every arena back (MADV_DONTNEED, milliseconds), so the resident set falls to the live tensors
  between updates. Without it freed pages stay resident and fragmented: measured on SmolLM2-135M
  (4 x 4 x 64 update), 6.2 GB at rest after the first update for 1.5 GB of live tensors, 7.4 GB after
  the fourth. The cost is that every update faults its memory in again, and every large tensor is
  faulted in each time it is made: ~0.85M minor faults per SmolLM2 update of 1.5k tokens (3.4 GB of
  4 KiB pages), 1-4 s of kernel time on 2 cores, more with an in-process vLLM engine beside it.
- "keep": no mmap for large blocks (M_MMAP_MAX 0) and no trimming (M_TRIM_THRESHOLD -1, trim_heap a
  no-op), so freed memory stays in the heap for the next tensor of its size. From the third update on
  a SmolLM2 update faults in nothing; the resident set stays at the update's peak between updates and
  that peak stops growing once the heap holds every size the update asks for (measured: 4.99 GB
  after updates 3-10, against "release"'s peak of 4.87 GB).

glibc's settings belong to the process, so the policy does too: the last trainer built sets it.
Elsewhere (musl, macOS, another allocator preloaded) neither mallopt nor malloc_trim is called.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Literal, get_args

__all__ = ["HostMemory", "host_memory", "set_host_memory", "trim_heap"]

HostMemory = Literal["release", "keep"]

# glibc's mallopt parameters (malloc.h) and the values "release" puts back after a "keep": its
# defaults, with the mmap threshold at the 32 MiB its dynamic rule settles on (mallopt cannot turn
# the dynamic rule back on).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
_RELEASE = {_M_MMAP_MAX: 65536, _M_TRIM_THRESHOLD: 128 * 1024, _M_MMAP_THRESHOLD: 32 * 1024 * 1024}
_KEEP = {_M_MMAP_MAX: 0, _M_TRIM_THRESHOLD: -1}  # -1: "disables trimming completely" (mallopt(3))

_policy: HostMemory = "release"
_changed = False  # whether this process's mallopt settings are rlmill's, not glibc's untouched ones


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """glibc, or None (musl, macOS, another allocator's library without malloc_trim/mallopt)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        for name, args in (("malloc_trim", [ctypes.c_size_t]), ("mallopt", [ctypes.c_int, ctypes.c_int])):
            fn = getattr(libc, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def host_memory() -> HostMemory:
    """The process's policy (set_host_memory); "release" until a trainer sets another."""
    return _policy


def set_host_memory(policy: HostMemory) -> bool:
    """Make `policy` the process's (module docstring). False where the C library is not glibc
    (nothing changes there)."""
    global _policy, _changed
    if policy not in get_args(HostMemory):
        raise ValueError(f"host_memory must be one of {get_args(HostMemory)}, not {policy!r}")
    libc = _glibc()
    if libc is None:
        return False
    if policy != _policy and (policy == "keep" or _changed):
        for param, value in (_KEEP if policy == "keep" else _RELEASE).items():
            if libc.mallopt(param, value) != 1:
                raise OSError(f"mallopt({param}, {value}) failed: the C library refused host_memory={policy!r}")
        _changed = True
    _policy = policy
    return True


def trim_heap() -> bool:
    """Under "release", return the C heap's free pages to the OS; False where it does nothing
    (the policy is "keep", or the C library cannot)."""
    libc = _glibc()
    if libc is None or _policy == "keep":
        return False
    libc.malloc_trim(0)
    return True
