"""A vLLM offline engine that prefills token ids and spools their hidden states (``capture --backend vllm``).

Run by ``draftsmith capture --backend vllm`` with a Python that has vLLM (``--vllm-python``), one process per
data-parallel rank. The engine is built with prefix caching and chunked prefill off (every prompt is prefilled
whole, so every position's states are computed in one forward) and eager mode (the capture hooks copy tensors
out of the forward, which a compiled graph would not run); then ``draftsmith.integrations.vllm.install_capture``
hooks the model through ``LLM.apply_model``. Each request is generated with ``max_tokens=1``; the hooks write one
``<spool>/<spool_key(ids)>.safetensors`` per prefill (atomically: temp file, fsync, rename), holding ``input_ids``
[T], ``aux`` [T, n, H] and ``hidden`` [T, H] (post-norm) in the engine's dtype.

Protocol: argv[1] is a JSON object of engine options (model, dtype, max_model_len, max_num_seqs,
max_num_batched_tokens, tensor_parallel_size, kv_cache_memory_bytes, gpu_memory_utilization, attention_backend,
seed) plus ``aux_layers`` and ``spool``. Then one JSON request per stdin line, ``{"prompts": [[ids]]}``, answered
by ``{"ok": true, "writes": n}`` once every file of that request is on disk, or ``{"error": "..."}``. The first
stdout line is ``{"ready": true, "num_layers": n, "route": "..."}``. vLLM's output goes to stderr.
"""

from __future__ import annotations

import json
import os
import sys

ROUTE = "draftsmith plugin capture hooks (vLLM offline engine, LLM.apply_model)"


def _protocol_stdout():
    """A private handle on the real stdout; fd 1 is pointed at stderr so library prints cannot corrupt it."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def _engine_args(opts: dict, cpu: bool) -> dict:
    """vLLM's LLM(...) arguments: whole prefills, no prefix cache, eager, token ids only."""
    keys = ("model", "dtype", "max_model_len", "max_num_seqs", "tensor_parallel_size", "seed",
            "kv_cache_memory_bytes" if cpu else "gpu_memory_utilization")
    args = {k: opts[k] for k in keys if opts.get(k) is not None}
    max_len = int(opts.get("max_model_len") or 4096)
    args.update(enable_prefix_caching=False, enable_chunked_prefill=False, enforce_eager=True,
                skip_tokenizer_init=True,
                # without chunked prefill one step must hold the longest prompt whole
                max_num_batched_tokens=max(max_len, int(opts.get("max_num_batched_tokens") or 0)))
    if opts.get("attention_backend"):
        args["attention_config"] = {"backend": opts["attention_backend"]}
    return args


def main() -> int:
    # Run as a script, this file's folder leads sys.path, and its sibling ``vllm.py`` would shadow vLLM;
    # draftsmith itself comes from the vLLM venv or, failing that, from this checkout's src/.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.path.append(os.path.dirname(os.path.dirname(here)))
    opts = json.loads(sys.argv[1])
    out = _protocol_stdout()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if int(opts.get("tensor_parallel_size") or 1) > 1:
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model ships a function to workers
    from functools import partial

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    from draftsmith.integrations.vllm import drain_capture, install_capture

    os.makedirs(opts["spool"], exist_ok=True)
    llm = LLM(**_engine_args(opts, current_platform.is_cpu()))
    layers = llm.apply_model(partial(install_capture, aux_layers=list(opts["aux_layers"]), spool=opts["spool"]))
    out.write(json.dumps({"ready": True, "num_layers": int(layers[0]), "route": ROUTE}) + "\n")
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in req["prompts"]], params, use_tqdm=False)
            state = [s for s in llm.apply_model(drain_capture) if s["rank0"]][0]
            errors = state["errors"]
            reply = {"error": "; ".join(errors)} if errors else {"ok": True, "writes": state["writes"]}
        except Exception as exc:  # report and keep serving: the driver decides
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
