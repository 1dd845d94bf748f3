"""Acceptance length at T=0 of trained drafters of any kind on MT-bench's first turns, in draftsmith's decoder.

For comparing a DSpark/DFlash run with an EAGLE-3 run trained on the same store: EAGLE-3 at chains 1..K,
block drafters at blocks 1..their trained length; acceptance length counts the bonus token.

    python bench/block_vs_eagle3.py --target smollm2 --drafter runs/e3/best --drafter runs/dspark/best \
        --datasets mt-bench,humaneval --temperature 0,1 --limit 8 --max-new-tokens 96

The field's protocol (the DSpark paper's): T=0 and T=1, EAGLE-3 at chains 1..7, acceptance length counting the
bonus token; per-position acceptance is the share of rounds that accepted at least i+1 drafts.

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
from draftsmith.stages.decode import ChainSpec, SamplingParams, SpeculativeDecoder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", action="append", required=True)
    p.add_argument("--datasets", default="mt-bench", help="comma-separated: mt-bench, humaneval, or JSONL paths")
    p.add_argument("--temperature", default="0", help="comma-separated, e.g. 0,1 (T>0: seeded sampling)")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--max-chain", type=int, default=7, help="EAGLE-3 chains 1..K (the field's protocol: 1..7)")
    p.add_argument("--out", help="also write the rows to this JSONL file")
    args = p.parse_args()
    torch.manual_seed(0)
    target = load_target(args.target, dtype=torch.float32)
    tok = target.tokenizer
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    drafters = [(path, load_any(path, target)) for path in args.drafter]
    rows = []
    for dataset in args.datasets.split(","):
        prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q.turns[0]}], add_generation_prompt=True,
                                               tokenize=False), add_special_tokens=False)["input_ids"]
                   for q in load_prompts(dataset, limit=args.limit)]
        for temperature in (float(t) for t in args.temperature.split(",")):
            sampling = SamplingParams(temperature=temperature)
            plain = [SpeculativeDecoder(target).generate(ids, args.max_new_tokens, sampling, eos,
                                                         torch.Generator().manual_seed(i))
                     for i, ids in enumerate(prompts)]
            plain_tps = sum(len(r.token_ids) for r in plain) / sum(r.total_time for r in plain)
            for path, drafter in drafters:
                kind = getattr(drafter, "kind", "eagle3")
                ks = range(1, (args.max_chain if kind == "eagle3" else drafter.config.num_drafts) + 1)
                for k in ks:
                    spec = ChainSpec(k) if kind == "eagle3" else BlockSpec(k)
                    outs = [SpeculativeDecoder(target, drafter, spec).generate(ids, args.max_new_tokens, sampling,
                                                                                eos, torch.Generator().manual_seed(i))
                            for i, ids in enumerate(prompts)]
                    rounds = sum(len(o.accepted_per_step) for o in outs)
                    per_pos = [sum(o.accepted_per_position(k)[i] for o in outs) / max(rounds, 1) for i in range(k)]
                    same = sum(o.token_ids == r.token_ids for o, r in zip(outs, plain, strict=True))
                    tps = sum(len(o.token_ids) for o in outs) / sum(o.total_time for o in outs)
                    row = {"dataset": dataset, "temperature": temperature, "drafter": path, "kind": kind, "k": k,
                           # acceptance length over all rounds of all prompts, the bonus token counted
                           "tau": round(1 + sum(sum(o.accepted_per_step) for o in outs) / max(rounds, 1), 3),
                           "per_position": [round(x, 3) for x in per_pos],
                           "tok_s": round(tps, 1), "speedup": round(tps / plain_tps, 3),
                           "equal_to_plain": f"{same}/{len(prompts)}" if temperature == 0 else "-"}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if args.out:
                        with open(args.out, "a") as f:
                            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
