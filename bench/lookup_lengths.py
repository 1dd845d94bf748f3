"""tau of prompt lookup and of a hybrid tree + lookup, by lookup length, at T=0 in float32.

In float32 every method emits plain decoding's tokens, so tau differs only by what the proposer offers; this is
the measurement behind the hybrids' lookup lengths in `stages/shapes.py`. Speed is bench's job.
Run: python bench/lookup_lengths.py --drafter runs/full/run/best [--limit 20] [--ks 3,6,10,16]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from draftsmith.app.args import parse_ints
from draftsmith.app.bench import decode_prompts
from draftsmith.data.chat import encode_prompt
from draftsmith.data.prompts import load_prompts
from draftsmith.model.drafter import load_drafter
from draftsmith.stages.decode import HybridSpec, NgramSpec, SpeculativeDecoder, TreeSpec
from draftsmith.stages.step_config import load_target_for


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--tree", default="2,6,10", help="the hybrid's tree (DEPTH,TOPK,TOTAL)")
    ap.add_argument("--ks", default="3,6,10,16", help="lookup lengths")
    ap.add_argument("--datasets", default="mt-bench,humaneval")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    target, _ = load_target_for(args.target, dtype="float32")
    drafter = load_drafter(args.drafter, target)
    ks = parse_ints(args.ks)
    datasets = args.datasets.split(",")
    prompts = {name: [encode_prompt(target.tokenizer, p.turns[0], chat=True)
                      for p in load_prompts(name, limit=args.limit, turns=1)] for name in datasets}
    rows: dict[str, dict[int, dict[str, float]]] = {"prompt lookup": {}, f"hybrid {args.tree} + lookup": {}}
    tree = TreeSpec.parse(args.tree)
    for k in ks:
        for row, decoder in (("prompt lookup", SpeculativeDecoder(target, None, NgramSpec(k))),
                             (f"hybrid {args.tree} + lookup",
                              SpeculativeDecoder(target, drafter, HybridSpec(tree, NgramSpec(k))))):
            rows[row][k] = {name: decode_prompts(decoder, prompts[name], args.max_new_tokens)[0].acceptance_length
                            for name in datasets}
            print(json.dumps({"proposer": row, "k": k, **{n: round(v, 3) for n, v in rows[row][k].items()}}),
                  file=sys.stderr, flush=True)
    print(f"| proposer ({' / '.join(datasets)}) | " + " | ".join(f"lookup {k}" for k in ks) + " |")
    print("|---|" + "---|" * len(ks))
    for row, by_k in rows.items():
        print(f"| {row} | " + " | ".join(" / ".join(f"{by_k[k][n]:.2f}" for n in datasets) for k in ks) + " |")
    print(f"{args.limit} first turns of each set x {args.max_new_tokens} tokens, float32, drafter {args.drafter}, "
          f"torch {torch.__version__}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": {r: {str(k): v for k, v in b.items()} for r, b in rows.items()}}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
