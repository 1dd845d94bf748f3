"""One training step of a block drafter (DFlash, DSpark) against EAGLE-3's, side by side in one process.

    python bench/bench_block_step.py [--kinds eagle3,dspark,dspark-small,dflash] [--steps 6] [--threads 2]
    python bench/bench_block_step.py --kinds dspark --profile      # torch.profiler table of one step

A step is what the trainer's loop does per micro-batch: the teacher's targets (the full-vocabulary argmax cached,
as after the first epoch), the kind's objective forward and backward under the autocast the trainer would choose,
gradient clipping, fused AdamW. Shapes: SmolLM2-135M as the target (width 576, 9 heads, 3 KV heads, MLP 1,536,
vocabulary 49,152, 3 aux layers as the demo store), draft vocabulary 4,096, one 1,024-token batch of random
features (lengths log-normal, median ~330, every position an answer token): a step's cost depends on the shapes,
not the values. Block rows: ``old`` is the attention layout before this script existed (each slot a query row
of a per-slot copy of the sequence, the block's keys as T-row diagonal tensors; kept here as the baseline),
``new`` is this tree's ``block_attention``; likewise the acceptance counts' Markov drafts (``old``: one pass per
slot). Every timed round runs each row once, in alternating order.

Measured 2026-12-06 on the 2-core Intel Xeon (AMX, avx512_bf16) shared with the lead's training and other
helpers' tests (load average 9-12), bf16 autocast, ``OMP_NUM_THREADS=1 ... --threads 1``, seconds per step:

    run (rounds)        EAGLE-3 TTT-2   DSpark default     DSpark small      DFlash (2 layers)
                        min / median    old -> new         old -> new        old -> new
    20:50 (5)           0.58 / 0.80     3.81 -> 1.35 min   0.87 -> 0.41 min  3.75 -> 1.14 min
    21:08 (7, busier)   2.28 / 2.56     11.26 -> 4.05 min  2.72 -> 1.17 min  13.55 -> 3.72 min
    old/new of the same round, median (min): DSpark default 2.42x (1.87x) and 2.51x (2.22x); DSpark small
    2.06x (1.40x) and 2.23x (1.36x); DFlash 3.18x (2.25x) and 3.29x (2.45x).

The 21:08 run includes the single Markov-table lookup in both rows (only the attention and the counts' drafts
differ). With 2 threads on this loaded machine every small elementwise op ran 10-20x slower in the profile (the
OpenMP threads wait on each other): one thread per run is faster here.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train_speed import cpu_kind  # noqa: E402

VOCAB, WIDTH, DRAFT_VOCAB, BATCH_TOKENS = 49152, 576, 4096, 1024
SHAPES = {  # kind name -> (model kind, config overrides, num_anchors)
    "dspark": ("dspark", {}, 128),
    "dspark-small": ("dspark", {"num_hidden_layers": 1, "block_size": 4, "markov_rank": 64}, 64),
    "dflash": ("dflash", {}, 128),
}


def old_block_attention(q, k_blk, v_blk, k_ctx, v_ctx, rows, anchors):
    """The layout before: slot k of block m is row ``anchors[m] - 1`` of copy k of its sequence; the block's keys
    ride along as T-row diagonal extra keys of ``ttt_attention`` (mostly zeros)."""
    from draftsmith.model.ttt import ttt_attention

    m, n_heads, bs, d = q.shape
    b, kv, t, _ = k_ctx.shape
    at = (rows[:, None], torch.arange(bs, device=q.device)[None], slice(None), (anchors - 1)[:, None])

    def spread(x, heads):
        out = x.new_zeros(b, bs, heads, t, d)
        out[at] = x
        return out.view(b * bs, heads, t, d)

    q_rows = spread(q.transpose(1, 2), n_heads)
    keys = [k_ctx[:, None].expand(b, bs, kv, t, d).reshape(b * bs, kv, t, d)]
    values = [v_ctx[:, None].expand(b, bs, kv, t, d).reshape(b * bs, kv, t, d)]
    for j in range(bs):
        keys.append(spread(k_blk[:, :, j][:, None].expand(m, bs, kv, d), kv))
        values.append(spread(v_blk[:, :, j][:, None].expand(m, bs, kv, d), kv))
    out = ttt_attention(q_rows, keys, values).view(b, bs, n_heads, t, d)
    return out[at].transpose(1, 2)


@torch.no_grad()
def old_greedy_drafts(drafter, base, hidden, first_prev, choice):
    """The acceptance counts' drafts before: the decoder's loop, one Markov pass per slot."""
    prev, state, out = first_prev, None, []
    for k in range(base.shape[1]):
        bias, state = drafter.markov_bias(prev, hidden[:, k], state)
        out.append((base[:, k] + bias.float()).argmax(-1))
        prev = drafter.to_target_ids(out[-1])
    return torch.stack(out, dim=1)


def build(name: str, embed, dv):
    """(drafter, objective) for a row name."""
    from draftsmith.model.block_drafter import BlockDrafter, BlockDrafterConfig, init_weights
    from draftsmith.model.drafter import DrafterConfig, Eagle3Drafter
    from draftsmith.stages.train.block import BlockObjective, BlockSpec
    from draftsmith.stages.train.config import BLOCK_DEFAULTS
    from draftsmith.stages.train.kinds import TTTObjective

    sizes = dict(hidden_size=WIDTH, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                 head_dim=64, vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, target_hidden_size=WIDTH)
    if name == "eagle3":
        return Eagle3Drafter(DrafterConfig(**sizes), embed, dv), TTTObjective(2, 0.8)
    kind, over, anchors = SHAPES[name]
    conf = dict(num_hidden_layers=2, target_layer_ids=(1, 14, 26), mask_token_id=VOCAB - 1)
    if kind == "dspark":
        conf.update(block_size=7, sample_from_anchor=True, markov_rank=256, enable_confidence_head=True,
                    confidence_head_with_markov=True)
    conf.update(over)
    drafter = BlockDrafter(BlockDrafterConfig(kind=kind, **sizes, **conf), draft_vocab=dv)
    init_weights(drafter)
    drafter.bind_embeddings(embed)
    d = BLOCK_DEFAULTS[kind]
    spec = BlockSpec(block_size=drafter.config.block_size, next_token=drafter.config.sample_from_anchor,
                     num_anchors=anchors, gamma=d["loss_decay_gamma"], ce_weight=d["ce_weight"],
                     l1_weight=d["l1_weight"], confidence_weight=d["confidence_weight"])
    return drafter, BlockObjective(spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="eagle3,dspark,dspark-small,dflash")
    ap.add_argument("--steps", type=int, default=6, help="timed rounds (after one warm-up round)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--autocast", choices=("auto", "bf16", "fp32"), default="auto")
    ap.add_argument("--no-old", action="store_true", help="time only this tree's block attention")
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table of one step of each row")
    args = ap.parse_args()

    from draftsmith.core import vocab as vocab_mod
    from draftsmith.stages.train import block as block_mod
    from draftsmith.stages.train.data import collate, every_position, make_batches
    from draftsmith.stages.train.loop import Teacher
    from draftsmith.stages.train.precision import fixed_autocast

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    autocast = bool({"auto": fixed_autocast("auto", torch.device("cpu")), "bf16": True,
                     "fp32": False}[args.autocast])
    dv = vocab_mod.identity(VOCAB, DRAFT_VOCAB)
    embed = torch.nn.Embedding(VOCAB, WIDTH).requires_grad_(False)
    lm_head = torch.randn(VOCAB, WIDTH) * 0.05
    teacher = Teacher(lm_head.bfloat16() if autocast else lm_head, torch.arange(DRAFT_VOCAB), dv.t2d, None)
    rng = random.Random(0)
    lengths = [max(32, min(1024, int(rng.lognormvariate(5.8, 0.7)))) for _ in range(40)]
    g = torch.Generator().manual_seed(0)
    samples = [(torch.randint(0, VOCAB, (n,), generator=g), torch.ones(n, dtype=torch.bool),
                torch.randn(n, 3 * WIDTH, generator=g).bfloat16(), torch.randn(n, WIDTH, generator=g).bfloat16())
               for n in lengths]
    batches = make_batches(list(range(len(lengths))), lengths, BATCH_TOKENS, 0)
    new_attention, new_greedy = block_mod.block_attention, block_mod.greedy_drafts
    rows = []
    for name in args.kinds.split(","):
        drafter, objective = build(name, embed, dv)
        params = [p for p in drafter.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), fused=True)
        variants = ["-"] if name == "eagle3" else (["new"] if args.no_old else ["old", "new"])
        rows += [(name, v, drafter, objective, params, opt) for v in variants]

    def step(row, i: int) -> float:
        name, variant, drafter, objective, params, opt = row
        block_mod.block_attention = old_block_attention if variant == "old" else new_attention
        block_mod.greedy_drafts = old_greedy_drafts if variant == "old" else new_greedy
        idx = batches[i % len(batches)]
        batch = every_position(collate([samples[j] for j in idx], BATCH_TOKENS, torch.bfloat16))
        batch.indices = idx
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, _ = objective(drafter, batch, teacher(batch), torch.Generator().manual_seed(i))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return time.perf_counter() - t0

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for row in rows:
            step(row, 0)
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                step(row, 0)
            print(f"== {row[0]} {row[1]}")
            table = prof.key_averages(group_by_input_shape=True).table(
                sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=30, max_shapes_column_width=90)
            print(table)
        return 0
    for row in rows:  # warm-up: every timed batch's argmax cached
        for i in range(args.steps):
            if row is rows[0] or i == 0:
                step(row, i)
    times: dict[str, list[float]] = {f"{r[0]} {r[1]}": [] for r in rows}
    for i in range(args.steps):
        for row in rows if i % 2 == 0 else rows[::-1]:
            times[f"{row[0]} {row[1]}"].append(step(row, i))
    print(f"{cpu_kind()}; {args.threads} threads, autocast {'bf16' if autocast else 'off'}, load average "
          f"{os.getloadavg()[0]:.1f} at the end; {args.steps} rounds, batch {BATCH_TOKENS} tokens")
    out = {}
    for key, ts in times.items():
        out[key] = {"min_s": round(min(ts), 3), "median_s": round(statistics.median(ts), 3)}
        print(f"{key:22s} min {min(ts):6.3f} s  median {statistics.median(ts):6.3f} s")
    for name in {r[0] for r in rows}:  # old over new of the same round: adjacent in time, the same batch
        if f"{name} old" in times and f"{name} new" in times:
            ratios = [a / b for a, b in zip(times[f"{name} old"], times[f"{name} new"], strict=True)]
            out[f"{name} old/new"] = {"min": round(min(ratios), 2), "median": round(statistics.median(ratios), 2)}
            print(f"{name:22s} old/new per round: min {min(ratios):.2f}x, median {statistics.median(ratios):.2f}x")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
