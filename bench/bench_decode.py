"""Overhead of the speculative machinery: plain decoding vs a useless (random) drafter, one process.

With an untrained drafter nearly nothing is accepted (tau ~ 1), so the ratio of speculative to plain
tokens/s is the price of drafting + a wider verify pass + bookkeeping. Goal: at k=1 the slowdown is at
most 1.3x. Run: OMP_NUM_THREADS=1 python bench/bench_decode.py [--target smollm2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from draftsmith.data.chat import encode_prompt, stop_token_ids
from draftsmith.model.drafter import new_drafter
from draftsmith.model.target import load_target
from draftsmith.stages.decode import ChainSpec, SpeculativeDecoder, TreeSpec

PROMPTS = [
    "Write a short poem about the ocean.",
    "Explain how a bicycle stays upright.",
    "List three uses of a paperclip and explain each.",
    "What is the difference between weather and climate?",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="alternating rounds; the median is reported")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    target = load_target(args.target)
    tok = target.tokenizer
    prompts = [encode_prompt(tok, p, chat=True) for p in PROMPTS]
    stops = stop_token_ids(tok)
    drafter = new_drafter(target)
    settings = [("plain", None)] + [(f"chain k={k}", ChainSpec(k)) for k in range(1, 6)]
    settings.append(("tree 4,4,16", TreeSpec(4, 4, 16)))
    decoders = {name: SpeculativeDecoder(target, drafter if spec else None, spec) for name, spec in settings}
    # Warm up every path once (allocator, first-call overheads).
    for d in decoders.values():
        d.generate(prompts[0], 8, eos_token_ids=stops)
    times: dict[str, list[float]] = {name: [] for name, _ in settings}
    stats: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, _spec in settings:  # interleaved so machine noise hits every setting alike
            tokens, elapsed, taus, draft, verify = 0, 0.0, [], 0.0, 0.0
            for p in prompts:
                t = time.perf_counter()
                r = decoders[name].generate(p, args.max_new_tokens, eos_token_ids=stops)
                elapsed += time.perf_counter() - t
                tokens += len(r.token_ids)
                taus.append(r.acceptance_length)
                draft += r.draft_time
                verify += r.verify_time
            times[name].append(tokens / elapsed)
            stats[name] = {"tau": statistics.mean(taus), "draft_s": draft, "verify_s": verify, "tokens": tokens}
    plain = statistics.median(times["plain"])
    rows = []
    print(f"{'setting':<14}{'tok/s':>8}{'ratio':>8}{'tau':>7}{'draft s':>9}{'verify s':>9}")
    for name, _ in settings:
        tps = statistics.median(times[name])
        row = {"setting": name, "tokens_per_second": tps, "ratio_vs_plain": tps / plain, **stats[name]}
        rows.append(row)
        print(f"{name:<14}{tps:>8.1f}{tps / plain:>8.2f}{stats[name]['tau']:>7.2f}"
              f"{stats[name]['draft_s']:>9.2f}{stats[name]['verify_s']:>9.2f}")
    print(f"threads={torch.get_num_threads()} target={args.target}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": args.target, "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
