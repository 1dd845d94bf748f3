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


def load_checkpoint(out: Path, cfg: TrainConfig, drafter, opt, sched) -> dict:
    latest = out / "checkpoints" / "latest"
    if not latest.is_file():
        raise TrainError(f"--resume: no checkpoint in {out / 'checkpoints'}")
    saved_cfg = json.loads((out / "config.json").read_text())
    if config_hash(TrainConfig(**saved_cfg)) != config_hash(cfg):
        diff = [k for k, v in dataclasses.asdict(cfg).items() if k not in _RESUMABLE and saved_cfg.get(k) != v]
        raise TrainError(f"--resume: {out} was trained with another config (differs in {', '.join(diff)})")
    path = out / "checkpoints" / latest.read_text().strip()
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
