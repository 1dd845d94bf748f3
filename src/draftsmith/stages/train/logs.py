"""What a run reports: metrics.jsonl as it goes, a progress bar, and metrics.csv + training.png at the end."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

from draftsmith.core.io import atomic_write
from draftsmith.stages.train.config import TrainConfig


class MetricsLog:
    """metrics.jsonl: one JSON object per log/eval event, appended (eval rows carry ``eval: true``)."""

    def __init__(self, out: Path, rank: int):
        self.path = out / "metrics.jsonl"
        self.rank = rank

    def drop_after(self, step: int) -> None:
        """Keep only rows up to ``step`` (atomically): a resume from step S re-runs, and re-logs, S+1 onwards.

        A line a killed run left half-written is dropped too.
        """
        if self.rank != 0 or not self.path.is_file():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
                kept.append(line + "\n")
        atomic_write(self.path, "".join(kept).encode())

    def write(self, **row) -> None:
        if self.rank != 0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def progress_bar(cfg: TrainConfig, rank: int, total: int, initial: int):
    if not cfg.progress or rank != 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)


def read_metrics(out: Path) -> list[dict]:
    path = Path(out) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def write_csv(out: Path) -> Path:
    """metrics.csv: the rows of metrics.jsonl, one column per key any row has (blank where a row lacks it)."""
    rows = read_metrics(out)
    keys = sorted({k for r in rows for k in r})
    path = Path(out) / "metrics.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return path


def plot_run(out: Path) -> Path | None:
    """metrics.csv, then training.png: train and eval loss by step, and the last evaluation's per-step accuracy.

    Returns the PNG's path, or None (with only the CSV written) when matplotlib is not installed.
    """
    write_csv(out)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = read_metrics(out)
    train_rows = [r for r in rows if not r.get("eval") and "loss" in r]  # not the budget plan's row
    eval_rows = [r for r in rows if r.get("eval")]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    if train_rows:
        axes[0].plot([r["step"] for r in train_rows], [r["loss"] for r in train_rows], label="train loss")
    if eval_rows:
        axes[0].plot([r["step"] for r in eval_rows], [r["loss"] for r in eval_rows], label="eval loss")
        last = eval_rows[-1]
        acc = [last[k] for k in sorted((k for k in last if k.startswith("eval_acc_")), key=lambda k: int(k[9:]))]
        axes[1].bar(range(len(acc)), acc)
        axes[1].set_title(f"eval acc_i at step {last['step']} (simulated tau {last['simulated_tau']:.2f})")
        axes[1].set_xlabel("TTT step i")
        axes[1].set_ylim(0, 1)
    axes[0].set_xlabel("step")
    axes[0].legend()
    fig.tight_layout()
    path = Path(out) / "training.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
