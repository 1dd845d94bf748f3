"""Acceptance length at T=0 of trained drafters of any kind on MT-bench's first turns, in draftsmith's decoder.

For comparing a DSpark/DFlash run with an EAGLE-3 run trained on the same store: EAGLE-3 at chains 1..K,
block drafters at blocks 1..their trained length; acceptance length counts the bonus token.

    python bench/block_vs_eagle3.py --target smollm2 --drafter runs/e3/best --drafter runs/dspark/best \
        --limit 8 --max-new-tokens 96
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
