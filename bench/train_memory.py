"""The trainer's memory over a run: resident and anonymous memory, and glibc's heap, sampled after every step.

    OMP_NUM_THREADS=2 python bench/train_memory.py --store STORE --target TARGET --minutes 20 [--out out/mem]
    python bench/train_memory.py --minutes 5            # no store: a small one is built in-process (tiny target)
    python bench/train_memory.py table before=a/memory.csv after=b/memory.csv --every 100   # the curves, as Markdown

Trains as ``draftsmith train`` does (the CLI's allocator setting, ``core/allocator.py``), from a feature store, for
``--minutes`` (a time budget, up to ``--max-steps``), and after each optimizer step reads ``/proc/self/status``
(VmRSS, RssAnon, RssFile) and glibc's ``mallinfo2`` (bytes the heap holds in use, bytes it holds free, bytes served
by mmap). Writes ``OUT/memory.csv`` (one row a step) and ``OUT/memory.json`` (the summary: each measure at the
reference step, 200 by default, at the end and at its peak, and the growth after the reference step in percent).

Free bytes that grow while in-use bytes stay level mean the heap keeps memory it cannot reuse (fragmentation, or
freed blocks held on purpose); in-use bytes that grow mean something holds on to tensors (a cache, a leak).
``--system-malloc`` runs with glibc's defaults instead of the CLI's setting, and ``--trim-every 0`` without the
trainer's periodic ``release_free_memory`` (the trainer before it), for comparisons.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import ctypes.util
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mallinfo2():
    """glibc's ``mallinfo2`` (2.33 and later), or None elsewhere."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


def proc_status() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile and VmHWM of this process, in bytes (Linux)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


class Sampler:
    """One row per optimizer step (a global post-step hook, so the trainer is run unchanged)."""

    FIELDS = ("step", "elapsed_s", "VmRSS", "RssAnon", "RssFile", "VmHWM", "heap_in_use", "heap_free", "mmapped",
              "heap_total")

    def __init__(self, csv_path: Path):
        self.rows: list[dict] = []
        self.t0 = time.perf_counter()
        self.mallinfo = _mallinfo2()
        fields = [k for k in self.FIELDS if self.mallinfo is not None or not k.startswith(("heap", "mmapped"))]
        self.file = open(csv_path, "w", newline="")  # noqa: SIM115 (written a row a step, closed by close())
        self.csv = csv.DictWriter(self.file, fieldnames=fields)
        self.csv.writeheader()

    def __call__(self, *_):
        row = {"step": len(self.rows) + 1, "elapsed_s": round(time.perf_counter() - self.t0, 2), **proc_status()}
        if self.mallinfo is not None:
            m = self.mallinfo()
            # arena: bytes the heap got with sbrk (main arena) or its mmapped heaps (other arenas)
            row.update(heap_in_use=m.uordblks, heap_free=m.fordblks, mmapped=m.hblkhd, heap_total=m.arena)
        self.rows.append(row)
        self.csv.writerow(row)
        self.file.flush()  # a run stopped part-way keeps its rows

    def close(self) -> None:
        self.file.close()


def build_tiny_store(work: Path, n: int = 300, seed: int = 0) -> tuple[Path, Path]:
    """A tiny random target and a store captured from conversations of widely varying length (1 to ~600 tokens),
    so that batch shapes vary as they do on a real store."""
    import torch

    from draftsmith.stages.capture import CaptureConfig, run_capture
    from draftsmith.testing.models import save_tiny_target

    model, store = work / "model", work / "store"
    if (store / "manifest.json").is_file():
        return model, store
    save_tiny_target(model, "llama", hidden_size=256, intermediate_size=512, num_attention_heads=8,
                     num_key_value_heads=4)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "it", "ran", "over", "to", "see", "dog", "who",
             "was", "very", "happy", "about", "rain", "sun", "tree", "water", "light", "house", "green", "blue"]
    rng = random.Random(seed)
    convs = work / "conversations.jsonl"
    with open(convs, "w") as f:
        for i in range(n):
            length = int(rng.lognormvariate(4.5, 1.0))  # a long tail, like real answers
            answer = " ".join(rng.choices(words, k=max(1, min(length, 600))))
            question = " ".join(rng.choices(words, k=rng.randint(3, 12)))
            f.write(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": question},
                                                            {"role": "assistant", "content": answer}]}) + "\n")
    torch.manual_seed(seed)
    run_capture(CaptureConfig(conversations=convs, out=store, target=str(model), max_length=1024,
                              draft_vocab_size=200, progress=False))
    return model, store


def summarize(rows: list[dict], ref_step: int) -> dict:
    """Each measure at the reference step (or the first row, on a shorter run), at the end and at its peak, and the
    end's and the peak's growth over the reference in percent."""
    if not rows:
        return {}
    ref = rows[min(ref_step, len(rows)) - 1]
    last = rows[-1]
    out = {"steps": last["step"], "seconds": last["elapsed_s"], "reference_step": ref["step"]}
    for key in ("VmRSS", "RssAnon", "heap_in_use", "heap_free", "heap_total", "mmapped"):
        if key not in ref:
            continue
        peak = max(r[key] for r in rows[ref["step"] - 1:])
        out[key] = {"at_reference_mb": round(ref[key] / 2**20, 1), "at_end_mb": round(last[key] / 2**20, 1),
                    "peak_mb": round(peak / 2**20, 1),
                    "end_growth_pct": round(100 * (last[key] / ref[key] - 1), 1) if ref[key] else None,
                    "peak_growth_pct": round(100 * (peak / ref[key] - 1), 1) if ref[key] else None}
    return out


def curve_table(runs: dict[str, Path], every: int) -> str:
    """A Markdown table of resident memory and the heap's bytes in use, every ``every`` steps, one column pair per
    run (``runs``: a label and its memory.csv): the curve the docs show."""
    series = {}
    for label, path in runs.items():
        with open(path, newline="") as f:
            series[label] = list(csv.DictReader(f))
    last = min(len(rows) for rows in series.values())
    head = "| step | " + " | ".join(f"{label}: RSS MB | {label}: heap in use MB" for label in series) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(series))]
    for i in [*range(every - 1, last, every), *([last - 1] if last % every else [])]:
        cells = []
        for rows in series.values():
            cells += [f"{int(rows[i]['VmRSS']) / 2**20:,.0f}", f"{int(rows[i].get('heap_in_use') or 0) / 2**20:,.0f}"]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["table"]:  # table LABEL=memory.csv ... [--every N]: the curve of finished runs
        tp = argparse.ArgumentParser(prog="train_memory.py table")
        tp.add_argument("runs", nargs="+", help="LABEL=PATH/memory.csv")
        tp.add_argument("--every", type=int, default=100)
        targs = tp.parse_args(argv[1:])
        print(curve_table(dict(r.split("=", 1) for r in targs.runs), targs.every))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", help="a feature store (default: build a small one with a tiny target in --work)")
    ap.add_argument("--target", help="the store's target (a model path or 'smollm2'); needed with --store")
    ap.add_argument("--work", default="out/train_memory", help="where the tiny store and the run go")
    ap.add_argument("--out", default=None, help="where memory.csv and memory.json go (default: --work)")
    ap.add_argument("--minutes", type=float, default=5.0, help="training's time budget")
    ap.add_argument("--max-steps", type=int, default=100_000)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--ttt-steps", type=int, default=2)
    ap.add_argument("--draft-vocab-size", type=int, default=None, help="train's --draft-vocab-size, used when the "
                    "store built no vocabulary (default: train's; the full preset's is 8192)")
    ap.add_argument("--lr", type=float, default=None, help="train's --lr (default: train's)")
    ap.add_argument("--autocast", default="auto", choices=("auto", "bf16", "off"),
                    help="train's --autocast (bf16 or off skip its probe, minutes on a busy machine)")
    ap.add_argument("--reference-step", type=int, default=200, help="growth is measured from this step on")
    ap.add_argument("--system-malloc", action="store_true", help="glibc's defaults, not the CLI's allocator setting")
    ap.add_argument("--trim-every", type=int, default=None, help="steps between the trainer's release_free_memory "
                    "calls (default: the trainer's own; 0: never, as the trainer before it)")
    args = ap.parse_args(argv)
    if args.store and not args.target:
        ap.error("--store needs --target")

    if args.system_malloc:
        os.environ["DRAFTSMITH_SYSTEM_MALLOC"] = "1"
    from draftsmith.core.allocator import keep_freed_memory
    from draftsmith.core.denormals import flush_denormals

    flush_denormals()
    allocator = keep_freed_memory()  # train as `draftsmith train` does
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from draftsmith.stages.train import loop, train

    if args.trim_every is not None:
        loop.TRIM_EVERY_STEPS = args.trim_every or 10**12
    from draftsmith.stages.train.config import load_config

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out or work)
    out.mkdir(parents=True, exist_ok=True)
    if args.store:
        target, store = args.target, Path(args.store)
    else:
        model, store = build_tiny_store(work)
        target = str(model)
    cfg = load_config(None, dict(target=target, store=str(store), out=str(work / "run"), max_steps=args.max_steps,
                                 max_minutes=args.minutes, ttt_steps=args.ttt_steps, batch_tokens=args.batch_tokens,
                                 max_length=args.max_length, autocast=args.autocast,
                                 eval_every=1000, save_every=1000, train_on="all", progress=False, plot=False,
                                 **{k: v for k, v in (("draft_vocab_size", args.draft_vocab_size),
                                                      ("lr", args.lr)) if v is not None}))
    shutil.rmtree(work / "run", ignore_errors=True)  # a fresh run each time
    sampler = Sampler(out / "memory.csv")
    handle = register_optimizer_step_post_hook(sampler)
    try:
        train(cfg)
    finally:
        handle.remove()
        sampler.close()
        trim_every = loop.TRIM_EVERY_STEPS if loop.TRIM_EVERY_STEPS < 10**12 else 0
        summary = {"store": str(store), "target": target, "allocator_setting": allocator, "trim_every": trim_every,
                   "malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX"), "threads": torch.get_num_threads(),
                   **summarize(sampler.rows, args.reference_step)}
        (out / "memory.json").write_text(json.dumps(summary, indent=2))
        print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
