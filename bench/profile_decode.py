"""Where a speculative round's time goes: instrumented plain and EAGLE-3 decoding of the same prompts.

Splits wall time into target passes (prefill, 1-token steps, k-token verify passes), drafter steps (its layer and
its lm_head), KV-cache bookkeeping and the rest (Python), and prints the physical bound
tau * t_plain_step / (t_verify + t_draft) next to the measured speedup.

Run: python bench/profile_decode.py --drafter runs/demo/run/best [--dtype bfloat16] [--chain 3 | --tree 2,6,10
     [--hybrid 16]] [--prompts 4]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

from draftsmith.app.bench import decode_prompts, speedup_bound
from draftsmith.data.chat import encode_prompt, stop_token_ids
from draftsmith.data.prompts import load_prompts
from draftsmith.model.drafter import load_drafter
from draftsmith.model.target import load_target
from draftsmith.stages.decode import ChainSpec, HybridSpec, SpeculativeDecoder, TreeSpec


def _wrap(module: torch.nn.Module, label: str, clock: dict[str, float]) -> None:
    """Add the wall time of every call of a module to clock[label] (CPU: calls are synchronous).

    A timer per module call, not torch.profiler: a trace of every aten op over a few hundred decoding steps
    takes minutes to aggregate and perturbs what it measures more than a perf_counter pair per call."""
    forward = module.forward

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            clock[label] += time.perf_counter() - t

    module.forward = timed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--chain", type=int, default=3)
    ap.add_argument("--tree", default=None, metavar="DEPTH,TOPK,TOTAL", help="profile a tree instead of a chain")
    ap.add_argument("--hybrid", type=int, default=0, metavar="K",
                    help="with --tree: graft prompt lookup of K tokens onto the tree (the hybrid proposer)")
    ap.add_argument("--prompts", type=int, default=4, help="first N MT-bench questions (first turn)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    target = load_target(args.target, dtype=getattr(torch, args.dtype))
    drafter = load_drafter(args.drafter, target)
    tok = target.tokenizer
    stops = stop_token_ids(tok)
    prompts = [encode_prompt(tok, p.turns[0], chat=True) for p in load_prompts("mt-bench", args.prompts, 1)]
    spec = TreeSpec.parse(args.tree) if args.tree else ChainSpec(args.chain)
    if args.hybrid:
        spec = HybridSpec.parse(args.tree, args.hybrid)
    plain, spec_dec = SpeculativeDecoder(target, None, None), SpeculativeDecoder(target, drafter, spec)
    clock: dict[str, float] = defaultdict(float)
    _wrap(target.model, "target", clock)
    _wrap(drafter.lm_head, "drafter.lm_head", clock)
    _wrap(drafter.layers[0], "drafter.layer", clock)
    _wrap(drafter.fc, "drafter.fc", clock)
    for d in (plain, spec_dec):  # warm-up
        d.generate(prompts[0], 8, eos_token_ids=stops)

    report = {}
    for name, dec in (("plain", plain), ("speculative", spec_dec)):
        clock.clear()
        stats, _ = decode_prompts(dec, prompts, args.max_new_tokens)
        row = stats.to_dict()  # tokens, seconds, prefill/draft/verify/overhead time, step_time, tau, ...
        row.update({f"{key.replace('.', '_')}_time": clock.get(key, 0.0)
                    for key in ("target", "drafter.layer", "drafter.lm_head", "drafter.fc")})
        report[name] = row
    p, s = report["plain"], report["speculative"]
    passes = max(1, s["verify_passes"])
    report["summary"] = {"t_plain_step_ms": 1e3 * p["step_time"], "t_verify_ms": 1e3 * s["verify_time"] / passes,
                         "t_draft_round_ms": 1e3 * s["draft_time"] / passes,
                         "acceptance_length": s["acceptance_length"],
                         "speedup": s["tokens_per_second"] / p["tokens_per_second"], "bound": speedup_bound(s, p)}
    print(f"{'':12}{'wall s':>8}{'tok/s':>7}{'target':>8}{'d.layer':>8}{'d.head':>8}{'d.fc':>7}{'prefill':>8}"
          f"{'draft':>7}{'verify':>7}{'other':>7}")
    for name in ("plain", "speculative"):
        r = report[name]
        print(f"{name:<12}{r['seconds']:>8.2f}{r['tokens_per_second']:>7.1f}{r['target_time']:>8.2f}"
              f"{r['drafter_layer_time']:>8.2f}{r['drafter_lm_head_time']:>8.2f}{r['drafter_fc_time']:>7.2f}"
              f"{r['prefill_time']:>8.2f}{r['draft_time']:>7.2f}{r['verify_time']:>7.2f}{r['overhead_time']:>7.2f}")
    m = report["summary"]
    print(f"plain step {m['t_plain_step_ms']:.1f} ms; per round: verify {m['t_verify_ms']:.1f} ms "
          f"({m['t_verify_ms'] / m['t_plain_step_ms']:.2f}x a step), draft {m['t_draft_round_ms']:.1f} ms; "
          f"tau {m['acceptance_length']:.2f}; speedup {m['speedup']:.2f}x of bound {m['bound']:.2f}x "
          f"({100 * m['speedup'] / m['bound']:.0f}%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
