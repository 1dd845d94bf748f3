"""The demo's llama.cpp stage: the drafter measured in the engine CPU users run, after the PyTorch bench.

Optional by nature: it runs only when ``xllamacpp`` is installed (nothing is said otherwise), and a target that
llama.cpp cannot load, or a run that fails, costs one line, never the demo. It runs ``bench --engine llamacpp``
in a child process, since an unsupported target aborts llama.cpp at its first decode (the whole process), and
rerunning the demo reuses its report.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

from draftsmith.core.errors import UsageError

#: A short run: prompts of each bench set at most (the preset's bench may take more).
LLAMACPP_PROMPTS = 4
#: Seconds the llama.cpp bench may take before the demo gives up on it (a hang must not hold the demo).
LLAMACPP_TIMEOUT_S = 1800
REPORT = "bench-llamacpp.json"


def gguf_export_command(target: str, drafter: Path, out: Path) -> str:
    """The command that writes the drafter's GGUF for llama.cpp's --model-draft."""
    return shlex.join(["draftsmith", "export", "--drafter", str(drafter), "--format", "gguf", "--target",
                       str(target), "--out", str(out)])


def engine_ks(k: int) -> list[int]:
    """EAGLE-3 draft lengths the stage measures: 1 and the preset's chain k. In llama.cpp a round's fixed costs
    grow with k, so on a small target k=1 can pay where the chain k does not (docs/llamacpp.md)."""
    return sorted({1, k})


def bench_command(target: str, drafter: Path, datasets: tuple[str, ...], limit: int, tokens: int, k: int,
                  threads: int, out: Path, progress: bool) -> list[str]:
    """``bench --engine llamacpp``: plain, EAGLE-3 at k=1 and the chain ``k``, and n-gram lookup at ``k`` (whose
    verify passes the profile splits an EAGLE-3 round with), first turns only."""
    return [sys.executable, "-m", "draftsmith.cli", "bench", "--engine", "llamacpp", "--target", str(target),
            "--drafter", str(drafter), "--datasets", ",".join(datasets), "--limit", str(min(limit, LLAMACPP_PROMPTS)),
            "--turns", "1", "--max-new-tokens", str(tokens), "--draft-max", ",".join(map(str, engine_ks(k))),
            "--prompt-lookup", str(k),
            "--threads", str(threads), "--out", str(out), *([] if progress else ["--no-progress"])]


def run_llamacpp_stage(target: str, drafter: Path, datasets: tuple[str, ...], limit: int, tokens: int, k: int,
                       work: Path, threads: int = 1, progress: bool = True, enabled: bool = True) -> dict | None:
    """Measure the drafter in llama.cpp; return what the summary records.

    None: not asked for (``--no-llamacpp``) or xllamacpp is not installed, and nothing is printed. Else a dict
    with ``k`` and the GGUF export command, and either ``report`` (the bench report's path) or ``skipped`` (why
    not, also printed as one line)."""
    from draftsmith.app.bench_llamacpp import llamacpp_target
    from draftsmith.integrations.llamacpp import available

    if not enabled or not available():
        return None
    out = work / "bench-llamacpp"
    print(f"\n== llama.cpp: plain, EAGLE-3 k={','.join(map(str, engine_ks(k)))}, n-gram k={k} in the engine CPU "
          "users run ==", file=sys.stderr, flush=True)
    try:
        target_gguf = llamacpp_target(target)
    except UsageError as e:
        return _skipped(str(e), k, None)
    export = gguf_export_command(target, drafter, work / "export" / "gguf" / "drafter.gguf")
    done = {"k": k, "export_command": export, "target_gguf": str(target_gguf)}
    if (out / REPORT).is_file():
        print(f"already measured in llama.cpp: {out / REPORT}", file=sys.stderr)
        return {**done, "report": str(out / REPORT)}
    cmd = bench_command(target, drafter, datasets, limit, tokens, k, threads, out, progress)
    try:
        run = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             timeout=LLAMACPP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return _skipped(f"bench --engine llamacpp took over {LLAMACPP_TIMEOUT_S // 60} min", k, export)
    if run.returncode != 0 or not (out / REPORT).is_file():
        out.mkdir(parents=True, exist_ok=True)
        (out / "llamacpp.log").write_text(run.stderr or "")
        last = next((line for line in reversed((run.stderr or "").splitlines()) if line.strip()), "no output")
        return _skipped(f"bench --engine llamacpp failed (exit {run.returncode}): {last.strip()} "
                        f"(log: {out / 'llamacpp.log'})", k, export)
    return {**done, "report": str(out / REPORT)}


def _skipped(reason: str, k: int, export: str | None) -> dict:
    print(f"llama.cpp not measured: {reason}", file=sys.stderr)
    return {"k": k, "export_command": export, "skipped": reason}


def read_llamacpp_report(outcome: dict | None) -> dict | None:
    """The llama.cpp bench report the stage wrote, or None (not run, skipped, unreadable)."""
    if not outcome or "report" not in outcome:
        return None
    try:
        return json.loads(Path(outcome["report"]).read_text())
    except (OSError, ValueError):
        return None
