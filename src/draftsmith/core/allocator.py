"""Keep freed tensor memory in the process, so that a training step does not pay the kernel to zero it again.

PyTorch on CPU allocates through the C library's ``malloc``. glibc serves blocks over its mmap threshold (at most
32 MiB) with a fresh ``mmap`` and hands them back with ``munmap`` when freed, and trims the top of its heap
once more than ``M_TRIM_THRESHOLD`` is free there. A training step allocates and frees the same large tensors
(activations, soft labels over the draft vocabulary, their gradients) every step, so each step faults in and
zero-fills those pages again. ``keep_freed_memory`` tells glibc to serve every block from its heap and never to
trim it: freed blocks are reused as they are, within a step and from one step to the next.

Batch shapes change every step, so a freed block does not always fit the next request, and free blocks pile up
between blocks in use (fragmentation; glibc's defaults grow the same way): resident memory climbs while the memory
in use stays level. ``release_free_memory`` gives every whole free page back; the trainer calls it every
``TRIM_EVERY_STEPS`` steps, so the pages kept are the ones the steps between reuse.

The allocators the field preloads for this (tcmalloc, jemalloc: vLLM's and Intel's CPU guides) need a system
package and ``LD_PRELOAD`` before the process starts; glibc's own ``mallopt`` does the same for this pattern, at
any time, with nothing to install. It changes where memory comes from, never a value: results are bitwise the
same. Elsewhere (musl, macOS, Windows) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform

# A long training run gives the heap's free pages back this often (``release_free_memory``): the pages the next
# step faults in again cost one step's worth of faults per call, and resident memory stays what is in use.
TRIM_EVERY_STEPS = 50
M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_MAX = -4
ENV_OFF = "DRAFTSMITH_SYSTEM_MALLOC"  # set to 1 to leave the C library's allocator as it is


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library, looked up once: ``find_library`` runs ``ldconfig -p`` in a child process each time."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def keep_freed_memory() -> bool:
    """Serve every allocation from glibc's heap and never give it back; True when it took effect.

    Process-wide, so only entry points call it (the CLI, the bench scripts that train); a library caller decides
    for its own process.
    """
    if os.environ.get(ENV_OFF, "") not in ("", "0") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success. The trim threshold is an int: its largest value means "never trim".
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def release_free_memory() -> bool:
    """Hand every whole free page of the heap back to the kernel (glibc's ``malloc_trim``); True when some went.

    A training step frees tensors whose shapes change with every batch, and glibc reuses a free block only for a
    request that fits in it. Over a long run the heap fills with free blocks between blocks in use (fragmentation):
    resident memory grows while the memory in use does not, whether or not ``keep_freed_memory`` is on.
    ``malloc_trim`` gives back the free pages anywhere in the heap, not only at its top, so resident memory returns
    to what is in use. The trainer calls it every ``TRIM_EVERY_STEPS`` steps. Elsewhere than glibc it does nothing.
    """
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        trim = _libc().malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))
