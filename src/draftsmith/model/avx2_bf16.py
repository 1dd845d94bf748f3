"""A bf16-weight linear for x86 CPUs that have AVX2 and FMA but no bf16 instructions (avx2_bf16.cpp).

There oneDNN cannot pack bf16 weights, and ``F.linear`` in bf16 costs about a full weight conversion per row,
so a k-token verify pass costs k steps; float32 streams twice the bytes per step. This kernel streams the bf16
weight once per call into fp32 sums, whatever the number of rows, and gives each row the same bits whatever
the number of rows beside it. Nothing in PyTorch ships it, so it is compiled here, once per source and torch
version, with torch's own extension builder (a C++ compiler and ninja); where that cannot be done, callers
fall back to ``F.linear``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

import torch

from draftsmith.core.machine import cache_home

SOURCE = Path(__file__).with_name("avx2_bf16.cpp")


def cpu_has_avx2_fma() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


@contextlib.contextmanager
def _interpreter_scripts_on_path():
    """torch's builder runs ``ninja`` from PATH; the pip-installed one lives beside this interpreter."""
    scripts, old = sysconfig.get_path("scripts"), os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join(p for p in (scripts, old) if p)
    try:
        yield
    finally:
        os.environ["PATH"] = old


@functools.cache
def kernel() -> ModuleType | None:
    """The compiled module (``pack``, ``linear``), or None where this CPU or machine cannot have it.

    Built on first use (about a minute on 2 cores) into draftsmith's cache, keyed by the source and torch.
    """
    if not cpu_has_avx2_fma():
        return None
    from torch.utils import cpp_extension

    digest = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:12]
    name = f"draftsmith_avx2_bf16_{digest}"
    build = cache_home() / "extensions" / name
    try:
        build.mkdir(parents=True, exist_ok=True)
        with _interpreter_scripts_on_path():
            if not (build / f"{name}.so").is_file():
                print(f"compiling the AVX2 bf16 linear kernel into {build} (once)", file=sys.stderr, flush=True)
            return cpp_extension.load(name, [str(SOURCE)], extra_cflags=["-O3"], build_directory=str(build),
                                      verbose=False)
    except Exception as e:  # noqa: BLE001 -- whatever stops the build (no compiler, no ninja, a full disk)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        first = first if len(first) <= 160 else first[:157] + "..."
        print(f"AVX2 bf16 kernel unavailable ({first}); bf16 linears run plain F.linear", file=sys.stderr)
        return None


def available() -> bool:
    return kernel() is not None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight (N x K bf16) in the kernel's layout: groups of 32 columns, k-rows contiguous, zero-padded."""
    return kernel().pack(weight.detach())


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``F.linear`` on a packed weight; ``x`` is (..., K) bf16, ``bias`` fp32 or None."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = kernel().linear(x2, packed, bias if bias is not None else _NO_BIAS, out_features)
    return y.reshape(*x.shape[:-1], out_features)


_NO_BIAS = torch.empty(0)
