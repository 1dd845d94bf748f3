"""What this machine is, and what was measured on it: timings that choose dtypes, shapes and precisions.

Measurements are cached as small JSON files under ``cache_home()/shapes``, keyed by everything they depend
on (CPU and its bf16/AMX flags, torch, threads, and the caller's model keys). A cached value older than
``MAX_AGE_S`` is measured again: drivers, kernels and thermal settings change under an unchanged key.

A timing also records how busy the machine was while it was taken (the load average per usable core). One taken on
an oversubscribed machine (other jobs, a test suite beside it) is used by the run that measured it but never
reused: otherwise a busy moment would steer every later run's dtype, packing and shape for a month.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch

MAX_AGE_S = 30 * 24 * 3600
#: The cache kinds that hold timings, and the load per usable core above which one is not reused.
TIMING_KINDS = frozenset({"step-time", "verify-cost", "train-autocast"})
BUSY_LOAD_PER_CORE = 2.0


def load_per_core() -> float | None:
    """The 1-minute load average over the cores this process may run on; None where the OS gives none."""
    try:
        load = os.getloadavg()[0]
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    except (OSError, AttributeError):
        return None
    return load / max(1, cores or 1)


def cache_home() -> Path:
    """Root of draftsmith's on-disk cache (``DRAFTSMITH_HOME`` overrides)."""
    env = os.environ.get("DRAFTSMITH_HOME")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "draftsmith"


def machine_key(device: torch.device | str = "cpu") -> dict:
    """What a timing depends on besides the model: CPU (and its bf16/AMX flags), GPU, torch, threads."""
    cpu, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not cpu:
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    device = torch.device(device)
    return {"cpu": cpu, "flags": sorted(flags & {"amx_tile", "amx_bf16", "avx512_bf16", "avx512f", "avx2"}),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "device": device.type,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}


def cache_file(kind: str, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_home() / "shapes" / f"{kind}-{digest}.json"


def cache_get(kind: str, key: dict, max_age_s: float = MAX_AGE_S) -> dict | None:
    """The cached value for exactly this key, or None (missing, unreadable, stale, or another key's file)."""
    try:
        data = json.loads(cache_file(kind, key).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != json.loads(json.dumps(key, sort_keys=True)):
        return None
    measured_at = data.get("measured_at")
    if not isinstance(measured_at, (int, float)) or not 0 <= time.time() - measured_at <= max_age_s:
        return None
    if kind in TIMING_KINDS and busy_when_measured(data):
        return None
    return data.get("value")


def busy_when_measured(entry: dict) -> bool:
    """A timing taken on an oversubscribed machine, or one with no record of the load (written before it was
    recorded). Where the OS reports no load average, a timing is taken as it is."""
    if "load_per_core" not in entry:
        return True
    load = entry["load_per_core"]
    return isinstance(load, (int, float)) and load > BUSY_LOAD_PER_CORE


def cache_put(kind: str, key: dict, value: dict) -> None:
    path = cache_file(kind, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        entry = {"key": key, "value": value, "measured_at": time.time()}
        if kind in TIMING_KINDS:
            entry["load_per_core"] = load_per_core()
        tmp.write_text(json.dumps(entry, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache only costs a re-measurement next time
