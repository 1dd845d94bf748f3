"""Training-step throughput with this tree's optimizer against the plain AdamW, side by side in one process.

    python bench/bench_train_speed.py [--preset default|full] [--steps 12] [--threads 2]
    python bench/bench_train_speed.py --loop --store DIR --old-src DIR [--target smollm2] [--steps 40] [--rounds 3]

On a machine shared with other work, separate runs minutes apart see different loads (on 2 cores shared by six
processes, one run's tokens/s varied 10x); so one process holds two drafters with the same initial weights and
alternates single steps between them: A, B, A, B, ... Each step is what the trainer's loop does per micro-batch:
the teacher's targets (full-vocabulary argmax cached, as after the first epoch), the TTT forward and backward under
the autocast the trainer would choose, gradient clipping, the optimizer step. A is the plain
``torch.optim.AdamW`` the trainer used before (``foreach``/``fused`` unset: a Python loop of eight passes per
tensor on CPU); B is the optimizer ``run._setup_optimizer`` builds now (fused where torch has it). Everything else
is the same code. Shapes are the preset's drafter on the default target (SmolLM2-135M: width 576, 9 heads, 3 KV
heads, MLP 1,536, vocabulary 49,152) with the preset's draft vocabulary, batch tokens, TTT steps and 1,024-token
cut; samples are random features with seeded lengths (log-normal, median ~330 tokens, every position trained as
with ``train_on = all``): a step's cost depends on the shapes, not the values. Reports tokens/s of each (total
tokens over the sum of step times), and the per-pair ratio's min/median/max.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {"default": {"draft_vocab": 4096, "batch_tokens": 1024, "ttt_steps": 2, "lr": 2e-3},
           "full": {"draft_vocab": 8192, "batch_tokens": 2048, "ttt_steps": 2, "lr": 1e-3}}


def worker(args) -> None:
    """Both optimizers, alternating steps, in this process (started by main with this tree on PYTHONPATH)."""
    import torch

    from draftsmith.core import vocab as vocab_mod
    from draftsmith.model.drafter import DrafterConfig, Eagle3Drafter
    from draftsmith.model.ttt import ttt_forward
    from draftsmith.stages.train.data import collate, every_position, make_batches
    from draftsmith.stages.train.loop import Teacher
    from draftsmith.stages.train.precision import fixed_autocast
    from draftsmith.stages.train.run import _setup_optimizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    p = PRESETS[args.preset]
    vocab, width = 49152, 576
    cfg = DrafterConfig(hidden_size=width, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                        head_dim=64, vocab_size=vocab, draft_vocab_size=p["draft_vocab"], target_hidden_size=width)
    dv = vocab_mod.identity(vocab, p["draft_vocab"])
    embed = torch.nn.Embedding(vocab, width).requires_grad_(False)
    drafter = Eagle3Drafter(cfg, embed, dv)
    autocast = {"auto": fixed_autocast("auto", torch.device("cpu")), "bf16": True, "fp32": False}[args.autocast]
    autocast = bool(autocast)  # None (a CPU the trainer would measure): float32 here
    lm_head = torch.randn(vocab, width) * 0.05
    lm_head = lm_head.bfloat16() if autocast else lm_head
    teacher = Teacher(lm_head, torch.arange(p["draft_vocab"]), dv.t2d, None)
    rng = random.Random(0)
    lengths = [max(32, min(1024, int(rng.lognormvariate(5.8, 0.7)))) for _ in range(args.samples)]
    g = torch.Generator().manual_seed(0)
    samples = [(torch.randint(0, vocab, (n,), generator=g), torch.ones(n, dtype=torch.bool),
                torch.randn(n, 3 * width, generator=g).bfloat16(), torch.randn(n, width, generator=g).bfloat16())
               for n in lengths]
    batches = make_batches(list(range(len(lengths))), lengths, p["batch_tokens"], 0)
    opt_cfg = SimpleNamespace(lr=p["lr"], weight_decay=0.0, warmup_steps=10, min_lr_ratio=0.1,
                              optimizer=args.optimizer, muon_lr=None, muon_weight_decay=None)
    twin = copy.deepcopy(drafter)
    twin.bind_embeddings(embed)
    params_a = [q for q in drafter.parameters() if q.requires_grad]
    runs = {"plain_adamw": (drafter, params_a, torch.optim.AdamW(params_a, lr=p["lr"], betas=(0.9, 0.95)))}
    params_b, opt_b, _ = _setup_optimizer(opt_cfg, twin, 1000, 1)
    runs["this"] = (twin, params_b, opt_b)
    # --threads-ab: A is this tree's optimizer too, on --threads threads; B on one thread
    threads = {"plain_adamw": args.threads, "this": 1 if args.threads_ab else args.threads}
    if args.threads_ab:
        runs["plain_adamw"] = (drafter, params_a, _setup_optimizer(opt_cfg, drafter, 1000, 1)[1])

    def step(name: str, i: int) -> tuple[int, float]:
        model, params, opt = runs[name]
        torch.set_num_threads(threads[name])
        t0 = time.perf_counter()
        idx = batches[i % len(batches)]
        batch = every_position(collate([samples[j] for j in idx], 1024, torch.bfloat16))
        batch.indices = idx
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, _ = ttt_forward(model, batch, teacher(batch), p["ttt_steps"], 0.8)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return batch.num_tokens, time.perf_counter() - t0

    for i in range(min(args.steps, len(batches))):  # warm-up: every timed batch's argmax cached
        step("plain_adamw", i)
        step("this", i)
    timed: dict[str, list[tuple[int, float]]] = {"plain_adamw": [], "this": []}
    for i in range(args.steps):
        order = ("plain_adamw", "this") if i % 2 == 0 else ("this", "plain_adamw")
        for name in order:
            timed[name].append(step(name, i))
    out = {name: {"tokens_per_s": sum(n for n, _ in rows) / sum(t for _, t in rows),
                  "step_s": [round(t, 4) for _, t in rows], "tokens": [n for n, _ in rows]}
           for name, rows in timed.items()}
    out["autocast"] = autocast
    out["fused_adamw"] = bool(getattr(opt_b, "adamw", opt_b).defaults.get("fused"))
    print(json.dumps(out))


def loop_main(args) -> int:
    """The whole training loop, an old tree's against this one's, as the demo runs it (``draftsmith train`` on a
    real store, the default preset's settings), in alternate processes: old, new, new, old, ... per round.

    Each run is a fresh ``--out`` with ``--max-steps``; its tokens/s is the loop's own (the last training row of
    metrics.jsonl: tokens over the loop's time, first visits' argmax, evaluation and checkpoints included), and its
    wall time is the whole process's (start-up and setup included).
    """
    import tempfile

    p = PRESETS[args.preset]
    settings = ["--target", args.target, "--store", args.store, "--max-steps", str(args.steps),
                "--ttt-steps", str(p["ttt_steps"]), "--batch-tokens", str(p["batch_tokens"]), "--max-length", "1024",
                "--lr", str(p["lr"]), "--eval-every", "160", "--save-every", "160", "--warmup-steps", "40",
                "--train-on", "all", "--device", "cpu", "--log-every", "5", "--no-progress"]
    trees = {"old": Path(args.old_src).resolve(), "new": ROOT / "src"}
    rows: dict[str, list[dict]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory(prefix="bench_loop_") as tmp:
        for r in range(args.rounds):
            for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
                out = Path(tmp) / f"{name}-{r}"
                env = {**os.environ, "PYTHONPATH": str(trees[name])}
                load = os.getloadavg()[0]
                t0 = time.perf_counter()
                done = subprocess.run([sys.executable, "-m", "draftsmith.cli", "train", *settings, "--out", str(out)],
                                      env=env, capture_output=True, text=True, check=False)
                wall = time.perf_counter() - t0
                if done.returncode != 0:
                    print(done.stderr[-2000:], file=sys.stderr)
                    return 1
                metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
                last = [m for m in metrics if "tokens_per_s" in m][-1]
                row = {"round": r, "tokens_per_s": last["tokens_per_s"], "wall_s": round(wall, 1),
                       "load_before": round(load, 2), "threads": last.get("threads")}
                rows[name].append(row)
                print(f"round {r} {name}: {row['tokens_per_s']:.0f} tok/s, {wall:.0f} s wall, load {load:.1f}",
                      file=sys.stderr, flush=True)
    stat = {name: {"min": min(x["tokens_per_s"] for x in v), "median": statistics.median(x["tokens_per_s"] for x in v),
                   "max": max(x["tokens_per_s"] for x in v)} for name, v in rows.items()}
    ratios = [n["tokens_per_s"] / o["tokens_per_s"] for o, n in zip(rows["old"], rows["new"], strict=True)]
    result = {"mode": "loop", "preset": args.preset, "cpu": cpu_kind(), "steps": args.steps, "store": args.store,
              "old_src": str(trees["old"]), "load_average_end": os.getloadavg(), "runs": rows, "tokens_per_s": stat,
              "ratio_per_round": [round(x, 2) for x in ratios], "ratio_median": statistics.median(ratios)}
    print(f"{result['cpu']}; loop of `draftsmith train`, {args.preset} preset settings, {args.steps} steps")
    for name in ("old", "new"):
        print(f"{name}: tokens/s min {stat[name]['min']:.0f}, median {stat[name]['median']:.0f}, "
              f"max {stat[name]['max']:.0f}")
    print(f"new/old per round: {', '.join(f'{x:.2f}' for x in ratios)} (median {result['ratio_median']:.2f}); "
          f"load average {result['load_average_end'][0]:.1f} at the end")
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def cpu_kind() -> str:
    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        name = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    have = [f for f in ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2") if f in flags]
    return f"{name} ({', '.join(have) or 'no AVX-512/AMX'}), {os.cpu_count()} logical CPUs"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="default")
    ap.add_argument("--steps", type=int, default=12, help="timed steps of each (after one warm-up pass)")
    ap.add_argument("--samples", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--autocast", choices=("auto", "bf16", "fp32"), default="auto")
    ap.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                    help="the trainer's optimizer that 'this tree' builds (train --optimizer)")
    ap.add_argument("--threads-ab", action="store_true", help="A: this tree's step on --threads threads, B: on one "
                    "thread (what train/threads.py chooses between)")
    ap.add_argument("--out", default="out/bench_train_speed.json")
    ap.add_argument("--loop", action="store_true", help="time the whole `draftsmith train` loop on --store, the "
                    "tree at --old-src against this one")
    ap.add_argument("--store", help="--loop: a feature store (read only)")
    ap.add_argument("--target", default="smollm2", help="--loop: the store's target")
    ap.add_argument("--old-src", help="--loop: an older tree's src/ (git archive REV src | tar -x -C DIR)")
    ap.add_argument("--rounds", type=int, default=3, help="--loop: runs of each, alternated")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.loop:
        if not (args.store and args.old_src):
            ap.error("--loop needs --store and --old-src")
        return loop_main(args)
    cmd = [sys.executable, __file__, "--worker", "--preset", args.preset, "--steps", str(args.steps),
           "--samples", str(args.samples), "--threads", str(args.threads), "--autocast", args.autocast,
           "--optimizer", args.optimizer, *(["--threads-ab"] if args.threads_ab else [])]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(done.stderr, file=sys.stderr)
        return 1
    res = json.loads(done.stdout.strip().splitlines()[-1])
    a, b = res["plain_adamw"], res["this"]
    ratios = [ta / tb for ta, tb in zip(a["step_s"], b["step_s"], strict=True)]  # same batch, adjacent in time
    result = {"preset": args.preset, "cpu": cpu_kind(), "threads": args.threads, "load_average": os.getloadavg(),
              "steps": args.steps, "autocast": res["autocast"], "fused_adamw": res["fused_adamw"],
              "plain_adamw": a, "this": b, "ratio_tokens_per_s": b["tokens_per_s"] / a["tokens_per_s"],
              "ratio_min": min(ratios), "ratio_median": statistics.median(ratios), "ratio_max": max(ratios)}
    print(f"{result['cpu']}; {args.preset} preset, {args.threads} threads, autocast "
          f"{'bf16' if res['autocast'] else 'off'}, load average {result['load_average'][0]:.1f}")
    names = (f"{args.threads} threads", "1 thread") if args.threads_ab else ("plain AdamW", "this tree")
    result["threads_ab"] = args.threads_ab
    print(f"{names[0]} {a['tokens_per_s']:.0f} tok/s, {names[1]} {b['tokens_per_s']:.0f} tok/s: "
          f"{result['ratio_tokens_per_s']:.2f}x; per-step ratio over {len(ratios)} pairs: min "
          f"{result['ratio_min']:.2f}, median {result['ratio_median']:.2f}, max {result['ratio_max']:.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
