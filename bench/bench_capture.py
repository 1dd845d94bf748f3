"""HF vs vLLM capture throughput on the same conversations (issue 17's goal: vLLM >= 1.5x HF tok/s on SmolLM2 bf16).

    .venv/bin/python bench/bench_capture.py [--conversations FILE] [--n 256] [--repeats 3] [--target smollm2]

Captures the same conversations with ``--backend hf`` and ``--backend vllm`` (bf16 both), alternating the two
``--repeats`` times, and prints one JSON line: per backend the median tok/s of the capture itself (the engine's
start-up excluded, its wall time reported separately), the spread, and the store's bytes per token. Without
``--conversations`` it writes ``--n`` chat conversations from draftsmith's tiny Markov corpus. Run it on a quiet
machine: two backends sharing busy cores measure the neighbours.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _conversations(path: Path, n: int) -> Path:
    from draftsmith.testing.models import tiny_chat_corpus

    with open(path, "w") as f:
        for i, c in enumerate(tiny_chat_corpus(n, seed=7)):
            f.write(json.dumps({"id": f"b{i}", "messages": c}) + "\n")
    return path


def _run(backend: str, args, conv: Path, out: Path) -> dict:
    cmd = [sys.executable, "-m", "draftsmith.cli", "capture", "--target", args.target, "--conversations", str(conv),
           "--out", str(out), "--dtype", "bfloat16", "--draft-vocab-size", "0", "--no-progress", "--json",
           "--batch-size", str(args.batch_size)]
    if backend == "vllm":
        cmd += ["--backend", "vllm", "--vllm-python", args.vllm_python, "--max-num-seqs", str(args.max_num_seqs)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{backend} capture failed:\n{proc.stderr[-3000:]}")
    rep = json.loads(proc.stdout)
    return {"tok_s": rep["tokens_per_s"], "bytes_per_token": rep["bytes_per_token"], "wall_s": round(wall, 1),
            "tokens": rep["tokens"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--conversations", type=Path, default=None)
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-capture-"))
    try:
        conv = args.conversations or _conversations(work / "conv.jsonl", args.n)
        runs: dict[str, list[dict]] = {"hf": [], "vllm": []}
        for r in range(args.repeats):
            for backend in ("hf", "vllm") if r % 2 == 0 else ("vllm", "hf"):
                out = work / f"{backend}-{r}"
                runs[backend].append(_run(backend, args, conv, out))
                shutil.rmtree(out, ignore_errors=True)
        summary = {}
        for backend, rs in runs.items():
            tps = [x["tok_s"] for x in rs]
            summary[backend] = {"median_tok_s": statistics.median(tps), "min_tok_s": min(tps), "max_tok_s": max(tps),
                                "bytes_per_token": rs[0]["bytes_per_token"], "tokens": rs[0]["tokens"],
                                "median_wall_s": statistics.median(x["wall_s"] for x in rs)}
        summary["speedup"] = round(summary["vllm"]["median_tok_s"] / max(summary["hf"]["median_tok_s"], 1e-9), 2)
        print(json.dumps(summary))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
