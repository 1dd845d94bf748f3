"""Whether training runs its matmuls in bf16 (autocast over fp32 master weights) on this machine.

``autocast = "auto"`` is on for CUDA and CPUs with AMX tiles, where bf16 matmuls are native. Other CPUs
differ: some run bf16 dot products natively without AMX (AVX512-BF16), others emulate them and lose.
There ``auto`` times one real training step (forward and backward, no update) both ways and keeps the
faster, cached per machine and drafter shape. A resumed run reuses the choice its checkpoint recorded.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from draftsmith.core.machine import cache_get, cache_put, machine_key
from draftsmith.model.target import bf16_native
from draftsmith.model.ttt import TTTBatch


def fixed_autocast(setting: str, device: torch.device) -> bool | None:
    """The answer that needs no measurement, or None when it must be measured (``auto`` on such a CPU)."""
    if setting != "auto":
        return setting == "bf16"
    if bf16_native(device):  # CUDA, and CPUs with AMX tiles
        return True
    return None if device.type == "cpu" else False


def measure_autocast(drafter, batch: TTTBatch, make_teacher: Callable[[bool], object], objective,
                     reps: int = 2) -> dict[str, float]:
    """Seconds of one forward+backward on ``batch`` in fp32 and under bf16 autocast (min over reps).

    Gradients are cleared afterwards and the RNG state is restored, so the run that follows is the run
    that would have been without the measurement.
    """
    device = batch.input_ids.device
    teachers = {False: make_teacher(False), True: make_teacher(True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for i in range(reps + 1):
            for bf16 in (False, True):
                t0 = time.perf_counter()
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    loss, _ = objective(drafter, batch, teachers[bf16](batch))
                loss.backward()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i:  # the first round warms up both paths
                    times[bf16].append(time.perf_counter() - t0)
    drafter.zero_grad(set_to_none=True)
    return {"float32": min(times[False]), "bf16": min(times[True])}


def choose_autocast(setting: str, device: torch.device, drafter, batch_tokens: int, ttt_steps: int,
                    probe: Callable[[], dict[str, float]], log: Callable[[str], None]) -> bool:
    """``setting`` resolved for this machine: fixed where it can be, else measured once and cached."""
    fixed = fixed_autocast(setting, device)
    if fixed is not None:
        return fixed
    key = {"machine": machine_key(device), "batch_tokens": batch_tokens, "ttt_steps": ttt_steps,
           "drafter": _shape_key(drafter)}
    hit = cache_get("train-autocast", key)
    if hit is None:
        hit = probe()
        cache_put("train-autocast", key, hit)
    on = hit["bf16"] < hit["float32"]
    log(f"autocast {'bf16' if on else 'off'}: a training step took {hit['float32']:.2f} s in float32, "
        f"{hit['bf16']:.2f} s under bf16 autocast")
    return on


def _shape_key(drafter) -> dict:
    """What decides a drafter's step cost: its config's shape key, or (a block drafter) its config less the
    target's fingerprint."""
    key = getattr(drafter.config, "shape_key", None)
    if key is not None:
        return key()
    import dataclasses

    return {k: v for k, v in dataclasses.asdict(drafter.config).items() if k != "target"}
