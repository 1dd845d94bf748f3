"""k-cost curve of the target: what a k-token verify pass costs against a 1-token step, plain vs packed linears.

Each timing is one full ``Target.forward`` (head included) of k new tokens over a KV cache of ``--prefix``
tokens, followed by the rollback to the prefix; ``tree16`` is 16 tokens under a 4D tree mask (depths 0..5,
branching like an EAGLE-2 tree). Plain and packed (model/packing.py) run interleaved in one process on the
same weights; the cells are the median ms over ``--reps`` runs with the spread (IQR / median). The ratios are
to the plain 1-token step and to the variant's own 1-token step.

Run: python bench/verify_cost.py [--target smollm2] [--reps 15] [--dtypes float32,bfloat16] [--json out.json]
An AVX2-only CPU's code paths, on a newer CPU: ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python bench/...
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from draftsmith.model.packing import PackedLinear
from draftsmith.model.target import Target, load_target

KS = (1, 2, 3, 4, 6, 10, 16)
# A 16-node tree (parent of node i; the root is -1): three children of the root, then two per node.
TREE_PARENTS = (-1, 0, 0, 0, 1, 1, 2, 3, 4, 4, 5, 7, 8, 9, 11, 13)
TEXT = ("The history of the city begins with a small fishing village on the river. Over the centuries it grew "
        "into a trading port, and merchants from many countries came to buy wool, salt and timber. ")


def cpu_flags() -> dict:
    """The CPU features that decide bf16 and GEMM speed."""
    flags: set[str] = set()
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            elif line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
    return {"cpu": model, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "capability": torch.backends.cpu.get_cpu_capability(),
            "amx_tile (torch)": bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()),
            **{f: f in flags for f in wanted}}


class Switch:
    """Flip a packed model between its packed and its original linears without repacking."""

    def __init__(self, target: Target):
        self.slots = [(parent, name, child) for parent in target.model.modules()
                      for name, child in parent.named_children() if isinstance(child, PackedLinear)]

    def __call__(self, packed: bool) -> None:
        for parent, name, child in self.slots:
            setattr(parent, name, child if packed else child.original)


def tree_inputs(dtype: torch.dtype, prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(TREE_PARENTS)
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            allowed[i, j], j = True, TREE_PARENTS[j]
    mask = torch.cat([torch.ones(n, prefix, dtype=torch.bool), allowed], 1)
    additive = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)
    return additive[None, None], prefix + (allowed.sum(1) - 1)[None]


def one_pass(target: Target, cache, ids: torch.Tensor, k, prefix: int, tree) -> torch.Tensor:
    if k == "tree16":
        mask, pos = tree
        cache.begin_block(TREE_PARENTS)
        out = target(ids[:, prefix:prefix + 16], cache=cache, attention_mask=mask, position_ids=pos)
    else:
        cache.begin_block(range(-1, k - 1))
        out = target(ids[:, prefix:prefix + k], cache=cache)
    cache.keep(prefix)
    return out.logits


def curve(target: Target, ids: torch.Tensor, prefix: int, reps: int) -> tuple[dict, dict]:
    switch = Switch(target)
    variants = {"plain": False, "packed": True} if switch.slots else {"plain": False}
    cache = target.new_cache()
    target(ids[:, :prefix], cache=cache, logits_to_keep=1)
    tree = tree_inputs(target.dtype, prefix)
    ks = (*KS, "tree16")
    logits = {}
    for name, packed in variants.items():  # warm-up, and the logits each variant gives
        switch(packed)
        for k in ks:
            logits[name, k] = one_pass(target, cache, ids, k, prefix, tree)
    times: dict = {}
    for _ in range(reps):
        for k in ks:
            for name, packed in variants.items():
                switch(packed)
                t0 = time.perf_counter()
                one_pass(target, cache, ids, k, prefix, tree)
                times.setdefault(name, {}).setdefault(str(k), []).append((time.perf_counter() - t0) * 1e3)
    switch(True)
    if not switch.slots:
        return times, {}
    diffs = {str(k): {"max_abs": (logits["packed", k].float() - logits["plain", k].float()).abs().max().item(),
                      "argmax_differs": int((logits["packed", k].argmax(-1) != logits["plain", k].argmax(-1)).sum())}
             for k in ks}
    return times, diffs


def summary(v: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(v, n=4)
    med = statistics.median(v)
    return med, (q[2] - q[0]) / med


def report(dtype: str, times: dict, diffs: dict) -> None:
    base = statistics.median(times["plain"]["1"])
    print(f"\n{dtype}: median ms (IQR/median) [ratio to plain k=1 | to own k=1]")
    for name, row in times.items():
        own = statistics.median(row["1"])
        cells = []
        for k, v in row.items():
            med, spread = summary(v)
            cells.append(f"k={k}: {med:6.1f} ({spread:4.0%}) [{med / base:4.2f}|{med / own:4.2f}]")
        print(f"  {name:7s}" + "  ".join(cells))
    if not diffs:
        print("  (nothing packed: oneDNN cannot pack this dtype on this CPU)")
        return
    worst = max(d["max_abs"] for d in diffs.values())
    flips = sum(d["argmax_differs"] for d in diffs.values())
    print(f"  packed vs plain logits: max |diff| {worst:.3g}, argmax differs at {flips} positions")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prefix", type=int, default=200, help="KV cache length before each pass")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    flags = cpu_flags()
    print("machine: " + ", ".join(f"{k}={v}" for k, v in flags.items()))
    results = {"machine": flags, "target": args.target, "prefix": args.prefix, "reps": args.reps, "dtypes": {}}
    for dtype in args.dtypes.split(","):
        t0 = time.perf_counter()
        target = load_target(args.target, dtype=getattr(torch, dtype), pack=True)
        packed = "packed" if Switch(target).slots else "nothing packed"
        print(f"{dtype}: loaded ({packed}) in {time.perf_counter() - t0:.1f} s", flush=True)
        ids = target.tokenizer(TEXT * 20, return_tensors="pt").input_ids[:, : args.prefix + 16]
        times, diffs = curve(target, ids, args.prefix, args.reps)
        report(dtype, times, diffs)
        results["dtypes"][dtype] = {"times_ms": times, "logit_diffs": diffs}
        del target
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
