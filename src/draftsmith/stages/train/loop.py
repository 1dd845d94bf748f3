"""The optimisation loop, and what it runs per batch: the teacher's targets, the TTT forward, evaluation.

``train_loop`` takes everything ``run.train`` set up (a ``Run``) and advances ``run.state`` (step, epoch,
position in the epoch, best simulated acceptance length) in place, so a checkpoint of that state resumes
exactly. Under torchrun each rank takes every world-th batch and gradients are averaged over ranks.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from draftsmith.core.allocator import TRIM_EVERY_STEPS, release_free_memory
from draftsmith.model.drafter import Eagle3Drafter
from draftsmith.model.ttt import (
    TTTBatch,
    TTTStats,
    simulated_acceptance_length,
    target_argmax,
    teacher_targets,
)
from draftsmith.stages.train.budget import MIN_TIMED_STEPS, Timing, plan_steps
from draftsmith.stages.train.budget import describe as describe_plan
from draftsmith.stages.train.checkpoints import save_checkpoint, save_drafter_atomic
from draftsmith.stages.train.config import TrainConfig, TrainError
from draftsmith.stages.train.data import OnlineSource, StoreSource, every_position, make_batches
from draftsmith.stages.train.kinds import Objective, objective_for
from draftsmith.stages.train.logs import MetricsLog
from draftsmith.stages.train.threads import ThreadTuner, thread_choices


def _last_good(out: Path) -> str:
    """Where a stopped run's last good checkpoint is, or that it has none yet (no directory named that is not)."""
    from draftsmith.stages.train.checkpoints import newest_checkpoint

    try:
        ckpt = newest_checkpoint(out)
    except TrainError:
        ckpt = None
    return (f"the last good checkpoint is {ckpt} (--resume continues from it)" if ckpt is not None
            else "no checkpoint was written before it (the loss diverged before the first --save-every)")


def dist_info() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def setup_distributed(device: str) -> bool:
    """Join torchrun's process group; True when this call created it (so the caller tears it down).

    On CUDA each rank binds its own GPU (LOCAL_RANK: otherwise every rank also opens a context on GPU 0), and
    the group pairs NCCL for CUDA tensors with gloo for the CPU tensors that evaluation and the time budget
    reduce (NCCL alone refuses CPU tensors).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # Imported before the group exists: TorchDynamo (which the optimizer imports on first use) imported after
        # it keeps the group alive past destroy_process_group, so its gloo threads outlive the interpreter (below).
        importlib.import_module("torch._dynamo")
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
        return True
    return False


def teardown_distributed(ok: bool) -> None:
    """Leave the process group before exit, after a run that finished.

    A gloo worker thread can still hold the last collectives' tensors when the main thread returns; if it frees
    them while the interpreter shuts down it aborts the rank ("terminate called without an active exception").
    destroy_process_group joins those threads first. The barrier keeps rank 0's final saves inside the run for
    every rank. After a failure nothing is joined: a peer may still be inside a collective, and waiting for it
    would hang this rank instead of letting it exit with its error (torchrun then stops the others).
    """
    if ok:
        dist.barrier()
        dist.destroy_process_group()


class Teacher:
    """Teacher targets per batch, with the target's full-vocabulary argmax cached per stored sample.

    The argmax over the whole vocabulary costs more than the drafter's own step and is the same in every
    epoch, so it is computed once per sample (8 bytes a token); online batches are computed afresh.
    """

    def __init__(self, lm_head: torch.Tensor, target_ids: torch.Tensor, t2d: torch.Tensor, softcap: float | None,
                 temperature: float = 1.0):
        self.lm_head, self.target_ids, self.t2d, self.softcap = lm_head, target_ids, t2d, softcap
        self.temperature = temperature
        self.draft_weight = lm_head[target_ids]
        self._argmax: dict[int, torch.Tensor] = {}
        self.argmax_s, self.argmax_tokens = 0.0, 0  # first visits' cost, for the time budget (train/budget.py)

    def cached(self, index: int) -> bool:
        return index in self._argmax

    def __call__(self, batch: TTTBatch):
        argmax = None
        if batch.indices is not None:
            for row, i in enumerate(batch.indices):
                if i not in self._argmax:
                    n = int(batch.lengths[row])
                    t0 = time.perf_counter()
                    self._argmax[i] = target_argmax(batch.hidden_state[row, :n], self.lm_head)
                    self.argmax_s += time.perf_counter() - t0
                    self.argmax_tokens += n
            argmax = torch.zeros(batch.input_ids.shape, dtype=torch.long, device=batch.input_ids.device)
            for row, i in enumerate(batch.indices):
                a = self._argmax[i]
                argmax[row, : a.numel()] = a
        return teacher_targets(batch, self.lm_head, self.target_ids, self.t2d, self.softcap, argmax=argmax,
                               draft_weight=self.draft_weight, temperature=self.temperature)


@torch.no_grad()
def evaluate(drafter: Eagle3Drafter, source, indices: list[int], cfg: TrainConfig, teacher, device,
             autocast: bool = False, objective=None) -> dict:
    """The held-out loss and per-position acceptance; ``simulated_tau`` counts the bonus token.

    What the objective draws at random (a block kind's anchors) comes from a generator seeded per batch, so
    every evaluation scores the same positions and the training RNG is left as it was."""
    objective = objective or objective_for(cfg, drafter)
    drafter.eval()
    # Sized up front: a rank with no held-out batch still reduces a tensor of the same length.
    total = TTTStats(correct=[0.0] * objective.positions, total=[0.0] * objective.positions)
    rank, world = dist_info()
    # Each rank scores its share of the held-out batches; the sums are reduced below.
    batches = make_batches(indices, source.lengths, cfg.batch_tokens, seed=0)
    for i in range(rank, len(batches), world):
        batch = source.load(batches[i]).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            _, s = objective(drafter, batch, teacher(batch), torch.Generator().manual_seed(i))
        total.add(s)
    if world > 1:
        t = torch.tensor([total.loss, *total.correct, *total.total], dtype=torch.float64)
        dist.all_reduce(t)
        n = len(total.correct)
        total = TTTStats(float(t[0]), t[1:1 + n].tolist(), t[1 + n:].tolist())
    acc = total.acc
    return {"loss": total.loss / max(1, len(indices)), "acc": acc, "simulated_tau": simulated_acceptance_length(acc),
            "tokens": int(total.total[0]), "samples": len(indices)}


@dataclass
class Run:
    """What the loop works on, as ``run.train`` set it up."""

    cfg: TrainConfig
    out: Path
    device: torch.device
    autocast: bool
    rank: int
    world: int
    source: StoreSource | OnlineSource
    train_idx: list[int]
    eval_idx: list[int]
    total_steps: int  # the steps this run will take: step_ceiling, or a time budget's plan
    step_ceiling: int  # max_steps, or the steps `epochs` give
    drafter: Eagle3Drafter
    teacher: Teacher
    objective: Objective  # kinds.objective_for: the kind's loss and per-position statistics
    params: list[torch.nn.Parameter]
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    state: dict
    log: MetricsLog
    bar: object | None  # a tqdm bar on rank 0 when progress is on
    # perf_counter() when the run began (setup included), less the time its checkpoint's sessions already spent:
    # the time budget counts from it
    started: float = 0.0


@dataclass
class BudgetWindow:
    """What the time budget has measured since its last plan: the steps, and the parts of their time that were
    not steps (first visits' argmax, evaluations)."""

    t0: float
    step0: int
    argmax_s0: float
    eval_s0: float

    def step_s(self, run: Run, now: float, eval_s: float) -> float:
        spent = now - self.t0 - (run.teacher.argmax_s - self.argmax_s0) - (eval_s - self.eval_s0)
        return max(1e-6, spent / max(1, run.state["step"] - self.step0))


def _plan_budget(run: Run, step_s: float, one_eval_s: float | None) -> None:
    """Set ``run.total_steps`` to what fits ``max_minutes`` (train/budget.py); the checkpoint keeps it.

    The first plan comes after the warm-up; later ones at each evaluation, from the steps timed since the last,
    since the first steps can miss the steady cost of a step (docs/recipes-and-levers.md). A changed plan moves
    the cosine's end, so the learning rate shifts a little there."""
    cfg, state, lengths = run.cfg, run.state, run.source.lengths
    per_token = run.teacher.argmax_s / run.teacher.argmax_tokens if run.teacher.argmax_tokens else 0.0
    eval_tokens = sum(lengths[i] for i in run.eval_idx)
    one_eval = one_eval_s if one_eval_s is not None else eval_tokens / cfg.batch_tokens * step_s / 3
    uncached = sum(lengths[i] for i in [*run.train_idx, *run.eval_idx] if not run.teacher.cached(i))
    steps_per_epoch = max(1, len(make_batches(run.train_idx, lengths, cfg.batch_tokens, cfg.seed))
                          // run.world // cfg.grad_accum)
    timing = Timing(time.perf_counter() - run.started, state["step"], step_s, per_token,
                    uncached if isinstance(run.source, StoreSource) else 0, steps_per_epoch,
                    one_eval if run.eval_idx else 0.0, cfg.eval_every)
    budget_s = cfg.max_minutes * 60
    planned = plan_steps(budget_s, run.step_ceiling, timing)
    if run.world > 1:  # every rank runs rank 0's plan
        t = torch.tensor([planned])
        dist.broadcast(t, src=0)
        planned = int(t.item())
    before = state.get("planned_steps")
    state["planned_steps"] = run.total_steps = planned
    run.sched.lr_lambdas[0].total_steps = planned
    if run.rank == 0:
        if before is None or abs(planned - before) > 0.02 * before:
            line = f"train: {describe_plan(planned, run.step_ceiling, budget_s, timing)}"
            if run.bar is not None:
                run.bar.write(line, file=sys.stderr)  # on its own line, the bar redrawn below it
            else:
                print(line, file=sys.stderr, flush=True)
        run.log.write(step=state["step"], planned_steps=planned, step_s=round(step_s, 4))
    if run.bar is not None:
        run.bar.total = planned
        run.bar.refresh()


def _plan_due(run: Run, window: BudgetWindow) -> bool:
    """A time budget plans once its warm-up is timed, then again at each evaluation with enough steps timed."""
    cfg, step = run.cfg, run.state["step"]
    if cfg.max_minutes <= 0 or step >= run.total_steps or step - window.step0 < MIN_TIMED_STEPS:
        return False
    if "planned_steps" not in run.state:
        return step >= cfg.warmup_steps
    return step % cfg.eval_every == 0


def train_loop(run: Run) -> dict:
    """Optimizer steps until ``total_steps`` (or ``stop_at_step``); returns the last evaluation's results."""
    cfg, state, drafter, out, device, world = run.cfg, run.state, run.drafter, run.out, run.device, run.world
    opt, sched, params, log, bar = run.opt, run.sched, run.params, run.log, run.bar
    last_eval: dict = {}
    tokens_seen, t_start = 0, time.perf_counter()
    eval_s, evals = 0.0, 0
    window = BudgetWindow(t_start, state["step"], run.teacher.argmax_s, 0.0)
    threads = ThreadTuner(thread_choices(device, world))
    drafter.train()
    while state["step"] < run.total_steps:
        batches = make_batches(run.train_idx, run.source.lengths, cfg.batch_tokens, cfg.seed * 1000 + state["epoch"])
        batches = batches[: len(batches) // world * world][run.rank::world]
        if not batches:
            raise TrainError("not enough data for one batch per rank")
        if cfg.grad_accum > len(batches):  # no optimizer step could ever run: the loop would spin over epochs
            raise TrainError(f"--grad-accum {cfg.grad_accum} is more than the {len(batches)} micro-batch(es) an epoch "
                             "has here per rank; lower --grad-accum or --batch-tokens")
        while state["batch_in_epoch"] + cfg.grad_accum <= len(batches) and state["step"] < run.total_steps:
            stats = TTTStats()
            threads.before_step()
            t_step, argmax_before, step_tokens = time.perf_counter(), run.teacher.argmax_s, 0
            opt.zero_grad(set_to_none=True)
            for j in range(cfg.grad_accum):
                batch = run.source.load(batches[state["batch_in_epoch"] + j]).to(device)
                if cfg.train_on == "all":
                    batch = every_position(batch)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=run.autocast):
                    loss, s = run.objective(drafter, batch, run.teacher(batch))
                if not torch.isfinite(loss):
                    raise TrainError(f"loss is {float(loss.detach())} at step {state['step'] + 1}: stopped; "
                                     f"{_last_good(out)} (try a lower lr)")
                (loss / cfg.grad_accum).backward()
                stats.add(s)
                step_tokens += batch.num_tokens
            if world > 1:  # data parallel: average gradients over ranks (what DDP would do, without its wrapper)
                for p in params:
                    if p.grad is not None:
                        dist.all_reduce(p.grad)
                        p.grad /= world
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            sched.step()
            tokens_seen += step_tokens
            # the step's own time: a first visit's argmax is a one-time cost, not the thread count's
            threads.after_step(time.perf_counter() - t_step - (run.teacher.argmax_s - argmax_before), step_tokens)
            state["step"] += 1
            state["batch_in_epoch"] += cfg.grad_accum
            step = state["step"]
            if step % TRIM_EVERY_STEPS == 0:
                release_free_memory()  # resident memory back to what is in use (core/allocator.py says why)
            if step % cfg.log_every == 0 or step == run.total_steps:
                rate = tokens_seen * world / max(time.perf_counter() - t_start, 1e-9)
                # elapsed_s on the checkpoints' clock: a resumed run's rows go on from its checkpoint's time
                log.write(step=step, elapsed_s=round(time.perf_counter() - run.started, 3),
                          loss=stats.loss / cfg.grad_accum, acc_0=stats.acc[0],
                          simulated_tau=stats.simulated_acceptance_length, lr=sched.get_last_lr()[0],
                          tokens_per_s=rate, threads=threads.current)
                if bar is not None:
                    bar.set_postfix(loss=f"{stats.loss / cfg.grad_accum:.3f}", acc0=f"{stats.acc[0]:.2f}",
                                    tau=f"{stats.simulated_acceptance_length:.2f}", tok_s=f"{rate:.0f}")
            if bar is not None:
                bar.update(1)
            if run.eval_idx and (step % cfg.eval_every == 0 or step == run.total_steps):
                t_eval, argmax_before = time.perf_counter(), run.teacher.argmax_s
                last_eval = evaluate(drafter, run.source, run.eval_idx, cfg, run.teacher, device, run.autocast,
                                     run.objective)
                # without its first visits' argmax, which the teacher's own count holds
                eval_s += time.perf_counter() - t_eval - (run.teacher.argmax_s - argmax_before)
                evals += 1
                log.write(step=step, eval=True, **{k: v for k, v in last_eval.items() if k != "acc"},
                          **{f"eval_acc_{i}": a for i, a in enumerate(last_eval["acc"])})
                if last_eval["simulated_tau"] > state["best_tau"] and run.rank == 0:
                    state["best_tau"] = last_eval["simulated_tau"]
                    save_drafter_atomic(drafter, out / "best")
                    (out / "best" / "eval.json").write_text(json.dumps({"step": step, **last_eval}, indent=2))
                drafter.train()
            if _plan_due(run, window):
                now = time.perf_counter()
                _plan_budget(run, window.step_s(run, now, eval_s), eval_s / evals if evals else None)
                window = BudgetWindow(now, step, run.teacher.argmax_s, eval_s)
            stop = cfg.stop_at_step and step >= cfg.stop_at_step
            if step % cfg.save_every == 0 or step == run.total_steps or stop:
                state["elapsed_s"] = time.perf_counter() - run.started
                save_checkpoint(out, drafter, opt, sched, state, run.rank)
            if stop:
                break
        if cfg.stop_at_step and state["step"] >= cfg.stop_at_step:
            break
        if state["batch_in_epoch"] + cfg.grad_accum > len(batches):
            state["epoch"] += 1
            state["batch_in_epoch"] = 0
    return last_eval
