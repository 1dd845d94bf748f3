"""Training-step throughput of this tree against another git ref, side by side on the same machine.

    python bench/bench_train_speed.py --base main [--preset default|full] [--rounds 5] [--steps 6]

Each round runs one worker process per tree, interleaved (base, this, base, this, ...), so that load from other
processes on a shared machine hits both alike; each worker imports its own tree's draftsmith (``git archive`` of
``--base`` into a temporary folder) and times ``--steps`` optimizer steps after warm-up. A step is what the
trainer's loop does per micro-batch: the teacher's targets (full-vocabulary argmax cached, as after the first
epoch), the TTT forward and backward under the autocast the trainer would choose, gradient clipping and the
optimizer step built by ``run._setup_optimizer``. Shapes are the preset's drafter on the default target
(SmolLM2-135M: width 576, 9 heads, 3 KV heads, MLP 1,536, vocabulary 49,152) with the preset's draft vocabulary,
batch tokens, TTT steps and 1,024-token cut; the samples are random features with seeded lengths (log-normal,
median ~330 tokens, every position trained as with ``train_on = all``): the cost of a step depends on the
shapes, not the values. Reports tokens/s per round, the per-round ratio, and its min/median/max.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {"default": {"draft_vocab": 4096, "batch_tokens": 1024, "ttt_steps": 2, "lr": 2e-3},
           "full": {"draft_vocab": 8192, "batch_tokens": 2048, "ttt_steps": 2, "lr": 1e-3}}


def worker(args) -> None:
    """One tree's timing (runs in a subprocess whose PYTHONPATH points at that tree)."""
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
    opt_cfg = SimpleNamespace(lr=p["lr"], weight_decay=0.0, warmup_steps=10, min_lr_ratio=0.1)
    params, opt, sched = _setup_optimizer(opt_cfg, drafter, 1000, 1)

    def step(i: int) -> int:
        idx = batches[i % len(batches)]
        batch = every_position(collate([samples[j] for j in idx], 1024, torch.bfloat16))
        batch.indices = idx
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, _ = ttt_forward(drafter, batch, teacher(batch), p["ttt_steps"], 0.8)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        return batch.num_tokens

    n = args.steps
    for i in range(n):  # warm-up: caches every timed batch's argmax, as after the trainer's first epoch
        step(i)
    t0, tokens = time.perf_counter(), 0
    for i in range(n):
        tokens += step(i)
    seconds = time.perf_counter() - t0
    print(json.dumps({"tokens_per_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
                      "autocast": autocast, "fused_adamw": bool(opt.defaults.get("fused"))}))


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
    ap.add_argument("--base", default="main", help="git ref to compare against (default main)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="default")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per worker (as many untimed before)")
    ap.add_argument("--samples", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--autocast", choices=("auto", "bf16", "fp32"), default="auto")
    ap.add_argument("--out", default="out/bench_train_speed.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.base, "src"], capture_output=True,
                                 check=False)
        if archive.returncode != 0:
            print(f"bench_train_speed: git archive {args.base} failed: {archive.stderr.decode().strip()}",
                  file=sys.stderr)
            return 2
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        trees = {"base": Path(tmp) / "src", "this": ROOT / "src"}
        cmd = [sys.executable, __file__, "--worker", "--preset", args.preset, "--steps", str(args.steps),
               "--samples", str(args.samples), "--threads", str(args.threads), "--autocast", args.autocast]
        rounds = []
        for r in range(args.rounds):
            row = {}
            for name, src in trees.items():
                env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": str(args.threads)}
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    print(done.stderr, file=sys.stderr)
                    return 1
                row[name] = json.loads(done.stdout.strip().splitlines()[-1])
            row["ratio"] = row["this"]["tokens_per_s"] / row["base"]["tokens_per_s"]
            rounds.append(row)
            print(f"round {r + 1}: base {row['base']['tokens_per_s']:.0f} tok/s, this "
                  f"{row['this']['tokens_per_s']:.0f} tok/s, ratio {row['ratio']:.2f}", flush=True)
    ratios = [r["ratio"] for r in rounds]
    result = {"preset": args.preset, "base": args.base, "cpu": cpu_kind(), "threads": args.threads,
              "load_average": os.getloadavg(), "steps": args.steps, "rounds": rounds,
              "ratio_min": min(ratios), "ratio_median": statistics.median(ratios), "ratio_max": max(ratios),
              "base_tokens_per_s_max": max(r["base"]["tokens_per_s"] for r in rounds),
              "this_tokens_per_s_max": max(r["this"]["tokens_per_s"] for r in rounds)}
    print(f"{result['cpu']}; {args.preset} preset, {args.threads} threads, "
          f"load average {result['load_average'][0]:.1f}")
    print(f"ratio this/base over {len(ratios)} rounds: min {result['ratio_min']:.2f}, median "
          f"{result['ratio_median']:.2f}, max {result['ratio_max']:.2f}; best tok/s base "
          f"{result['base_tokens_per_s_max']:.0f}, this {result['this_tokens_per_s_max']:.0f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
