"""``train``: set a run up (data source, teacher, drafter, optimizer, scheduler, resume state), loop, save.

Each ``_setup_x`` builds one piece in the order the run has always built them (the order fixes what the
seeded RNG yields), and ``loop.train_loop`` runs the optimizer steps.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from draftsmith.core import vocab as vocab_mod
from draftsmith.core.conventions import default_aux_layers
from draftsmith.model.drafter import Eagle3Drafter, new_drafter
from draftsmith.stages.train.checkpoints import load_checkpoint, newest_checkpoint, save_drafter_atomic
from draftsmith.stages.train.config import NORM_FIELDS, TrainConfig, TrainError, config_hash
from draftsmith.stages.train.data import OnlineSource, StoreSource, first_samples, make_batches, split_eval
from draftsmith.stages.train.kinds import block_overrides, check_drafter_layers, init_head, objective_for
from draftsmith.stages.train.logs import MetricsLog, plot_run, progress_bar
from draftsmith.stages.train.loop import (
    Run,
    Teacher,
    dist_info,
    setup_distributed,
    teardown_distributed,
    train_loop,
)
from draftsmith.stages.train.optim import build_optimizer
from draftsmith.stages.train.precision import choose_autocast, measure_autocast

LOCK_NAME = ".train.lock"


@dataclass
class TrainResult:
    out: Path
    steps: int
    best_simulated_acceptance_length: float
    last_eval: dict
    rank: int = 0  # under torchrun only rank 0 reports (the others' evaluation numbers are not the run's)


def train(cfg: TrainConfig) -> TrainResult:
    from dataclasses import replace

    from draftsmith.core.device import resolve_device

    cfg.validate()
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise TrainError(f"--out {out}: exists and is not a directory (a run directory is written there)")
    cfg = replace(cfg, device=resolve_device(cfg.device))
    owns_group = setup_distributed(cfg.device)
    rank, world = dist_info()
    lock, ok = None, False
    created = [p for p in (out, out / LOCK_NAME) if not p.exists()]  # what a failed run takes away again
    try:
        _check_paths(cfg)
        lock = _lock_out(out, rank)
        result = _train(cfg, rank, world, out)
        ok = True
        return result
    finally:
        if lock is not None:
            if not ok:
                _remove_leftovers(created, lock.path)
            lock.release()
        if owns_group:
            teardown_distributed(ok)


def _check_paths(cfg: TrainConfig) -> None:
    """Refuse input paths that cannot work before ``--out`` is created or locked (one line, nothing left behind).

    A ``--vocab`` that is missing would silently train on the identity vocabulary; a FIFO as conversations
    would block forever while the run holds its lock.
    """
    for flag, value in (("--vocab", cfg.vocab), ("--conversations", cfg.conversations)):
        if value is None:
            continue
        p = Path(value)
        if not p.exists():
            raise TrainError(f"{flag} {p}: no such file")
        if not p.is_file():
            raise TrainError(f"{flag} {p}: not a regular file (a directory, FIFO or device cannot be read here)")
    if cfg.store is not None and not Path(cfg.store).is_dir():
        raise TrainError(f"--store {cfg.store}: no such feature store directory")


def _remove_leftovers(created: list[Path], lock_path: Path) -> None:
    """After a failed start: the lock file and ``--out`` itself when this run created them and left nothing else."""
    import contextlib

    for p in reversed(created):  # the lock file before the directory holding it
        with contextlib.suppress(OSError):
            if p == lock_path:
                p.unlink()
            elif p.is_dir():
                p.rmdir()  # only when empty: a run that wrote anything keeps it


def _lock_out(out: Path, rank: int):
    """Rank 0 holds ``OUT/.train.lock`` for the whole run: a second run into the same --out is refused."""
    if rank != 0:
        return None
    from draftsmith.core.io import ExclusiveLock, LockHeld

    out.mkdir(parents=True, exist_ok=True)
    try:
        return ExclusiveLock(out / LOCK_NAME, "this run directory")
    except LockHeld as e:
        raise TrainError(f"another train run is using {out} ({out / LOCK_NAME} is locked); wait for it to "
                         f"finish or choose another --out") from e


def _train(cfg: TrainConfig, rank: int, world: int, out: Path) -> TrainResult:
    started = time.perf_counter()
    device = _setup_device(cfg, world)
    dtype = _resolve_dtype(cfg)
    compute_dtype = torch.float32  # master weights; matmuls under bf16 autocast where that pays
    torch.manual_seed(cfg.seed)

    source, heads, aux_layers, dv = _setup_source(cfg, device, dtype, compute_dtype)
    drafter = _setup_drafter(cfg, heads, dv, aux_layers, device, compute_dtype, getattr(source, "target", None))
    objective = objective_for(cfg, drafter)
    train_idx, eval_idx = split_eval(source.ids, cfg.eval_fraction)
    train_idx = first_samples(source.ids, train_idx, cfg.train_samples)
    step_ceiling = _total_steps(cfg, train_idx, source.lengths, world)
    params, opt, sched = _setup_optimizer(cfg, drafter, step_ceiling, world)
    state = _setup_state(cfg, out, drafter, opt, sched, world)
    total_steps = int(state.get("planned_steps", step_ceiling))  # a time budget's plan (its schedule is restored)
    started -= state.get("elapsed_s", 0.0)  # a resumed run's budget counts the time its checkpoint already spent
    autocast = _setup_autocast(cfg, device, drafter, heads, source, train_idx, state, compute_dtype, rank, world,
                               objective)
    teacher = _setup_teacher(drafter, heads, device, autocast, compute_dtype, cfg.teacher_temperature)
    log = MetricsLog(out, rank)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
        # The steps after the checkpoint run again: their old rows go, so each step is logged once. A fresh run
        # (in a directory a run killed before its first checkpoint left) drops every row of that run.
        log.drop_after(int(state["step"]) if cfg.resume else -1)

    bar = progress_bar(cfg, rank, total_steps, state["step"])
    threads = torch.get_num_threads()  # the loop may choose another count (train/threads.py): put it back after
    try:
        last_eval = train_loop(Run(cfg, out, device, autocast, rank, world, source, train_idx, eval_idx, total_steps,
                                   step_ceiling, drafter, teacher, objective, params, opt, sched, state, log, bar,
                                   started))
    finally:
        torch.set_num_threads(threads)
    if bar is not None:
        bar.close()
    if rank == 0:
        save_drafter_atomic(drafter, out / "final")
        if not (out / "best").exists():
            save_drafter_atomic(drafter, out / "best")
        if cfg.plot:
            plot_run(out)
    return TrainResult(out, state["step"], state["best_tau"], last_eval, rank)


# --- setup ------------------------------------------------------------------------------------------------
def _setup_device(cfg: TrainConfig, world: int) -> torch.device:
    """The configured device; under torchrun with CUDA, this rank's GPU."""
    return torch.device(cfg.device if not cfg.device.startswith("cuda") or world == 1
                        else f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")


def _resolve_dtype(cfg: TrainConfig) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if cfg.device.startswith("cuda") else torch.float32
    return getattr(torch, cfg.dtype)


def _setup_source(cfg: TrainConfig, device: torch.device, dtype: torch.dtype, compute_dtype: torch.dtype):
    """The data source and the target pieces it needs: (source, heads, aux layer ids, draft vocab).

    Offline reads only the target's embedding and lm_head; online loads the whole target into the loop.
    The draft vocabulary comes from ``cfg.vocab``, else the store's, else (online) the conversations' tokens,
    else the identity over the first ``draft_vocab_size`` ids.
    """
    if cfg.store is not None:
        from draftsmith.data.store import FeatureStore
        from draftsmith.model.target import load_target_heads

        store = FeatureStore(cfg.store, out_dtype=compute_dtype)
        heads = load_target_heads(cfg.target, device=str(device), dtype=compute_dtype)
        _check_store(store, heads, cfg)
        _verify_store(store)
        source = StoreSource(store, cfg.max_length, compute_dtype)
        aux_layers = tuple(store.meta.get("aux_layer_ids") or ())
        vocab_path = Path(cfg.vocab) if cfg.vocab else Path(cfg.store) / "vocab.safetensors"
        dv = vocab_mod.load_vocab(vocab_path, heads.vocab_size) if vocab_path.is_file() else None
    else:
        from draftsmith.model.target import heads_of, load_target

        target = load_target(cfg.target, device=str(device), dtype=dtype)
        heads = heads_of(target)
        source = OnlineSource(target, cfg.conversations, cfg.max_length)
        aux_layers = target.aux_layers
        dv = vocab_mod.load_vocab(Path(cfg.vocab), heads.vocab_size) if cfg.vocab else None
        if dv is None:
            dv = _vocab_from_items(source, heads.vocab_size, cfg.draft_vocab_size)
    if dv is None:
        dv = vocab_mod.identity(heads.vocab_size, cfg.draft_vocab_size)
    return source, heads, aux_layers, dv


def _check_store(store, heads, cfg: TrainConfig) -> None:
    """Refuse a store captured from another target (unless forced): it would train on the wrong features."""
    from draftsmith.data.store import StoreMismatch, check_store_matches_target

    try:
        check_store_matches_target(store, heads, force=cfg.force)
    except StoreMismatch as e:
        raise TrainError(f"{e} (pass --force to train on it anyway)") from e


def _verify_store(store) -> None:
    """sha256 every shard before the first step: a bad late shard must not stop a long run mid-way.

    Hashing reads each shard once, which is cheap next to training; the reads during training skip it.
    """
    from draftsmith.data.store import StoreCorrupt

    try:
        store.verify_all()
    except StoreCorrupt as e:
        raise TrainError(str(e)) from e


def _vocab_from_items(source: OnlineSource, vocab_size: int, draft_vocab_size: int) -> vocab_mod.DraftVocab:
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for ids, mask in source.items:
        counts.index_add_(0, ids[mask], torch.ones(int(mask.sum()), dtype=torch.float64))
    dv, _coverage = vocab_mod.from_counts(counts, draft_vocab_size)
    return dv


def _setup_drafter(cfg, heads, dv, aux_layers, device, dtype, target=None) -> Eagle3Drafter:
    """``cfg.init_drafter`` bound to the target's embedding, or a fresh drafter of ``cfg.kind`` sized from the
    target's config. ``target``: the loaded target (online), whose aux layers a block drafter points at its own."""
    from draftsmith.model.kinds import get_kind

    if cfg.init_drafter:
        drafter = get_kind(cfg.kind).load(cfg.init_drafter, device=device, dtype=dtype)
        check_drafter_layers(cfg, drafter, aux_layers, target)
        drafter.bind_embeddings(heads.embed_tokens)
        return drafter.train()

    from types import SimpleNamespace

    from draftsmith.core.fingerprint import target_fingerprint

    n_layers = int(heads.config.num_hidden_layers)
    fingerprint = target_fingerprint(heads.config)
    # The few attributes the drafters' from_target and new_* read; the full target need not be loaded.
    like_target = target or SimpleNamespace(
        config=heads.config, vocab_size=heads.vocab_size, hidden_size=heads.hidden_size,
        embed_tokens=heads.embed_tokens, aux_layers=aux_layers or default_aux_layers(n_layers),
        device=torch.device(device), dtype=dtype, fingerprint=lambda: fingerprint, num_layers=n_layers,
        name=cfg.target, tokenizer=None, set_aux_hidden_state_layers=lambda layers: None)
    if cfg.kind == "eagle3":
        norms = {k: getattr(cfg, k) for k in NORM_FIELDS}  # EAGLE-3.1 switches (all off: EAGLE-3)
        drafter = new_drafter(like_target, draft_vocab=dv, seed=cfg.seed, **norms)
    else:
        overrides = block_overrides(cfg, (aux_layers or None) if target is None else None)
        drafter = get_kind(cfg.kind).new(like_target, draft_vocab=dv, seed=cfg.seed, **overrides)
        check_drafter_layers(cfg, drafter, aux_layers, target)  # online: the target captures the drafter's layers
    if cfg.init_head:
        init_head(drafter, heads.lm_head_weight, heads.final_norm_weight)
    return drafter.to(device=device, dtype=dtype).train()


def _setup_teacher(drafter: Eagle3Drafter, heads, device: torch.device, autocast: bool,
                   compute_dtype: torch.dtype, temperature: float = 1.0) -> Teacher:
    # The teacher's products run in the autocast dtype: convert the head once, not in every call.
    lm_head = heads.lm_head_weight.to(device=device, dtype=torch.bfloat16 if autocast else compute_dtype)
    target_ids = drafter.to_target_ids(torch.arange(drafter.config.draft_vocab_size, device=device))
    return Teacher(lm_head, target_ids, drafter.t2d, heads.final_logit_softcapping, temperature)


def _total_steps(cfg: TrainConfig, train_idx: list[int], lengths: list[int], world: int) -> int:
    """``max_steps``, else the optimizer steps ``epochs`` passes over this rank's share of the batches give."""
    batches_per_epoch = len(make_batches(train_idx, lengths, cfg.batch_tokens, cfg.seed)) // world
    if cfg.grad_accum > batches_per_epoch > 0:  # refused here, before --out holds anything (the loop checks
        # each epoch's own count too)
        raise TrainError(f"--grad-accum {cfg.grad_accum} is more than the {batches_per_epoch} micro-batch(es) an "
                         "epoch has here per rank; lower --grad-accum or --batch-tokens")
    steps_per_epoch = max(1, batches_per_epoch // cfg.grad_accum)
    return cfg.max_steps or steps_per_epoch * cfg.epochs


def _setup_optimizer(cfg: TrainConfig, drafter: Eagle3Drafter, total_steps: int, world: int):
    """(trainable params, the optimizer (optim.py: AdamW, or Muon + AdamW), warmup + cosine LambdaLR), after
    every rank starts from rank 0's weights."""
    if world > 1:  # same seed gives the same init; make it explicit (init_drafter, RNG differences)
        for p in drafter.parameters():
            dist.broadcast(p.data, src=0)
    params = [p for p in drafter.parameters() if p.requires_grad]
    # fused: one pass over each tensor instead of eight (the foreach path is CUDA's default only); the same
    # update, in the same float32. A torch or device without the fused kernel takes the plain loop.
    opt = build_optimizer(cfg, drafter, _fused_adamw_ok(params))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(cfg.warmup_steps, total_steps, cfg.min_lr_ratio))
    return params, opt, sched


def _fused_adamw_ok(params: list[torch.nn.Parameter]) -> bool:
    """True where torch has a fused AdamW for these parameters: floating point, all on CPU or all on CUDA."""
    kinds = {p.device.type for p in params}
    return bool(params) and len(kinds) == 1 and kinds <= {"cpu", "cuda"} and all(p.is_floating_point()
                                                                                 for p in params)


@dataclass
class WarmupCosine:
    """Linear warm-up, then cosine to ``min_lr_ratio`` at ``total_steps``. An object, not a closure: LambdaLR
    checkpoints its fields, so a total fixed later by a time budget (train/budget.py) resumes with the run."""

    warmup_steps: int
    total_steps: int
    min_lr_ratio: float

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        progress = (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _setup_autocast(cfg: TrainConfig, device: torch.device, drafter, heads, source, train_idx: list[int],
                    state: dict, compute_dtype: torch.dtype, rank: int, world: int, objective) -> bool:
    """bf16 autocast or not: the checkpoint's choice on resume, else fixed or measured (``precision``).

    Under torchrun every rank takes rank 0's answer, so all ranks compute alike.
    """
    if "autocast" in state:
        return bool(state["autocast"])

    def probe() -> dict[str, float]:
        first = make_batches(train_idx, source.lengths, cfg.batch_tokens, cfg.seed)[0]
        batch = source.load(first).to(device)
        return measure_autocast(drafter, batch, lambda bf16: _setup_teacher(drafter, heads, device, bf16,
                                                                             compute_dtype), objective)

    def log(line: str) -> None:
        if rank == 0:
            print(f"train: {line}", file=sys.stderr, flush=True)

    on = choose_autocast(cfg.autocast, device, drafter, cfg.batch_tokens, objective.positions, probe, log)
    if world > 1:
        flag = torch.tensor([int(on)], device=device if device.type == "cuda" else "cpu")
        dist.broadcast(flag, src=0)
        on = bool(flag.item())
    state["autocast"] = on
    return on


def _setup_state(cfg: TrainConfig, out: Path, drafter, opt, sched, world: int = 1) -> dict:
    """A fresh position, or the checkpoint's with ``resume``; a fresh run refuses a directory holding one.

    A resume must run with the processes the run had: each rank trains on its share of every batch, so another
    count changes the tokens per optimizer step and which batches the saved position points at."""
    state = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "best_tau": 0.0, "config_hash": config_hash(cfg),
             "world": world}
    if cfg.resume:
        state = load_checkpoint(out, cfg, drafter, opt, sched)
        saved = int(state.get("world", world))  # checkpoints written before the count was kept: not known
        if saved != world:
            raise TrainError(f"--resume: {out} was trained by {saved} process(es) (torchrun --nproc-per-node "
                             f"{saved}), this run has {world}; resume it with {saved}: the batch per optimizer "
                             "step and the saved position in the data depend on the count")
        state["world"] = world
    elif _holds_checkpoint(out):
        raise TrainError(f"{out} already holds a run: pass --resume to continue it or choose another --out")
    return state


def _holds_checkpoint(out: Path) -> bool:
    """Whether ``out`` holds a checkpoint a resume could continue; a run killed during its first save holds
    only a ``.tmp-step-N`` directory, and a fresh run starts over it."""
    try:
        return newest_checkpoint(out) is not None
    except TrainError:  # an unreadable or edited pointer: still someone's run, not a fresh directory
        return True
