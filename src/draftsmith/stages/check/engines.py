"""The pair decoded in a real engine, plain and speculative, greedy, on the same token-id prompts.

llama.cpp runs in this process (xllamacpp); its counters are ``draft_n`` / ``draft_n_accepted`` per request, and the
plain run reports its top-2 log-probabilities per token (``logprobs: 2``), which tell a near-tie flip from a real
divergence. vLLM runs in its own environment (``integrations/vllm_check_worker.py`` under that Python); its
counters are ``vllm:spec_decode_num_drafts`` / ``..._accepted_tokens``, read from ``LLM.get_metrics()``.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path


@dataclass
class Served:
    """One run of every prompt: what the engine emitted and its own acceptance counters."""

    name: str
    token_ids: list[list[int]] = field(default_factory=list)
    passes: int = 0  # verify passes after prefill
    accepted: int = 0  # draft tokens accepted
    drafted: int = 0
    top: list[list[list[list[float]]]] | None = None  # [prompt][position] -> [[id, log-prob], ...] best first
    error: str | None = None

    @property
    def tau(self) -> float:
        """Acceptance length: tokens per verify pass (accepted drafts + the bonus)."""
        return 1.0 + self.accepted / self.passes if self.passes else 1.0


@dataclass
class EngineOutcome:
    engine: str
    version: str
    plain: Served
    spec: Served


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


def run_llamacpp(target_gguf: str | Path, drafter_gguf: str | Path, prompts: list[list[int]], k: int,
                 max_new_tokens: int, threads: int = 1) -> EngineOutcome:
    """Plain then EAGLE-3 (chain of ``k``) in llama.cpp; a drafter it refuses is reported, not raised."""
    from draftsmith.integrations.llamacpp import LlamaCppEngine

    version = _version("xllamacpp")
    plain = _llamacpp_runs("plain", LlamaCppEngine(target_gguf, "plain", threads=threads), prompts, max_new_tokens)
    try:
        engine = LlamaCppEngine(target_gguf, "eagle3", drafter=drafter_gguf, k=k, threads=threads)
    except Exception as e:  # noqa: BLE001 - a refusal at load is an outcome of the check
        return EngineOutcome("llamacpp", version, plain, Served("speculative", error=f"{type(e).__name__}: {e}"))
    return EngineOutcome("llamacpp", version, plain, _llamacpp_runs("speculative", engine, prompts, max_new_tokens))


def _llamacpp_runs(name: str, engine, prompts: list[list[int]], max_new_tokens: int) -> Served:
    out = Served(name, top=[] if name == "plain" else None)
    for ids in prompts:
        r = engine.server.handle_completions({
            "prompt": list(map(int, ids)), "n_predict": int(max_new_tokens), "temperature": 0.0, "top_k": 1,
            "cache_prompt": False, "logprobs": 2 if name == "plain" else 1})
        if "choices" not in r:
            out.error = f"llama.cpp refused the request: {r.get('message') or r}"
            return out
        content = (r["choices"][0].get("logprobs") or {}).get("content") or []
        out.token_ids.append([int(c["id"]) for c in content])
        if out.top is not None:
            out.top.append([[[int(t["id"]), float(t["logprob"])] for t in c.get("top_logprobs", [])]
                            for c in content])
        t, n = r.get("timings", {}), int(r["usage"]["completion_tokens"])
        acc = int(t.get("draft_n_accepted", 0))
        out.accepted += acc
        out.drafted += int(t.get("draft_n", 0))
        out.passes += max(n - 1 - acc, 1)  # the first token comes from prefill (EngineRun.verify_passes)
    return out


def run_vllm(python: str | Path, target: str, drafter_dir: str | Path, prompts: list[list[int]], k: int,
             max_new_tokens: int, *, dtype: str = "auto", max_model_len: int | None = None,
             kv_cache_bytes: int | None = None,
             timeout_s: float = 1800.0) -> EngineOutcome:
    """Plain then EAGLE-3 (chain of ``k``) in vLLM, run by ``python`` (vLLM's environment) in a child process."""
    worker = Path(__file__).resolve().parents[2] / "integrations" / "vllm_check_worker.py"
    spec = {"method": "eagle3", "model": str(Path(drafter_dir).resolve()), "num_speculative_tokens": int(k)}
    job = {"target": target, "dtype": dtype, "max_model_len": max_model_len, "max_tokens": max_new_tokens,
           "prompts": prompts, "speculative_config": spec, "logprobs": 2, "kv_cache_bytes": kv_cache_bytes}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1"}
    env.pop("PYTHONPATH", None)  # vLLM's environment, not ours
    with tempfile.TemporaryDirectory(prefix="draftsmith-check-") as tmp:
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps(job))
        try:
            proc = subprocess.run([str(python), str(worker), str(job_file)], capture_output=True, text=True,
                                  timeout=timeout_s, env=env, cwd=tmp)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"vLLM did not finish in {timeout_s:.0f} s") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"vllm_version"')]
    if proc.returncode != 0 or not lines:
        tail = " ".join((proc.stderr or proc.stdout).split()[-60:])
        raise RuntimeError(f"vLLM's check worker failed (exit {proc.returncode}): {tail}")
    result = json.loads(lines[-1])
    runs = {r["name"]: r for r in result["runs"]}
    return EngineOutcome("vllm", result["vllm_version"], _vllm_served(runs["plain"]), _vllm_served(runs["speculative"]))


def _vllm_served(r: dict) -> Served:
    if "error" in r:
        return Served(r["name"], error=r["error"])
    m = r["metrics"]
    return Served(r["name"], token_ids=r["token_ids"], passes=int(m["vllm:spec_decode_num_drafts"]),
                  accepted=int(m["vllm:spec_decode_num_accepted_tokens"]),
                  drafted=int(m["vllm:spec_decode_num_draft_tokens"]), top=r.get("logprobs"))
