"""The optimizer step alone: fused AdamW against Muon + AdamW on the default preset's EAGLE-3 drafter.

    python bench/bench_optimizer_step.py [--steps 20] [--draft-vocab 4096]

Muon orthogonalises each hidden matrix's update with five Newton-Schulz iterations, a few matrix products per
matrix and step, independent of the batch; on a small drafter trained with small batches that can be a visible
share of a step. One process, the same drafter (the trainer's ``_setup_drafter`` on SmolLM2-135M's heads) and
the same random gradients, steps alternated A, B, A, B ...; prints min and median seconds of each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from draftsmith.core.vocab import identity
from draftsmith.model.target import load_target_heads
from draftsmith.stages.train.config import TrainConfig
from draftsmith.stages.train.optim import build_optimizer
from draftsmith.stages.train.run import _fused_adamw_ok, _setup_drafter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--target", default="smollm2")
    args = ap.parse_args()
    heads = load_target_heads(args.target, dtype=torch.float32)
    times: dict[str, list[float]] = {"adamw": [], "muon": []}
    runs = {}
    for name in times:
        cfg = TrainConfig(target=args.target, store=".", optimizer=name, lr=2e-3)
        drafter = _setup_drafter(cfg, heads, identity(heads.vocab_size, args.draft_vocab), (), "cpu", torch.float32)
        params = [p for p in drafter.parameters() if p.requires_grad]
        runs[name] = (params, build_optimizer(cfg, drafter, _fused_adamw_ok(params)))
    g = torch.Generator().manual_seed(0)
    for i in range(args.steps + 1):
        for name, (params, opt) in runs.items():
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            t0 = time.perf_counter()
            opt.step()
            if i:  # the first is a warm-up
                times[name].append(time.perf_counter() - t0)
    n = sum(p.numel() for p in runs["adamw"][0])
    print(json.dumps({"parameters": n, "threads": torch.get_num_threads(), "load": os.getloadavg()[0],
                      **{k: {"min_s": round(min(v), 4), "median_s": round(statistics.median(v), 4)}
                         for k, v in times.items()}}))


if __name__ == "__main__":
    main()
