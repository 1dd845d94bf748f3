"""``draftsmith check --engine vllm``: decode the same token-id prompts in vLLM plain and with the drafter.

Run with the Python of vLLM's environment (vLLM pins its own torch and transformers), so this file imports only
the standard library and vLLM, never draftsmith. argv[1] is a JSON job: ``target``, ``dtype``, ``max_model_len``,
``max_tokens``, ``prompts`` (lists of token ids), ``speculative_config`` (vLLM's dict), optional ``kv_cache_bytes``,
``logprobs`` (top log-probs the plain run reports per token, for telling near-tie flips from real divergence).
Greedy, ``ignore_eos``: exactly ``max_tokens`` new tokens per prompt in both runs. The last stdout line is one JSON
object: ``{"vllm_version", "runs": [{"name": "plain"|"speculative", "token_ids", "logprobs"?, "metrics"} |
{"name", "error"}]}``; the metrics are vLLM's own spec-decode counters for that run's generate call.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_metrics(llm) -> dict:
    """Counters summed over label sets; the per-position vector summed elementwise."""
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


def _top(lp: dict) -> list:
    """[[token id, log-prob], ...] best first, from one position's {id: Logprob}."""
    return sorted(([int(t), float(v.logprob)] for t, v in lp.items()), key=lambda x: -x[1])


def run(job: dict, name: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=job["target"], dtype=job.get("dtype", "auto"), seed=0,
                  enforce_eager=job.get("enforce_eager", True), max_num_seqs=job.get("max_num_seqs", 8),
                  disable_log_stats=False)
    if job.get("max_model_len"):  # else the model's own (a larger one is refused)
        kwargs["max_model_len"] = job["max_model_len"]
    if job.get("kv_cache_bytes"):
        kwargs["kv_cache_memory_bytes"] = job["kv_cache_bytes"]
    if name == "speculative":
        kwargs["speculative_config"] = job["speculative_config"]
    llm = LLM(**kwargs)
    want_lp = name == "plain" and job.get("logprobs")
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True,
                            logprobs=job["logprobs"] if want_lp else None)
    before = spec_metrics(llm)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
    after = spec_metrics(llm)
    metrics = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    b = before[PER_POS] + [0] * (len(after[PER_POS]) - len(before[PER_POS]))
    metrics[PER_POS] = [a - x for a, x in zip(after[PER_POS], b, strict=True)]
    result = {"name": name, "token_ids": [list(o.outputs[0].token_ids) for o in outs], "metrics": metrics}
    if want_lp:
        result["logprobs"] = [[_top(lp) for lp in (o.outputs[0].logprobs or [])] for o in outs]
    del llm
    return result


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    here = os.path.dirname(os.path.abspath(__file__))  # its sibling vllm.py would shadow vLLM
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    with open(sys.argv[1]) as f:
        job = json.load(f)
    import vllm

    results = []
    for name in ("plain", "speculative"):
        try:
            results.append(run(job, name))
        except Exception as exc:  # a drafter vLLM refuses is a result, not a crash of the check
            results.append({"name": name, "error": f"{type(exc).__name__}: {exc}",
                            "traceback": traceback.format_exc()[-3000:]})
        finally:
            gc.collect()
            try:
                from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

                cleanup_dist_env_and_memory()
            except Exception:  # noqa: BLE001 - best effort between engines
                pass
    print(json.dumps({"vllm_version": getattr(vllm, "__version__", "?"), "runs": results}), flush=True)


if __name__ == "__main__":
    main()
