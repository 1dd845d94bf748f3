"""Train an EAGLE-3 drafter with training-time test, offline (feature store) or online (target in the loop).

The loop is deterministic for a seed: the data order is a function of (seed, epoch), a checkpoint holds
model, optimizer, scheduler, RNG and the data position, and ``resume`` continues exactly where the run
stopped (N steps straight == N/2 + resume + N/2, bit for bit, on the same machine). Under torchrun each
rank takes every world-th batch and DDP averages gradients.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from draftsmith.core import vocab as vocab_mod
from draftsmith.core.conventions import default_aux_layers
from draftsmith.model.drafter import Eagle3Drafter, load_drafter, new_drafter
from draftsmith.model.ttt import (
    TTTBatch,
    TTTStats,
    simulated_acceptance_length,
    target_argmax,
    teacher_targets,
    ttt_forward,
)
from draftsmith.stages.train_config import _RESUMABLE, TrainConfig, TrainError, config_hash, load_config  # noqa: F401


# --- data -------------------------------------------------------------------------------------------------
class StoreSource:
    """Samples from a feature store, read one at a time (bounded memory)."""

    def __init__(self, store, max_length: int, dtype: torch.dtype):
        self.store, self.max_length, self.dtype = store, max_length, dtype
        self.lengths = [min(n, max_length) for n in store.lengths]
        self.ids = list(store.sample_ids)

    def load(self, indices: list[int]) -> TTTBatch:
        samples = [self.store.get(i) for i in indices]
        batch = collate([(s["input_ids"], s["loss_mask"], s["aux_hidden_states"].flatten(-2), s["hidden_state"])
                         for s in samples], self.max_length, self.dtype)
        batch.indices = list(indices)
        return batch


class OnlineSource:
    """Conversations tokenized up front; features computed by the target for each batch (nothing stored)."""

    def __init__(self, target, conversations: str, max_length: int):
        from draftsmith.data.chat import EmptyConversation, read_jsonl, tokenize_conversation

        self.target = target
        self.items, self.ids = [], []
        for _line, conv in read_jsonl(conversations):
            if isinstance(conv, Exception):
                continue
            try:
                tok = tokenize_conversation(target.tokenizer, conv.messages, max_length=max_length, truncate=True)
            except EmptyConversation:
                continue
            self.items.append((torch.tensor(tok.input_ids), torch.tensor(tok.loss_mask, dtype=torch.bool)))
            self.ids.append(conv.id)
        if not self.items:
            raise TrainError(f"{conversations}: no usable conversation")
        self.lengths = [len(x[0]) for x in self.items]
        self.max_length = max_length

    def load(self, indices: list[int]) -> TTTBatch:
        seqs = [self.items[i] for i in indices]
        t = max(len(s[0]) for s in seqs)
        ids = torch.zeros(len(seqs), t, dtype=torch.long)
        attn = torch.zeros(len(seqs), t, dtype=torch.long)
        for r, (x, _) in enumerate(seqs):
            ids[r, : len(x)], attn[r, : len(x)] = x, 1
        out = self.target(ids.to(self.target.device), attention_mask=attn.to(self.target.device), logits_to_keep=1)
        aux = torch.cat(out.aux_hidden_states, -1)
        return collate([(x, m, aux[r, : len(x)].cpu(), out.hidden_state[r, : len(x)].cpu())
                        for r, (x, m) in enumerate(seqs)], self.max_length, aux.dtype)


def collate(samples, max_length: int, dtype: torch.dtype) -> TTTBatch:
    samples = [(x[:max_length], m[:max_length], a[:max_length], h[:max_length]) for x, m, a, h in samples]
    b, t = len(samples), max(len(s[0]) for s in samples)
    ids = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.bool)
    aux = torch.zeros(b, t, samples[0][2].shape[-1], dtype=dtype)
    hid = torch.zeros(b, t, samples[0][3].shape[-1], dtype=dtype)
    for r, (x, m, a, h) in enumerate(samples):
        n = len(x)
        ids[r, :n], mask[r, :n], aux[r, :n], hid[r, :n] = x, m.bool(), a.to(dtype), h.to(dtype)
    return TTTBatch(ids, mask, aux, hid, torch.tensor([len(s[0]) for s in samples]))


def split_eval(ids: list[str], fraction: float) -> tuple[list[int], list[int]]:
    """Held-out split by a hash of the sample id: stable across reruns and store growth."""
    train, held = [], []
    for i, sid in enumerate(ids):
        h = int(hashlib.sha256(sid.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        (held if h < fraction else train).append(i)
    if not train:
        train, held = held, []
    return train, held


def make_batches(indices: list[int], lengths: list[int], batch_tokens: int, seed: int) -> list[list[int]]:
    """Shuffle, then bucket by length inside windows so padding stays small while order stays random."""
    rng = random.Random(seed)
    order = list(indices)
    rng.shuffle(order)
    batches: list[list[int]] = []
    window = 64
    for w in range(0, len(order), window):
        chunk = sorted(order[w: w + window], key=lambda i: lengths[i])
        cur: list[int] = []
        for i in chunk:
            longest = max([lengths[j] for j in cur] + [lengths[i]])
            if cur and longest * (len(cur) + 1) > batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
    rng.shuffle(batches)
    return batches


# --- the run ------------------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    out: Path
    steps: int
    best_simulated_acceptance_length: float
    last_eval: dict


def _dist_info() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _setup_distributed(device: str) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")


def _resolve_dtype(cfg: TrainConfig) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if cfg.device.startswith("cuda") else torch.float32
    return getattr(torch, cfg.dtype)


def use_autocast(setting: str, device: torch.device) -> bool:
    """bf16 autocast pays where bf16 matmuls are native (1.4x tokens/s over fp32 on an AMX CPU core)."""
    from draftsmith.model.target import bf16_native

    return setting == "bf16" if setting != "auto" else bf16_native(device)


def train(cfg: TrainConfig) -> TrainResult:
    _setup_distributed(cfg.device)
    rank, world = _dist_info()
    device = torch.device(cfg.device if not cfg.device.startswith("cuda") or world == 1
                          else f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    out = Path(cfg.out)
    dtype = _resolve_dtype(cfg)
    compute_dtype = torch.float32  # master weights; matmuls under bf16 autocast where that is native
    autocast = use_autocast(cfg.autocast, device)
    torch.manual_seed(cfg.seed)

    # Data and the target pieces it needs.
    if cfg.store is not None:
        from draftsmith.data.store import FeatureStore
        from draftsmith.model.target import load_target_heads

        store = FeatureStore(cfg.store, out_dtype=compute_dtype)
        heads = load_target_heads(cfg.target, device=str(device), dtype=compute_dtype)
        _check_store(store, heads, cfg)
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

    drafter = _build_drafter(cfg, heads, dv, aux_layers, device, compute_dtype)
    # The teacher's products run in the autocast dtype: convert the head once, not in every call.
    lm_head = heads.lm_head_weight.to(device=device, dtype=torch.bfloat16 if autocast else compute_dtype)
    target_ids = drafter.to_target_ids(torch.arange(drafter.config.draft_vocab_size, device=device))
    train_idx, eval_idx = split_eval(source.ids, cfg.eval_fraction)
    batches_per_epoch = len(make_batches(train_idx, source.lengths, cfg.batch_tokens, cfg.seed)) // world
    steps_per_epoch = max(1, batches_per_epoch // cfg.grad_accum)
    total_steps = cfg.max_steps or steps_per_epoch * cfg.epochs

    if world > 1:  # same seed gives the same init; make it explicit (init_drafter, RNG differences)
        for p in drafter.parameters():
            dist.broadcast(p.data, src=0)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg, total_steps))

    state = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "best_tau": 0.0, "config_hash": config_hash(cfg)}
    if cfg.resume:
        state = _load_checkpoint(out, cfg, drafter, opt, sched)
    elif (out / "checkpoints").exists() and any((out / "checkpoints").iterdir()):
        raise TrainError(f"{out} already holds a run: pass --resume to continue it or choose another --out")
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))

    log = _Log(out, rank)
    bar = _progress(cfg, rank, total_steps, state["step"])
    teacher = Teacher(lm_head, target_ids, drafter.t2d, heads.final_logit_softcapping)
    last_eval: dict = {}
    tokens_seen, t_start = 0, time.perf_counter()
    drafter.train()
    while state["step"] < total_steps:
        batches = make_batches(train_idx, source.lengths, cfg.batch_tokens, cfg.seed * 1000 + state["epoch"])
        batches = batches[: len(batches) // world * world][rank::world]
        if not batches:
            raise TrainError("not enough data for one batch per rank")
        while state["batch_in_epoch"] + cfg.grad_accum <= len(batches) and state["step"] < total_steps:
            stats = TTTStats()
            opt.zero_grad(set_to_none=True)
            for j in range(cfg.grad_accum):
                batch = source.load(batches[state["batch_in_epoch"] + j]).to(device)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    loss, s = ttt_forward(drafter, batch, teacher(batch), cfg.ttt_steps, cfg.step_decay)
                if not torch.isfinite(loss):
                    raise TrainError(f"loss is {float(loss.detach())} at step {state['step'] + 1}: stopped; the last "
                                     f"good checkpoint is in {out / 'checkpoints'} (try a lower lr)")
                (loss / cfg.grad_accum).backward()
                stats.add(s)
                tokens_seen += batch.num_tokens
            if world > 1:  # data parallel: average gradients over ranks (what DDP would do, without its wrapper)
                for p in params:
                    if p.grad is not None:
                        dist.all_reduce(p.grad)
                        p.grad /= world
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            sched.step()
            state["step"] += 1
            state["batch_in_epoch"] += cfg.grad_accum
            step = state["step"]
            if step % cfg.log_every == 0 or step == total_steps:
                rate = tokens_seen * world / max(time.perf_counter() - t_start, 1e-9)
                log.write(step=step, elapsed_s=round(time.perf_counter() - t_start, 3),
                          loss=stats.loss / cfg.grad_accum, acc_0=stats.acc[0],
                          simulated_tau=stats.simulated_acceptance_length, lr=sched.get_last_lr()[0],
                          tokens_per_s=rate)
                if bar is not None:
                    bar.set_postfix(loss=f"{stats.loss / cfg.grad_accum:.3f}", acc0=f"{stats.acc[0]:.2f}",
                                    tau=f"{stats.simulated_acceptance_length:.2f}", tok_s=f"{rate:.0f}")
            if bar is not None:
                bar.update(1)
            if eval_idx and (step % cfg.eval_every == 0 or step == total_steps):
                last_eval = evaluate(drafter, source, eval_idx, cfg, teacher, device)
                log.write(step=step, eval=True, **{k: v for k, v in last_eval.items() if k != "acc"},
                          **{f"eval_acc_{i}": a for i, a in enumerate(last_eval["acc"])})
                if last_eval["simulated_tau"] > state["best_tau"] and rank == 0:
                    state["best_tau"] = last_eval["simulated_tau"]
                    _save_drafter_atomic(drafter, out / "best")
                    (out / "best" / "eval.json").write_text(json.dumps({"step": step, **last_eval}, indent=2))
                drafter.train()
            stop = cfg.stop_at_step and step >= cfg.stop_at_step
            if step % cfg.save_every == 0 or step == total_steps or stop:
                _save_checkpoint(out, drafter, opt, sched, state, rank)
            if stop:
                break
        if cfg.stop_at_step and state["step"] >= cfg.stop_at_step:
            break
        if state["batch_in_epoch"] + cfg.grad_accum > len(batches):
            state["epoch"] += 1
            state["batch_in_epoch"] = 0
    if bar is not None:
        bar.close()
    if rank == 0:
        _save_drafter_atomic(drafter, out / "final")
        if not (out / "best").exists():
            _save_drafter_atomic(drafter, out / "best")
        if cfg.plot:
            plot_run(out)
    return TrainResult(out, state["step"], state["best_tau"], last_eval)


class Teacher:
    """Teacher targets per batch, with the target's full-vocabulary argmax cached per stored sample.

    The argmax over the whole vocabulary costs more than the drafter's own step and is the same in every
    epoch, so it is computed once per sample (8 bytes a token); online batches are computed afresh.
    """

    def __init__(self, lm_head: torch.Tensor, target_ids: torch.Tensor, t2d: torch.Tensor, softcap: float | None):
        self.lm_head, self.target_ids, self.t2d, self.softcap = lm_head, target_ids, t2d, softcap
        self.draft_weight = lm_head[target_ids]
        self._argmax: dict[int, torch.Tensor] = {}

    def __call__(self, batch: TTTBatch):
        argmax = None
        if batch.indices is not None:
            for row, i in enumerate(batch.indices):
                if i not in self._argmax:
                    n = int(batch.lengths[row])
                    self._argmax[i] = target_argmax(batch.hidden_state[row, :n], self.lm_head)
            argmax = torch.zeros(batch.input_ids.shape, dtype=torch.long, device=batch.input_ids.device)
            for row, i in enumerate(batch.indices):
                a = self._argmax[i]
                argmax[row, : a.numel()] = a
        return teacher_targets(batch, self.lm_head, self.target_ids, self.t2d, self.softcap, argmax=argmax,
                               draft_weight=self.draft_weight)


@torch.no_grad()
def evaluate(drafter: Eagle3Drafter, source, indices: list[int], cfg: TrainConfig, teacher, device) -> dict:
    drafter.eval()
    total = TTTStats()
    for batch_idx in make_batches(indices, source.lengths, cfg.batch_tokens, seed=0):
        batch = source.load(batch_idx).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast(cfg.autocast, device)):
            _, s = ttt_forward(drafter, batch, teacher(batch), cfg.ttt_steps, cfg.step_decay)
        total.add(s)
    rank, world = _dist_info()
    if world > 1:
        t = torch.tensor([total.loss, *total.correct, *total.total], dtype=torch.float64)
        dist.all_reduce(t)
        n = len(total.correct)
        total = TTTStats(float(t[0]), t[1:1 + n].tolist(), t[1 + n:].tolist())
    acc = total.acc
    return {"loss": total.loss / max(1, len(indices)), "acc": acc, "simulated_tau": simulated_acceptance_length(acc),
            "tokens": int(total.total[0])}


def _lr_lambda(cfg: TrainConfig, total_steps: int):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


def _vocab_from_items(source: OnlineSource, vocab_size: int, draft_vocab_size: int) -> vocab_mod.DraftVocab:
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for ids, mask in source.items:
        counts.index_add_(0, ids[mask], torch.ones(int(mask.sum()), dtype=torch.float64))
    dv, _coverage = vocab_mod.from_counts(counts, draft_vocab_size)
    return dv


def _check_store(store, heads, cfg: TrainConfig) -> None:
    """Refuse a store captured from another target (unless forced): it would train on the wrong features."""
    from draftsmith.data.store import StoreMismatch
    from draftsmith.stages.capture import check_store_matches_target

    try:
        check_store_matches_target(store, heads, force=cfg.force)
    except StoreMismatch as e:
        raise TrainError(f"{e} (pass --force to train on it anyway)") from e


def _build_drafter(cfg, heads, dv, aux_layers, device, dtype) -> Eagle3Drafter:
    if cfg.init_drafter:
        drafter = load_drafter(cfg.init_drafter, device=device, dtype=dtype)
        drafter.bind_embeddings(heads.embed_tokens)
        return drafter.train()

    from types import SimpleNamespace

    from draftsmith.core.fingerprint import config_fingerprint

    n_layers = int(heads.config.num_hidden_layers)
    fingerprint = {"config_sha256": config_fingerprint(heads.config), "hidden_size": heads.hidden_size,
                   "vocab_size": heads.vocab_size, "num_layers": n_layers}
    # The few attributes DrafterConfig.from_target and new_drafter read; the full target need not be loaded.
    like_target = SimpleNamespace(
        config=heads.config, vocab_size=heads.vocab_size, hidden_size=heads.hidden_size,
        embed_tokens=heads.embed_tokens, aux_layers=aux_layers or default_aux_layers(n_layers),
        device=torch.device(device), dtype=dtype, fingerprint=lambda: fingerprint)
    drafter = new_drafter(like_target, draft_vocab=dv, seed=cfg.seed)
    return drafter.to(device=device, dtype=dtype).train()


# --- checkpoints ------------------------------------------------------------------------------------------
def _save_drafter_atomic(drafter: Eagle3Drafter, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    drafter.save(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def _save_checkpoint(out: Path, drafter, opt, sched, state: dict, rank: int) -> None:
    if rank != 0:
        return
    ckpt_dir = out / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / f"step-{state['step']:07d}"
    tmp = ckpt_dir / f".tmp-step-{state['step']:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    drafter.save(tmp / "drafter")
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "state": dict(state),
                "rng": torch.get_rng_state(), "python_rng": random.getstate()}, tmp / "trainer_state.pt")
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)  # a killed save leaves only a .tmp directory, never a half checkpoint
    (ckpt_dir / "latest.tmp").write_text(path.name)
    os.replace(ckpt_dir / "latest.tmp", ckpt_dir / "latest")
    for old in sorted(ckpt_dir.glob("step-*"))[:-2]:  # keep the last two
        shutil.rmtree(old, ignore_errors=True)


def _load_checkpoint(out: Path, cfg: TrainConfig, drafter, opt, sched) -> dict:
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
    blob = torch.load(path / "trainer_state.pt", weights_only=False)
    opt.load_state_dict(blob["optimizer"])
    sched.load_state_dict(blob["scheduler"])
    torch.set_rng_state(blob["rng"])
    random.setstate(blob["python_rng"])
    return blob["state"]


# --- logs and plots -----------------------------------------------------------------------------------------
class _Log:
    """metrics.csv: one row per log/eval event (columns grow as new keys appear)."""

    def __init__(self, out: Path, rank: int):
        self.path = out / "metrics.jsonl"
        self.rank = rank

    def write(self, **row) -> None:
        if self.rank != 0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def _progress(cfg: TrainConfig, rank: int, total: int, initial: int):
    if not cfg.progress or rank != 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)


def read_metrics(out: Path) -> list[dict]:
    path = Path(out) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def write_csv(out: Path) -> Path:
    rows = read_metrics(out)
    keys = sorted({k for r in rows for k in r})
    path = Path(out) / "metrics.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return path


def plot_run(out: Path) -> Path | None:
    """loss.png (training loss) and acc.png (per-step accuracy of the last evaluation)."""
    write_csv(out)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = read_metrics(out)
    train_rows = [r for r in rows if not r.get("eval")]
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
