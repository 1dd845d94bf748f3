"""Train an EAGLE-3 drafter with training-time test, offline (feature store) or online (target in the loop).

The loop is deterministic for a seed: the data order is a function of (seed, epoch), a checkpoint holds
model, optimizer, scheduler, RNG and the data position, and ``resume`` continues exactly where the run
stopped (N steps straight == N/2 + resume + N/2, bit for bit, on the same machine). Under torchrun each
rank takes every world-th batch and gradients are averaged over ranks.

A run directory holds ``config.json``, ``metrics.jsonl`` (one row per log or eval event),
``checkpoints/step-*`` (the last two) with ``checkpoints/latest``, ``best/`` (the drafter with the highest
eval simulated acceptance length, and its ``eval.json``) and ``final/``; with ``plot``, also ``metrics.csv``
and ``training.png``.

Modules: ``config`` (TrainConfig, no torch), ``data`` (sources and batching), ``checkpoints``, ``logs``,
``loop`` (the optimizer steps, teacher, evaluation) and ``run`` (``train``: setup, loop, final save).
The config names import eagerly and the rest on first use, so the CLI builds its parser without torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from draftsmith.stages.train.config import TrainConfig, TrainError, config_hash, load_config

_LAZY = {
    "StoreSource": "data", "OnlineSource": "data", "collate": "data", "split_eval": "data", "make_batches": "data",
    "read_metrics": "logs", "write_csv": "logs", "plot_run": "logs",
    "Teacher": "loop", "evaluate": "loop", "choose_autocast": "precision",
    "TrainResult": "run", "train": "run",
}

__all__ = ["TrainConfig", "TrainError", "config_hash", "load_config", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
