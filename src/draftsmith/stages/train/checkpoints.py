"""Checkpoints that make ``resume`` exact: model, optimizer, scheduler, RNG and the data position.

Every save goes to a temporary directory renamed into place, so a run killed mid-save leaves the previous
checkpoint intact (and at worst a ``.tmp`` directory), never a half-written one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path

import torch

from draftsmith.core.errors import one_line
from draftsmith.model.drafter import Eagle3Drafter
from draftsmith.stages.train.config import _RESUMABLE, TrainConfig, TrainError, config_hash


def save_drafter_atomic(drafter: Eagle3Drafter, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    drafter.save(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def save_checkpoint(out: Path, drafter, opt, sched, state: dict, rank: int) -> None:
    if rank != 0:
        return
    ckpt_dir = out / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / f"step-{state['step']:07d}"
    tmp = ckpt_dir / f".tmp-step-{state['step']:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    drafter.save(tmp / "drafter")
    version, internal, gauss = random.getstate()  # lists, not a tuple of tuples: loadable with weights_only
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "state": dict(state),
                "rng": torch.get_rng_state(), "python_rng": [version, list(internal), gauss]},
               tmp / "trainer_state.pt")
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)  # a killed save leaves only a .tmp directory, never a half checkpoint
    (ckpt_dir / "latest.tmp").write_text(path.name)
    os.replace(ckpt_dir / "latest.tmp", ckpt_dir / "latest")
    for old in sorted(ckpt_dir.glob("step-*"))[:-2]:  # keep the last two
        shutil.rmtree(old, ignore_errors=True)


_STEP_NAME = re.compile(r"step-\d{7}")


def _complete(path: Path) -> bool:
    """A step directory holding everything a resume reads (a renamed one always does; a hand-edited one may not)."""
    return (path / "drafter" / "model.safetensors").is_file() and (path / "trainer_state.pt").is_file()


def newest_checkpoint(out: Path) -> Path | None:
    """The checkpoint a resume continues from: the one ``latest`` names, else the newest complete ``step-N``.

    A run killed between renaming its first ``step-N`` into place and writing ``latest`` leaves a complete
    checkpoint and no pointer. ``latest`` names a directory inside ``checkpoints/``; anything else is refused,
    so an edited pointer cannot make a resume read files outside the run.
    """
    ckpt_dir = out / "checkpoints"
    latest = ckpt_dir / "latest"
    if latest.is_file():
        try:
            name = latest.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise TrainError(f"--resume: cannot read {latest} ({one_line(e)})") from e
        if not _STEP_NAME.fullmatch(name):
            raise TrainError(f"--resume: {latest} names {name[:80]!r}, not a step-NNNNNNN directory inside "
                             f"{ckpt_dir}")
        if _complete(ckpt_dir / name):
            return ckpt_dir / name
    steps = sorted(p for p in ckpt_dir.glob("step-*") if _STEP_NAME.fullmatch(p.name) and p.is_dir()
                   and not p.is_symlink() and _complete(p)) if ckpt_dir.is_dir() else []
    return steps[-1] if steps else None


def read_run_config(out: Path) -> dict:
    """The run's saved ``config.json`` as a dict of TrainConfig fields, or a TrainError naming the file."""
    path = out / "config.json"
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise TrainError(f"--resume: {path} is missing: not a run directory train wrote") from e
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise TrainError(f"--resume: {path} is not valid JSON ({type(e).__name__}: {one_line(e)[:200]})") from e
    if not isinstance(saved, dict):
        raise TrainError(f"--resume: {path} holds a JSON {type(saved).__name__}, not the run's config object")
    unknown = sorted(set(saved) - set(TrainConfig.fields()))
    if unknown:
        raise TrainError(f"--resume: {path} has keys no TrainConfig field has: {', '.join(map(str, unknown))[:200]}")
    return saved


def load_checkpoint(out: Path, cfg: TrainConfig, drafter, opt, sched) -> dict:
    path = newest_checkpoint(out)
    if path is None:
        raise TrainError(f"--resume: no checkpoint in {out / 'checkpoints'}")
    saved_cfg = read_run_config(out)
    try:
        saved_hash = config_hash(TrainConfig(**saved_cfg))
    except TypeError as e:
        raise TrainError(f"--resume: {out / 'config.json'} is not a run config ({one_line(e)[:200]})") from e
    if saved_hash != config_hash(cfg):
        diff = [k for k, v in dataclasses.asdict(cfg).items() if k not in _RESUMABLE and saved_cfg.get(k) != v]
        raise TrainError(f"--resume: {out} was trained with another config (differs in {', '.join(diff)})")
    from safetensors.torch import load_file

    weights = load_file(str(path / "drafter" / "model.safetensors"))
    drafter.load_state_dict(weights, strict=False)
    blob = _load_trainer_state(path / "trainer_state.pt")
    try:
        opt.load_state_dict(blob["optimizer"])
        sched.load_state_dict(blob["scheduler"])
        torch.set_rng_state(blob["rng"])
        version, internal, gauss = blob["python_rng"]
        random.setstate((version, tuple(internal), gauss))
        state = dict(blob["state"])
        int(state["step"]), int(state["epoch"]), int(state["batch_in_epoch"]), float(state["best_tau"])
    except (KeyError, IndexError, ValueError, TypeError, RuntimeError) as e:
        raise TrainError(f"--resume: {path / 'trainer_state.pt'} is not a trainer state this run can continue "
                         f"from ({type(e).__name__}: {one_line(e)[:200]})") from e
    return state


def _load_trainer_state(path: Path) -> dict:
    """The trainer state, unpickled with ``weights_only``: a run directory is untrusted input, never code.

    Only tensors and plain containers load; a file holding any other object is refused without running it.
    """
    try:
        blob = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise TrainError(f"--resume: refused {path}: it holds objects other than tensors and plain data "
                         f"(not a trainer state draftsmith wrote; nothing in it was run)") from e
    except (OSError, EOFError, RuntimeError, ValueError) as e:
        raise TrainError(f"--resume: cannot read {path} ({type(e).__name__}: {one_line(e)[:200]})") from e
    if not isinstance(blob, dict):
        raise TrainError(f"--resume: {path} is not a trainer state (a {type(blob).__name__}, not a dict)")
    return blob
