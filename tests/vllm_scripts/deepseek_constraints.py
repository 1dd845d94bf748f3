"""Try vLLM (CPU) configurations of a DeepSeek-V3-structured target, expecting some to fail; one JSON line out.

Run with the vLLM venv's python, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``. The only argument is a JSON object
{"cases": [{"name", "target", "dtype", "attention_backend" (optional), "drafter" (optional EAGLE-3 dir)}]}.
Each case builds an engine and decodes 2 tokens of a short prompt; the result per case is {"name", "ok"} or
{"name", "ok": false, "error_type", "error"} (the exception's message chain, vLLM's own words). The line also
says whether the host has AMX ({"host": {"amx": bool}}), which decides vLLM's MLA backend.
"""

from __future__ import annotations

import gc
import json
import os
import sys

os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


def _messages(e: BaseException) -> str:
    parts = []
    while e is not None and len(parts) < 6:
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return " <- ".join(p.replace("\n", " ")[:600] for p in parts)


def try_case(case: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(dtype=case.get("dtype", "bfloat16"), skip_tokenizer_init=True, enforce_eager=True, max_model_len=256,
              seed=0, kv_cache_memory_bytes=256 << 20, max_num_seqs=1)
    if case.get("attention_backend"):
        kw["attention_config"] = {"backend": case["attention_backend"]}
    if case.get("drafter"):
        kw["speculative_config"] = {"method": "eagle3", "model": case["drafter"], "num_speculative_tokens": 2}
    llm = None
    try:
        llm = LLM(model=case["target"], **kw)
        llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3, 4])], SamplingParams(temperature=0, max_tokens=2),
                     use_tqdm=False)
        return {"name": case["name"], "ok": True}
    except Exception as e:
        return {"name": case["name"], "ok": False, "error_type": type(e).__name__, "error": _messages(e)}
    finally:
        del llm
        gc.collect()


def main() -> None:
    import torch

    cases = json.loads(sys.argv[1])["cases"]
    results = [try_case(c) for c in cases]
    # vLLM's CPU platform picks AMX_MLA (bf16 only, KV blocks in multiples of 32) on AMX hosts, else CPU_MLA
    print(json.dumps({"cases": results, "host": {"amx": bool(torch.cpu._is_amx_tile_supported())}}))


if __name__ == "__main__":
    main()
