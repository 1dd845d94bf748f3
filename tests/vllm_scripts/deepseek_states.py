"""Run DeepSeek-V3-structured targets in vLLM and record what they compute, for comparison with transformers.

Run with the vLLM venv's python, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``. The only argument is a JSON object:
  prompts      list of token-id lists (each is run alone, batch 1: prefill, then greedy decode)
  max_tokens   new tokens per prompt (greedy, ignore_eos)
  runs         list of {"target": dir, "dtype": "float32"|"bfloat16", "attention_backend": null|"CPU_MLA",
               "out": torch file for the states}; the engines are built one after the other in this process
               (``attention_backend: "CPU_MLA"`` is what float32 needs on AMX hosts: vLLM's default there,
               AMX_MLA, takes bf16 weights only)
Recorded per prompt, for every position the engine ran (prompt + generated[:-1]): the residual stream
entering each decoder layer (``hidden_states + residual``, what vLLM hands an EAGLE-3 drafter as aux state L),
the router logits of every MoE layer (``gate`` output, before the sigmoid and the correction bias), and the
log-probability of every next token (prompt logprobs, then the generated tokens' logprobs).
The torch file holds {"states": [per prompt {layer: [T, H]}], "router_logits": [per prompt {layer: [T, E]}]}.
Prints one JSON line: {"runs": [{"ok", "tokens", "logprobs" (per prompt, positions 1..), "num_layers"} or
{"ok": false, "error_type", "error"}]}.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback

os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries the one JSON line


def _install_hooks(model, record: list, routing: list) -> int:
    """Pre-hooks on every decoder layer (its input residual stream) and hooks on every MoE gate."""
    layers = model.model.layers

    def layer_hook(i):
        def pre_hook(module, hook_args):
            hidden, residual = hook_args[1], hook_args[2]
            x = hidden if residual is None else hidden + residual  # a new tensor: later in-place norms keep off
            record.append((i, x.detach().float().cpu().clone()))
        return pre_hook

    def gate_hook(i):
        def hook(module, hook_args, output):
            logits = output[0] if isinstance(output, tuple) else output
            routing.append((i, logits.detach().float().cpu().clone()))
        return hook

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(layer_hook(i))
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(layer.mlp, "experts"):
            gate.register_forward_hook(gate_hook(i))
    return len(layers)


def _by_layer(pairs: list) -> dict:
    import torch

    out: dict[int, list] = {}
    for i, x in pairs:
        out.setdefault(i, []).append(x)
    return {i: torch.cat(v) for i, v in out.items()}


def run_one(run: dict, prompts: list[list[int]], max_tokens: int) -> dict:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(dtype=run.get("dtype", "float32"), skip_tokenizer_init=True, enforce_eager=True,
              max_model_len=int(run.get("max_model_len", 512)), seed=0, kv_cache_memory_bytes=256 << 20, max_num_seqs=1)
    if run.get("attention_backend"):
        kw["attention_config"] = {"backend": run["attention_backend"]}
    llm = LLM(model=run["target"], **kw)
    try:
        record: list = []
        routing: list = []
        n_layers = llm.apply_model(lambda m: _install_hooks(m, record, routing))[0]
        tokens, logprobs, states, router = [], [], [], []
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, prompt_logprobs=0)
        for p in prompts:
            record.clear()
            routing.clear()
            out = llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0]
            gen = list(out.outputs[0].token_ids)
            lp = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], p[1:], strict=True)]
            lp += [d[t].logprob for d, t in zip(out.outputs[0].logprobs, gen, strict=True)]
            tokens.append(gen)
            logprobs.append(lp)
            states.append(_by_layer(record))
            router.append(_by_layer(routing))
        if run.get("out"):
            torch.save({"states": states, "router_logits": router}, run["out"])
        return {"ok": True, "tokens": tokens, "logprobs": logprobs, "num_layers": n_layers}
    finally:
        del llm
        gc.collect()


def main() -> None:
    args = json.loads(sys.argv[1])
    results = []
    for run in args["runs"]:
        try:
            results.append(run_one(run, args["prompts"], int(args["max_tokens"])))
        except Exception as e:  # one JSON line either way: the caller asserts on it
            results.append({"ok": False, "error_type": type(e).__name__,
                            "error": str(e).splitlines()[0] if str(e) else "",
                            "traceback": traceback.format_exc()[-3000:]})
    print(json.dumps({"runs": results}))


if __name__ == "__main__":
    main()
