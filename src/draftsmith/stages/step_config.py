"""How the target runs on this machine: its dtype and whether its linears are prepacked, both by measurement.

Neither answer is the same on every CPU. bfloat16 steps faster than float32 where the CPU has bf16 dot
products (avx512_bf16, AMX) and slower where it emulates them. oneDNN-prepacked linears (model/packing.py)
make the step and the k-token verify pass cheaper on some CPUs and the 1-token step slower on others, in
some dtypes (docs/hardware.md). So each is timed on a 1-token step, the unit plain decoding repeats and
every speedup is measured against, and the faster kept; the verify curve is then measured on what was kept.
With a drafter and ``--shape auto`` the dtype is instead the one whose best shape decodes fastest
(``choose_for_drafting``): a verify pass is not a step. Times are cached per machine, target and dtype
(core/machine.py), so later runs only read them.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

from draftsmith.core.machine import cache_get, cache_put
from draftsmith.model.packing import dtype_packable
from draftsmith.model.target import Target, packing_wanted
from draftsmith.stages.shapes import (
    Choice,
    auto_shape,
    calibration_tokens,
    describe,
    shape_name,
    target_key,
)
from draftsmith.stages.verify_cost import VerifyCost, step_time

PACKABLE = (torch.float32, torch.bfloat16)


def can_pack(target: Target) -> bool:
    return (target.device.type == "cpu" and target.dtype in PACKABLE and packing_wanted()
            and dtype_packable(target.dtype))


def step_times(target: Target) -> dict[str, float]:
    """Seconds of a 1-token step here: {"plain": s} and, where packing applies, {"packed": s}. Cached.

    Leaves the target packed or plain as it came in.
    """
    key = {**target_key(target), "packed": None}
    hit = cache_get("step-time", key)
    if hit is not None and "plain" in hit and ("packed" in hit or not can_pack(target)):
        return hit
    was_packed = target.packed
    times = {}
    if can_pack(target):
        target.pack()
        times["packed"] = step_time(target)
    target.unpack()
    times["plain"] = step_time(target)
    if was_packed:
        target.pack()
    cache_put("step-time", key, times)
    return times


def apply_packing(target: Target, times: dict[str, float]) -> bool:
    """Pack the linears if that steps faster (ties go to packing: it also cheapens multi-token passes)."""
    packed = "packed" in times and times["packed"] <= times["plain"]
    if packed:
        target.pack()
    else:
        target.unpack()
    return packed


def choose_packing(target: Target) -> str:
    """Keep the target packed only where that makes its step faster here; a note saying what was kept."""
    if not can_pack(target):
        return ""
    times = step_times(target)
    packed = apply_packing(target, times)
    return (f"linears {'prepacked' if packed else 'plain'}: a step takes {1e3 * times['packed']:.1f} ms packed, "
            f"{1e3 * times['plain']:.1f} ms plain")


def choose_dtype(load: Callable[[torch.dtype], Target], device: str = "cpu",
                 log: Callable[[str], None] | None = None) -> tuple[Target, str]:
    """Load the target in whichever of float32 / bfloat16, packed or plain, runs a 1-token step fastest (CPU)."""
    log = log or _stderr
    if torch.device(device).type != "cpu":
        return load(torch.bfloat16), "dtype bfloat16 (accelerator default)"
    target = load(torch.float32)
    times = {"float32": step_times(target)}
    target.model.to(torch.bfloat16)  # prepacked copies follow the weights' dtype (model/packing.py)
    times["bfloat16"] = step_times(target)
    pick = min(times, key=lambda name: min(times[name].values()))
    if pick == "float32":
        target = load(torch.float32)  # casting back would keep bf16's rounding
    packed = apply_packing(target, times[pick])
    parts = [f"{1e3 * t['plain']:.1f} ms in {name}" + (f" ({1e3 * t['packed']:.1f} packed)" if "packed" in t else "")
             for name, t in times.items()]
    note = f"dtype {pick}{', prepacked linears' if packed else ''}: a step takes {', '.join(parts)}"
    log(note)
    return target, note


def load_target_for(path: str, device: str = "cpu", dtype: str | None = None, aux_layers=None,
                    auto: bool | str | None = False) -> tuple[Target, str]:
    """(target, a note on how it runs): in ``dtype`` (with auto and no dtype, the fastest one), packed or plain
    by measurement."""
    from draftsmith.model.target import load_target

    def load(dt):
        return load_target(path, device=device, dtype=dt, aux_layers=aux_layers)

    if auto and not dtype:
        return choose_dtype(load, device, log=lambda line: None)
    target = load(getattr(torch, dtype) if dtype else None)
    return target, choose_packing(target)


def faster_dtype(options: dict[torch.dtype, tuple[Choice, VerifyCost]]) -> torch.dtype:
    """The dtype whose best shape is expected to emit the most tokens a second: its speedup over its own
    step, over that step's seconds. Plain decoding everywhere: the dtype with the faster step."""
    return max(options, key=lambda dt: options[dt][0].speedup / options[dt][1].t_step)


def choose_for_drafting(path: str, make_drafter: Callable[[Target], object], drafter_dir: str | None,
                        device: str = "cpu", dtype: str | None = None, aux_layers=None,
                        max_new_tokens: int | None = None, log: Callable[[str], None] | None = None,
                        temperature: float = 0.0) -> tuple[Target, object, Choice, str]:
    """(target, drafter, the shape that pays, a note on the dtype): ``--shape auto`` from end to end.

    Acceptance is calibrated at the run's ``temperature``: sampling changes which shapes pay (a sampled chain
    draft is accepted with min(1, p/q), a tree's top tokens with the target's probability for them).

    With no ``dtype`` on a CPU, float32 and bfloat16 each get their best shape and the one expected to decode
    faster is kept. The 1-token step alone can pick wrong: where bf16 is emulated (AVX2 only) it wins the
    step, bound by reading the weights, and loses every k-token verify pass, which is compute-bound. The
    drafter's acceptance is calibrated once and used for both.
    """
    from draftsmith.model.target import load_target

    log = log or _stderr
    calibrate = {"max_new_tokens": calibration_tokens(max_new_tokens),
                 **({"temperature": float(temperature)} if temperature > 0 else {})}
    target, note = load_target_for(path, device, dtype, aux_layers, auto=True)
    drafter = make_drafter(target)
    choice, cost, acc = auto_shape(target, drafter, drafter_dir, calibrate=calibrate)
    log(f"acceptance from {acc.source}")  # held out from training, or said not to be
    if dtype or target.device.type != "cpu" or target.dtype not in PACKABLE:
        log(describe(choice, note))
        return target, drafter, choice, note
    other = load_target(path, device=device, dtype=next(dt for dt in PACKABLE if dt != target.dtype),
                        aux_layers=aux_layers)
    apply_packing(other, step_times(other))
    other_drafter = make_drafter(other)
    other_choice, other_cost, _ = auto_shape(other, other_drafter, drafter_dir, acceptance=acc)
    options = {target.dtype: (choice, cost), other.dtype: (other_choice, other_cost)}
    pick = faster_dtype(options)
    if pick == other.dtype:
        target, drafter, choice = other, other_drafter, other_choice

    def line(dt: torch.dtype) -> str:
        c, k = options[dt]
        return (f"{str(dt).removeprefix('torch.')} {shape_name(c.shape)} {c.speedup / k.t_step:.1f} tok/s "
                f"({c.speedup:.2f}x a {1e3 * k.t_step:.1f} ms step)")

    note = (f"dtype {str(pick).removeprefix('torch.')}{', prepacked linears' if target.packed else ''}, "
            f"expected fastest: {line(pick)} against {line(next(dt for dt in options if dt != pick))}")
    log(describe(choice, note))
    return target, drafter, choice, note


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


BULK_TOKENS = 128


@torch.no_grad()
def bulk_pass_time(target: Target, tokens: int = BULK_TOKENS) -> float:
    """Seconds of one cache-free forward over ``tokens`` tokens (the better of two, after a warm-up)."""
    ids = (torch.arange(tokens, device=target.device) % 100).unsqueeze(0)
    best = float("inf")
    for i in range(3):
        t = time.perf_counter()
        target.model(input_ids=ids, use_cache=False)
        if i:
            best = min(best, time.perf_counter() - t)
    return best


def choose_bulk_dtype(target: Target, load: Callable[[torch.dtype], Target],
                      time_pass: Callable[[Target], float] = bulk_pass_time,
                      log: Callable[[str], None] | None = None) -> Target:
    """The target for capture's long passes: ``target`` itself, or a float32 copy where that is faster.

    A 1-token step is bound by reading the weights, so bfloat16 can win it on a CPU that emulates bf16 dot
    products (AVX2 only), while a long pass there is compute-bound and many times slower in bf16.
    """
    if target.device.type != "cpu" or target.dtype != torch.bfloat16:
        return target
    t_bf16 = time_pass(target)
    other = load(torch.float32)
    t_fp32 = time_pass(other)
    pick = other if t_fp32 < t_bf16 else target
    (log or _stderr)(f"capture in {str(pick.dtype).removeprefix('torch.')}: a {BULK_TOKENS}-token pass takes "
                     f"{1e3 * t_bf16:.0f} ms in bfloat16, {1e3 * t_fp32:.0f} ms in float32")
    return pick
