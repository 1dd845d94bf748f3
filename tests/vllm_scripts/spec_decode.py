"""Run one or more in-process vLLM engines over the same token-id prompts; print one JSON line of results.

Run with the vLLM venv's python (tests/test_vllm_engine.py does): ``python spec_decode.py JOB.json``.
JOB.json holds ``target``, ``dtype``, ``max_model_len``, ``max_tokens``, ``prompts`` (lists of token ids) and
``runs``: ``{"name", "model" (optional, default target), "speculative_config" (optional)}``. Each run builds
a fresh ``LLM``, decodes every prompt greedily (``ignore_eos``, exactly ``max_tokens`` new tokens) and reports
the token ids and the spec-decode counters of ``LLM.get_metrics()`` accumulated by that run's generate call.
A run that fails is reported with its error instead of aborting the others.
"""

from __future__ import annotations

import gc
import json
import sys
import time
import traceback

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_metrics(llm) -> dict:
    """Counters summed over label sets (one engine here); the per-position vector summed elementwise."""
    out: dict = {name: 0 for name in SPEC_COUNTERS}
    out[PER_POS] = []
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS:
            out[m.name] += int(m.value)
        elif m.name == PER_POS:
            vals = [int(v) for v in m.values]
            acc = out[PER_POS] + [0] * (len(vals) - len(out[PER_POS]))
            out[PER_POS] = [a + v for a, v in zip(acc, vals + [0] * (len(acc) - len(vals)), strict=True)]
    return out


def delta(after: dict, before: dict) -> dict:
    d = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    b = before[PER_POS] + [0] * (len(after[PER_POS]) - len(before[PER_POS]))
    d[PER_POS] = [a - x for a, x in zip(after[PER_POS], b, strict=True)]
    return d


def run_one(job: dict, run: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    kwargs = dict(model=run.get("model", job["target"]), dtype=job.get("dtype", "float32"),
                  max_model_len=job.get("max_model_len", 256), seed=0, enforce_eager=True,
                  max_num_seqs=job.get("max_num_seqs", 8), kv_cache_memory_bytes=job.get("kv_cache_bytes", 64 << 20),
                  disable_log_stats=False)
    if run.get("speculative_config"):
        kwargs["speculative_config"] = run["speculative_config"]
    llm = LLM(**kwargs)
    t1 = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    before = spec_metrics(llm)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
    after = spec_metrics(llm)
    t2 = time.perf_counter()
    config = llm.llm_engine.vllm_config
    spec = config.speculative_config
    result = {
        "name": run["name"],
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        "metrics": delta(after, before),
        # what vLLM made of the request (a speculators checkpoint given as the model fills this in itself)
        "speculative_config": None if spec is None else {
            "method": spec.method, "model": spec.model, "num_speculative_tokens": spec.num_speculative_tokens},
        "served_model": config.model_config.model,
        "seconds": {"init": t1 - t0, "generate": t2 - t1},
    }
    del llm
    return result


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    results = []
    for run in job["runs"]:
        try:
            results.append(run_one(job, run))
        except Exception as exc:  # report and go on: one broken export must not hide the others' numbers
            results.append({"name": run["name"], "error": f"{type(exc).__name__}: {exc}",
                            "traceback": traceback.format_exc()[-3000:]})
        finally:
            gc.collect()
            try:
                from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

                cleanup_dist_env_and_memory()
            except Exception:  # best effort between engines
                pass
    print(json.dumps({"runs": results}), flush=True)


if __name__ == "__main__":
    main()
