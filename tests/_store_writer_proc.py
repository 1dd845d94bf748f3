"""Subprocess for the kill -9 test: writes deterministic synthetic samples to a feature store.

Usage: python _store_writer_proc.py ROOT N [--shard-max-bytes B] [--flush-every K] [--sleep S] [--dtype D]

Skips ids already committed (resume), so rerunning after a SIGKILL must complete the store with every
sample exactly once. Prints the writer's counters as JSON on success.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

HIDDEN = 16
NUM_AUX = 3
META = {"aux_layer_ids": [1, 4, 7], "hidden_size": HIDDEN, "target": "synthetic", "tokenizer": "synthetic"}


def sample_id(i: int) -> str:
    return f"sample-{i:05d}"


def synth_sample(i: int) -> dict[str, torch.Tensor]:
    """Sample `i`, a pure function of `i` so the test can recompute what should be in the store."""
    g = torch.Generator().manual_seed(10_000 + i)
    t = 3 + (i * 7) % 19
    return {
        "input_ids": torch.randint(0, 50_000, (t,), generator=g, dtype=torch.int64),
        "loss_mask": torch.rand(t, generator=g) > 0.3,
        "aux_hidden_states": torch.randn(t, NUM_AUX, HIDDEN, generator=g) * (1 + i % 5),
        "hidden_state": torch.randn(t, HIDDEN, generator=g),
    }


def main() -> None:
    from draftsmith.data.store import FeatureStoreWriter

    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("n", type=int)
    ap.add_argument("--shard-max-bytes", type=int, default=4096)
    ap.add_argument("--flush-every", type=int, default=3)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--dtype", default="bf16")
    args = ap.parse_args()

    with FeatureStoreWriter(
        args.root,
        meta=META,
        dtype=args.dtype,
        shard_max_bytes=args.shard_max_bytes,
        flush_every=args.flush_every,
    ) as w:
        for i in range(args.n):
            sid = sample_id(i)
            if w.has(sid):
                w.skipped_existing += 1  # mirror what add() would count, without regenerating
                continue
            s = synth_sample(i)
            assert w.add(sid, s["input_ids"], s["loss_mask"], s["aux_hidden_states"], s["hidden_state"])
            if args.sleep:
                time.sleep(args.sleep)
    counters = {"written": w.written, "skipped": w.skipped_existing, "rejected": w.rejected_nonfinite}
    print(json.dumps(counters), flush=True)


if __name__ == "__main__":
    main()
