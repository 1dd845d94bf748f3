"""Served acceptance: the exported drafter's tau in vLLM (its own spec-decode counters) against draftsmith's.

    .venv/bin/python bench/vllm_tau.py --drafter runs/full/run/best --export runs/full/export/vllm --k 5 \
        [--limit 12] [--max-tokens 128] [--dtype float32] [--ngram 4] [--json out.json]

Issue 16's check that the drafter serves as it measures: on the same MT-bench first turns (token ids, the chat
template applied by draftsmith, so both engines see the same prompt), greedy, exactly ``--max-tokens`` new
tokens each, it reports
  - draftsmith's chain-k tau (``SpeculativeDecoder``, in-process),
  - vLLM with the exported drafter as EAGLE-3, k draft tokens: tau = 1 + accepted / drafts,
  - vLLM's n-gram proposer, k = ``--ngram``, and vLLM plain, with tok/s for each.
vLLM runs in its own venv through tests/vllm_scripts/spec_decode.py (the script the engine tests use), one
engine after another in one process. Run it alone on the machine: vLLM binds its threads to the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "vllm_scripts" / "spec_decode.py"


def prompts_ids(tokenizer, limit: int) -> list[list[int]]:
    from draftsmith.data.chat import encode_prompt
    from draftsmith.data.prompts import load_prompts

    return [list(encode_prompt(tokenizer, p.turns[0], chat=True)) for p in load_prompts("mt-bench", limit, turns=1)]


def draftsmith_tau(args, prompts: list[list[int]]) -> dict:
    import torch

    from draftsmith.model.drafter import load_drafter
    from draftsmith.model.target import load_target
    from draftsmith.stages.decode import ChainSpec, SpeculativeDecoder

    target = load_target(args.target, dtype=getattr(torch, args.dtype))
    drafter = load_drafter(args.drafter, target)
    dec = SpeculativeDecoder(target, drafter, ChainSpec(args.k))
    tokens = passes = accepted = 0
    ids = []
    t = time.perf_counter()
    for p in prompts:
        r = dec.generate(p, args.max_tokens)  # no stop tokens: exactly max_tokens, as vLLM's ignore_eos
        tokens += len(r.token_ids)
        passes += len(r.accepted_per_step)
        accepted += sum(r.accepted_per_step)
        ids.append(r.token_ids)
    return {"tau": 1 + accepted / max(passes, 1), "tok_s": tokens / (time.perf_counter() - t), "token_ids": ids}


def vllm_runs(args, prompts: list[list[int]]) -> dict:
    from draftsmith.model.sources import resolve_model_path

    model = str(resolve_model_path(args.target)[0].resolve())
    runs = [{"name": "plain"},
            {"name": f"eagle3 k={args.k}", "speculative_config": {
                "method": "eagle3", "model": str(Path(args.export).resolve()), "num_speculative_tokens": args.k}},
            {"name": f"ngram k={args.ngram}", "speculative_config": {
                "method": "ngram", "num_speculative_tokens": args.ngram, "prompt_lookup_max": args.ngram,
                "prompt_lookup_min": 1}}]
    job = {"target": model, "dtype": args.dtype, "max_model_len": max(map(len, prompts)) + args.max_tokens + 16,
           "max_tokens": args.max_tokens, "prompts": prompts, "runs": runs, "max_num_seqs": 1,
           "kv_cache_bytes": 1 << 30}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    with tempfile.TemporaryDirectory() as d:
        job_file = Path(d) / "job.json"
        job_file.write_text(json.dumps(job))
        proc = subprocess.run([args.vllm_python, str(SCRIPT), str(job_file)], env=env, capture_output=True,
                              text=True, cwd=d)
    lines = [x for x in proc.stdout.splitlines() if x.startswith('{"runs"')]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"vLLM job failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    out = {}
    for r in json.loads(lines[-1])["runs"]:
        if "error" in r:
            out[r["name"]] = {"error": r["error"]}
            continue
        m = r["metrics"]
        drafts = m["vllm:spec_decode_num_drafts"]
        tokens = sum(len(t) for t in r["token_ids"])
        out[r["name"]] = {"tau": 1 + m["vllm:spec_decode_num_accepted_tokens"] / drafts if drafts else 1.0,
                          "tok_s": tokens / r["seconds"]["generate"], "token_ids": r["token_ids"],
                          "per_position": m["vllm:spec_decode_num_accepted_tokens_per_pos"]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", required=True, help="draftsmith's drafter directory (run/best)")
    p.add_argument("--export", required=True, help="the same drafter exported in the vLLM layout")
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--ngram", type=int, default=4)
    p.add_argument("--limit", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from draftsmith.model.target import load_target

    prompts = prompts_ids(load_target(args.target, pack=False).tokenizer, args.limit)
    ours = draftsmith_tau(args, prompts)
    served = vllm_runs(args, prompts)
    eagle = served.get(f"eagle3 k={args.k}", {})
    plain_ids = served.get("plain", {}).get("token_ids")
    rows = {"draftsmith chain": ours, **served}
    print(f"{len(prompts)} MT-bench first turns x {args.max_tokens} tokens, {args.dtype}, k={args.k}")
    for name, r in rows.items():
        if "error" in r:
            print(f"  {name:<18} error: {r['error'][:200]}")
            continue
        same = "" if plain_ids is None else \
            f"  same as vLLM plain {sum(a == b for a, b in zip(r['token_ids'], plain_ids, strict=True))}/{len(prompts)}"
        print(f"  {name:<18} tau {r['tau']:.2f}  {r['tok_s']:6.1f} tok/s{same}")
    if "tau" in eagle:
        print(f"vLLM EAGLE-3 tau / draftsmith tau: {eagle['tau'] / ours['tau']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": {
            k: {x: y for x, y in v.items() if x != "token_ids"} for k, v in rows.items()}}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
