"""The pair decoded in a real engine, plain and speculative, greedy, on the same token-id prompts.

llama.cpp runs in this process (xllamacpp); its counters are ``draft_n`` / ``draft_n_accepted`` per request, and the
plain run reports its top-2 log-probabilities per token (``logprobs: 2``), which tell a near-tie flip from a real
divergence. vLLM runs in its own environment (``integrations/vllm_check_worker.py`` under that Python); its
counters are ``vllm:spec_decode_num_drafts`` / ``..._accepted_tokens``, read from ``LLM.get_metrics()``.
OpenVINO GenAI runs in its own environment too (``integrations/openvino_worker.py``), f32 compute over an f32 KV
cache (the one setting that kept its output equal to plain); its counter is ``get_num_accepted_tokens()`` per
request. GenAI's #4425: a freshly built speculative pipeline may accept no draft at all (3 of 50 instances, output
unchanged) or crash at its first generate; a speculative run that accepts nothing, or dies, is retried once in a
fresh pipeline, and both runs are reported, so the check tells that engine fault from the drafter's.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from draftsmith.core.io import process_temp_dir
from draftsmith.core.processes import child_options


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
    per_prompt: list[int] = field(default_factory=list)  # accepted drafts per prompt, where the engine counts so

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
    #: A first speculative run the engine threw away: GenAI #4425's zero-acceptance pipeline (or a crash), retried.
    first_try: Served | None = None


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
    from draftsmith.integrations.llamacpp import verify_passes

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
        acc, drafted = int(t.get("draft_n_accepted", 0)), int(t.get("draft_n", 0))
        passes = max(verify_passes(n, drafted, acc, engine.k), 1)  # as EngineRun counts them
        out.accepted += max(min(acc, n - 1 - passes), 0)  # the emitted ones (not those past a stop token)
        out.drafted += drafted
        out.passes += passes
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
    with process_temp_dir("draftsmith-vllm-job-") as tmp:
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps(job))
        try:
            proc = subprocess.run([str(python), str(worker), str(job_file)], capture_output=True, text=True,
                                  timeout=timeout_s, env=env, cwd=tmp, **child_options())
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


def run_openvino(target_ir: str | Path, draft_ir: str | Path, prompts: list[list[int]], k: int, max_new_tokens: int,
                 *, eos: list[int], threads: int = 1, python: str | Path | None = None,
                 timeout_s: float = 1800.0) -> EngineOutcome:
    """Plain then EAGLE-3 (chain of ``k``) in OpenVINO GenAI, f32 over an f32 KV cache, in its own environment.

    A speculative run that accepts no draft on any prompt, or whose worker dies (a refusal at load is not retried:
    it repeats), is run once more in a fresh pipeline (GenAI #4425); the first try is kept in ``first_try``.
    """
    from draftsmith.core import openvino_facts as facts

    plain_m = {"name": "plain", "mode": "plain"}
    spec_m = {"name": "speculative", "mode": "eagle3", "k": int(k)}
    base = {"op": "decode", "target": str(target_ir), "draft": str(draft_ir), "prompts": prompts,
            "max_new_tokens": int(max_new_tokens), "eos": list(eos), "threads": threads,
            "inference_precision": facts.INFERENCE_PRECISION, "kv_cache_precision": facts.DEFAULT_KV_PRECISION}
    answer = _openvino_call({**base, "methods": [plain_m, spec_m]}, python, timeout_s)
    if "runs" not in answer:  # the pair failed together: run plain alone to tell who refused
        plain_only = _openvino_call({**base, "methods": [plain_m]}, python, timeout_s)
        if "runs" not in plain_only:
            return EngineOutcome("openvino", "?", Served("plain", error=plain_only["error"]),
                                 Served("speculative", error=answer["error"]))
        answer = {"runs": {**plain_only["runs"], "speculative": None}, "versions": plain_only.get("versions", {}),
                  "spec_error": answer["error"]}
    version = (answer.get("versions") or {}).get("openvino-genai", "?")
    plain = _openvino_served("plain", answer["runs"]["plain"])
    spec = (_openvino_served("speculative", answer["runs"]["speculative"]) if answer["runs"]["speculative"]
            else Served("speculative", error=answer["spec_error"]))
    first = None
    crashed = spec.error is not None and "worker died" in spec.error  # not a refusal at load, which repeats
    if crashed or (spec.error is None and spec.passes > len(prompts) and spec.accepted == 0):
        retry = _openvino_call({**base, "methods": [spec_m]}, python, timeout_s)
        if "runs" in retry:
            first, spec = spec, _openvino_served("speculative", retry["runs"]["speculative"])
    return EngineOutcome("openvino", version, plain, spec, first_try=first)


def _openvino_call(request: dict, python, timeout_s: float) -> dict:
    """The worker's answer, or {"error": its words} (a refusal or a crash is an outcome of the check)."""
    from draftsmith.integrations.openvino import OpenVinoError, run_worker

    try:
        return run_worker(request, python=python, timeout=timeout_s)
    except OpenVinoError as e:
        if "did not answer" in str(e):
            raise RuntimeError(str(e)) from None
        return {"error": str(e).removeprefix("OpenVINO GenAI: ")}


def _openvino_served(name: str, runs: list[dict]) -> Served:
    """GenAI's counters as the other engines': the first token comes from prefill, every other pass verifies."""
    out = Served(name)
    for r in runs:
        out.token_ids.append([int(t) for t in r["tokens"]])
        acc = int(r.get("accepted", 0))
        out.accepted += acc
        out.per_prompt.append(acc)
        out.passes += max(len(r["tokens"]) - 1 - acc, 1)
    return out


def run_sglang(python: str | Path, target: str, drafter_dir: str | Path, prompts: list[list[int]], k: int,
               max_new_tokens: int, *, dtype: str = "auto", startup_s: float = 900.0) -> EngineOutcome:
    """A plain SGLang server, then an EAGLE-3 one (chain of ``k``), each launched by ``python`` (SGLang's
    environment) and stopped after its prompts; the counters are each response's ``meta_info``."""
    from draftsmith.integrations.sglang import SglangError, SglangServer, counters, free_port, launch_argv, top_logprobs

    runs, version = {}, "?"
    for name, drafter in (("plain", None), ("speculative", drafter_dir)):
        port = free_port()
        out = Served(name, top=[] if name == "plain" else None)
        try:
            with SglangServer(launch_argv(python, target, port, drafter=drafter, k=k, dtype=dtype), port,
                              startup_s=startup_s) as server:
                version = str(server.get("/get_server_info").get("version") or version)
                for ids in prompts:
                    r = server.generate(ids, max_new_tokens, top_logprobs=2 if name == "plain" else 0)
                    meta = r.get("meta_info") or {}
                    out.token_ids.append([int(t) for t in r.get("output_ids") or []])
                    if out.top is not None:
                        out.top.append(top_logprobs(meta))
                    if drafter is not None:
                        acc, passes = counters(meta)
                        out.accepted += acc
                        out.passes += passes
                        out.per_prompt.append(acc)
        except SglangError as e:
            out.error = str(e)
        runs[name] = out
    return EngineOutcome("sglang", version, runs["plain"], runs["speculative"])
