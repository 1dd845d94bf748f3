"""Subnormal floats flushed to zero on the CPU, for the whole process, from its start.

As a drafter trains, its logits spread, and the softmaxes' exponentials of entries far below a row's maximum
land in the subnormal range (below ~1.2e-38 in float32 and bf16). x86 arithmetic on a subnormal takes a
microcode assist, tens of times an ordinary operation: on a 2-core AMX Xeon the full preset's backward pass
slowed from 0.3 s to 1.0-1.2 s within its first 40 steps. Flushed (FTZ) and read (DAZ) as zero, they cost
nothing; bf16 autocast's rounding already loses far larger numbers than these.

The mode lives in each thread's MXCSR register and a thread starts with its creator's, so it must be set
before the thread pools exist: entry points call ``flush_denormals`` first thing, as they call
``allocator.keep_freed_memory``; a library caller decides for its own process. ``DRAFTSMITH_DENORMALS=1``
keeps IEEE subnormals.
"""

from __future__ import annotations

import os

ENV_OFF = "DRAFTSMITH_DENORMALS"


def flush_denormals() -> bool:
    """Flush subnormals to zero in this thread and the threads it starts later; True when it took effect
    (x86 with SSE3, and not turned off)."""
    if os.environ.get(ENV_OFF, "") not in ("", "0"):
        return False
    import torch

    return bool(torch.set_flush_denormal(True))
