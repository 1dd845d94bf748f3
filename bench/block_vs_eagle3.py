"""Acceptance length at T=0 of trained drafters of any kind on MT-bench's first turns, in draftsmith's decoder.

For comparing a DSpark/DFlash run with an EAGLE-3 run trained on the same store: EAGLE-3 at chains 1..K,
block drafters at blocks 1..their trained length; acceptance length counts the bonus token.

    python bench/block_vs_eagle3.py --target smollm2 --drafter runs/e3/best --drafter runs/dspark/best \
        --limit 8 --max-new-tokens 96

Measured 2026-12-06 (2-core CPU shared with ~6 other jobs, load 10-13; both runs at once under nice 10, OMP 1
thread; SmolLM2-135M, store: 199 ShareGPT first turns cut at 512 tokens, aux layers 2,15,27, draft vocab 4096;
`train --batch-tokens 1024 --train-on all --lr 2e-3 --max-minutes 20`; this script with --limit 5
--max-new-tokens 64, every row 5/5 equal to plain):
    EAGLE-3 (--ttt-steps 2): 151 steps, held-out simulated tau 1.310; MT-bench tau chain 1/2/3: 1.237 1.276 1.282
    DSpark (--draft-layers 1 --block-size 4 --markov-rank 64 --num-anchors 64): 251 steps, held-out 1.202;
        MT-bench tau block 1/2/3/4: 1.127 1.188 1.205 1.200
Both far from trained (the demo preset trains 800+ steps). At 8 minutes, DSpark's default shape (2 layers, block
7, rank 256, 128 anchors, lr 1e-3) ran 27 steps (13 s/step under that load) to EAGLE-3's 62: held-out 1.090 vs
1.207. One step on one 1,024-token batch, 1 thread, load ~2: EAGLE-3 TTT-2 0.62 s, DSpark default 2.8 s (24.1M
trainable parameters, 12.6M of them the Markov head's embedding), DSpark small 0.8 s. Those step costs are before
the block attention on the blocks' own rows (branch b49): bench/bench_block_step.py measures old and new side by
side (DSpark default 2.5x cheaper per step, DFlash 3.3x, DSpark small 2.2x; DSpark default ~2x EAGLE-3 TTT-2).
"""

from __future__ import annotations

import argparse
import json

import torch

from draftsmith.data.prompts import load_prompts
from draftsmith.model.kinds import load_any
from draftsmith.model.target import load_target
from draftsmith.stages.block_decode import BlockSpec
from draftsmith.stages.decode import ChainSpec, SpeculativeDecoder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", action="append", required=True)
    p.add_argument("--dataset", default="mt-bench")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--max-chain", type=int, default=4)
    args = p.parse_args()
    torch.manual_seed(0)
    target = load_target(args.target, dtype=torch.float32)
    tok = target.tokenizer
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q.turns[0]}], add_generation_prompt=True,
                                           tokenize=False), add_special_tokens=False)["input_ids"]
               for q in load_prompts(args.dataset, limit=args.limit)]
    plain = [SpeculativeDecoder(target).generate(ids, args.max_new_tokens).token_ids for ids in prompts]
    rows = []
    for path in args.drafter:
        drafter = load_any(path, target)
        kind = getattr(drafter, "kind", "eagle3")
        ks = range(1, (args.max_chain if kind == "eagle3" else drafter.config.num_drafts) + 1)
        for k in ks:
            spec = ChainSpec(k) if kind == "eagle3" else BlockSpec(k)
            taus, same = [], 0
            for ids, ref in zip(prompts, plain, strict=True):
                out = SpeculativeDecoder(target, drafter, spec).generate(ids, args.max_new_tokens)
                taus.append(out.acceptance_length)
                same += out.token_ids == ref
            row = {"drafter": path, "kind": kind, "k": k, "tau": round(sum(taus) / len(taus), 3),
                   "equal_to_plain": f"{same}/{len(prompts)}"}
            rows.append(row)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
