"""Serve a target (optionally with an EAGLE-3 drafter) in vLLM and print one JSON line.

Run with the vLLM venv's python (``.venv-vllm/bin/python``), ``VLLM_ENABLE_V1_MULTIPROCESSING=0``. The only
argument is a JSON object:
  target      model directory
  drafter     EAGLE-3 drafter directory (vLLM layout) or null for plain decoding
  prompts     list of token-id lists
  max_tokens  new tokens per prompt (greedy)
  k           num_speculative_tokens (default 3)
  dtype       "bfloat16" (default) or "float32"
  attention_backend  e.g. "CPU_MLA" (default: vLLM's choice; AMX_MLA on AMX hosts, bf16 only)
  stop_token_ids     stop at these tokens (default: none, and EOS is ignored)
Output: {"ok": true, "tokens": [...], "metrics": {spec_decode counters}, "aux_layers": [ids] | null,
"load_s", "generate_s"} or {"ok": false, "error": "...", "error_type": "..."}.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

# vLLM logs to stdout by default; keep stdout for the one JSON line.
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


def main() -> None:
    args = json.loads(sys.argv[1])
    t0 = time.time()
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        kw = dict(dtype=args.get("dtype", "bfloat16"), skip_tokenizer_init=True, enforce_eager=True,
                  max_model_len=int(args.get("max_model_len", 512)), seed=0, kv_cache_memory_bytes=256 << 20,
                  disable_log_stats=False, max_num_seqs=int(args.get("max_num_seqs", 1)))
        if args.get("attention_backend"):
            kw["attention_config"] = {"backend": args["attention_backend"]}
        if args.get("drafter"):
            kw["speculative_config"] = {"method": "eagle3", "model": args["drafter"],
                                        "num_speculative_tokens": int(args.get("k", 3))}
        llm = LLM(model=args["target"], **kw)
        t1 = time.time()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in args["prompts"]],
                            SamplingParams(temperature=0, max_tokens=int(args["max_tokens"]),
                                           stop_token_ids=list(args.get("stop_token_ids") or []),
                                           ignore_eos=not args.get("stop_token_ids")),
                            use_tqdm=False)
        t2 = time.time()
        metrics = {}
        for m in llm.get_metrics():
            if "spec_decode" in m.name:
                metrics[m.name] = getattr(m, "value", None) if hasattr(m, "value") else list(m.values)
        # The aux layers the target was told to expose (vLLM ids: input of layer L), read off the model itself.
        aux = llm.apply_model(lambda m: list(getattr(getattr(m, "model", m), "aux_hidden_state_layers", ()) or ()))
        print(json.dumps({"ok": True, "tokens": [list(o.outputs[0].token_ids) for o in outs], "metrics": metrics,
                          "aux_layers": aux[0] if aux else None, "load_s": t1 - t0, "generate_s": t2 - t1}))
    except Exception as e:  # one JSON line either way: the caller asserts on it
        message = str(e).splitlines()[0] if str(e) else ""
        print(json.dumps({"ok": False, "error_type": type(e).__name__, "error": message,
                          "traceback": traceback.format_exc()[-3000:]}))


if __name__ == "__main__":
    main()
