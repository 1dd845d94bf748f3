"""Training configuration: plain data, no torch import (the CLI builds its parser from it quickly)."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

from draftsmith.core.errors import DraftsmithError


class TrainError(DraftsmithError, ValueError):
    """A run that cannot start or continue: bad config, mismatched store or resume directory, NaN loss."""


@dataclass
class TrainConfig:
    target: str = "smollm2"  # model dir / .gguf / 'smollm2': offline mode reads only its embed + lm_head
    store: str | None = None  # offline: a feature store written by `draftsmith capture`
    conversations: str | None = None  # online: conversations JSONL; the target runs inside the loop
    out: str = "runs/drafter"
    vocab: str | None = None  # d2t/t2d file; default: the store's vocab.safetensors
    draft_vocab_size: int = 32000  # used when the vocab is built on the fly (online mode)
    init_drafter: str | None = None  # start from an existing drafter instead of random weights
    init_head: bool = False  # a fresh drafter's lm_head and norm start as the target's head rows and final norm
    ttt_steps: int = 7
    step_decay: float = 0.8
    teacher_temperature: float = 1.0  # soft labels' temperature (0: one-hot); README: 1 measured best
    # Which positions train: "answers" (assistant tokens, what decoding drafts) or "all" (the prompts too: the
    # teacher is the target's distribution at every position, so prompts are more of the same lesson).
    # Evaluation always scores answers.
    train_on: str = "answers"
    epochs: int = 1
    train_samples: int = 0  # 0: every training sample; N: the first N by id hash (data-scaling curves)
    max_steps: int = 0  # 0: as many optimizer steps as `epochs` give
    # 0: no bound. Else the step count (at most max_steps/epochs') is planned after the warm-up, and again at each
    # evaluation, to end within this many minutes of the run's start (train/budget.py); the checkpoint keeps it.
    max_minutes: float = 0.0
    batch_tokens: int = 2048  # tokens per micro-batch (length-bucketed, right-padded)
    grad_accum: int = 1
    lr: float = 1e-4
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    eval_fraction: float = 0.05
    eval_every: int = 50
    save_every: int = 50
    log_every: int = 10
    max_length: int = 2048
    seed: int = 0
    device: str = "cpu"
    dtype: str = "auto"  # target dtype in online mode; auto: float32 on CPU, bfloat16 on CUDA
    autocast: str = "auto"  # bf16 matmuls over fp32 master weights; auto: on for CUDA and for CPUs with AMX
    force: bool = False  # train on a store made for another target anyway
    resume: bool = False
    stop_at_step: int = 0  # stop (with a checkpoint) after this step: for interruptions and tests
    plot: bool = True
    progress: bool = True

    @classmethod
    def fields(cls) -> dict[str, dataclasses.Field]:
        return {f.name: f for f in dataclasses.fields(cls)}


# Fields that may change between a run and its resumption (they do not change what is computed).
# max_minutes: a plan, once made, is in the checkpoint; a resume with another budget keeps it.
_RESUMABLE = {"resume", "stop_at_step", "progress", "plot", "log_every", "force", "device", "max_minutes"}


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> TrainConfig:
    """A config file (TOML or YAML) with command-line overrides; unknown keys name the closest valid one."""
    values: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"{path}: no such config file")
        values = _read_config_file(p)
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    known = TrainConfig.fields()
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TrainError(f"unknown config key {key!r}{hint}")
    cfg = TrainConfig(**values)
    if (cfg.store is None) == (cfg.conversations is None):
        raise TrainError("give exactly one data source: store (offline) or conversations (online)")
    if cfg.autocast not in ("auto", "bf16", "off"):
        raise TrainError(f"autocast must be auto, bf16 or off, not {cfg.autocast!r}")
    if cfg.ttt_steps < 1 or cfg.batch_tokens < 2 or cfg.grad_accum < 1:
        raise TrainError("ttt_steps, grad_accum must be >= 1 and batch_tokens >= 2")
    if cfg.teacher_temperature < 0:
        raise TrainError(f"teacher_temperature must be >= 0 (0: one-hot labels), not {cfg.teacher_temperature}")
    if cfg.train_on not in ("answers", "all"):
        raise TrainError(f"train_on must be answers or all, not {cfg.train_on!r}")
    if cfg.max_minutes < 0:
        raise TrainError(f"max_minutes must be >= 0 (0: no time bound), not {cfg.max_minutes}")
    if cfg.train_samples < 0:
        raise TrainError(f"train_samples must be >= 0 (0: all), not {cfg.train_samples}")
    return cfg


def _read_config_file(p: Path) -> dict:
    """A TOML or YAML (safe_load: tags that build objects are refused) file's table, its [train] section if any."""
    try:
        text = p.read_text(encoding="utf-8")
        if p.suffix in (".yaml", ".yml"):
            import yaml

            values = yaml.safe_load(text) or {}
        else:
            values = tomllib.loads(text)
    except Exception as e:  # UnicodeDecodeError, TOMLDecodeError, every yaml.YAMLError: the file, on one line
        raise TrainError(f"{p}: not a readable config file ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
                         ) from e
    values = values.get("train", values) if isinstance(values, dict) else values
    if not isinstance(values, dict):
        raise TrainError(f"{p}: a config file holds a table of fields, not a {type(values).__name__}")
    return values


# Fields added after runs existed: hashed only off their default, so those runs still resume.
_ADDED_LATER = {"teacher_temperature": 1.0, "train_on": "answers"}


def config_hash(cfg: TrainConfig) -> str:
    d = {k: v for k, v in dataclasses.asdict(cfg).items()
         if k not in _RESUMABLE and _ADDED_LATER.get(k, object()) != v}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
