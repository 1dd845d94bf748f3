"""What this machine is, and what was measured on it: timings that choose dtypes, shapes and precisions.

Measurements are cached as small JSON files under ``cache_home()/shapes``, keyed by everything they depend
on (CPU and its bf16/AMX flags, torch, threads, and the caller's model keys). A cached value older than
``MAX_AGE_S`` is measured again: drivers, kernels and thermal settings change under an unchanged key.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch

MAX_AGE_S = 30 * 24 * 3600


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
    return data.get("value")


def cache_put(kind: str, key: dict, value: dict) -> None:
    path = cache_file(kind, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "value": value, "measured_at": time.time()}, indent=1,
                                  sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache only costs a re-measurement next time
