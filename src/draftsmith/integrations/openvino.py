"""OpenVINO GenAI, run in its own environment (``make openvino-env`` builds ``.venv-openvino``), as ``serve`` runs
vLLM in its: conversion with optimum-intel's ``optimum-cli export openvino``, decoding with ``openvino_worker``.

Its torch/transformers pins need not match draftsmith's own environment, so nothing here imports openvino: each
call is a subprocess with a timeout, and the engine's refusal comes back as one line quoting its own words.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.processes import child_options

ENV_VAR = "DRAFTSMITH_OPENVINO_PYTHON"
VENV_DIR = ".venv-openvino"
SRC_DIR = Path(__file__).resolve().parents[2]  # .../src: put first on the worker's path (this checkout's sources)


class OpenVinoError(DraftsmithError, RuntimeError):
    """OpenVINO's environment is missing, or the engine refused or failed: the message quotes it."""


def openvino_python(explicit: str | Path | None = None) -> Path:
    """The Python of OpenVINO's environment: ``explicit``, else $DRAFTSMITH_OPENVINO_PYTHON, else the checkout's or
    the working directory's ``.venv-openvino``."""
    if explicit and not Path(explicit).is_file():  # asked for: not silently another environment
        raise OpenVinoError(f"--openvino-python {explicit}: no such Python; OpenVINO's environment is not installed "
                            "there (make openvino-env builds .venv-openvino)")
    candidates = [explicit, os.environ.get(ENV_VAR), SRC_DIR.parent / VENV_DIR / "bin" / "python",
                  Path.cwd() / VENV_DIR / "bin" / "python"]
    for c in candidates:
        if c and Path(c).is_file():
            return Path(c)
    raise OpenVinoError(f"OpenVINO's environment is not installed: run `make openvino-env` (builds {VENV_DIR}) or "
                        f"set {ENV_VAR} to a Python with openvino-genai and optimum-intel")


def available() -> bool:
    try:
        openvino_python()
    except OpenVinoError:
        return False
    return True


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC_DIR), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _tail(text: str, lines: int = 3) -> str:
    kept = [x.strip() for x in text.strip().splitlines() if x.strip()]
    return " | ".join(kept[-lines:])


def optimum_export(src: str | Path, out: str | Path, *, weight_format: str = "fp32", python: str | Path | None = None,
                   timeout: float = 3600) -> None:
    """``optimum-cli export openvino -m SRC OUT --task text-generation-with-past --trust-remote-code``."""
    py = openvino_python(python)
    cli = py.parent / "optimum-cli"
    cmd = [str(cli), "export", "openvino", "-m", str(src), str(out), "--task", "text-generation-with-past",
           "--trust-remote-code", "--weight-format", weight_format]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), **child_options())
    except subprocess.TimeoutExpired as e:
        raise OpenVinoError(f"optimum-cli export openvino did not finish in {timeout:.0f} s") from e
    if proc.returncode != 0 or not (Path(out) / "openvino_model.xml").is_file():
        raise OpenVinoError(f"optimum-cli export openvino failed (exit {proc.returncode}): "
                            f"{_tail(proc.stderr or proc.stdout)}")


def run_worker(request: dict, *, python: str | Path | None = None, timeout: float = 3600,
               progress: bool = False) -> dict:
    """One request to ``openvino_worker`` in OpenVINO's environment; its answer, or OpenVinoError with its words."""
    py = openvino_python(python)
    with tempfile.TemporaryDirectory(prefix="draftsmith-ov-") as tmp:
        req, resp = Path(tmp) / "request.json", Path(tmp) / "response.json"
        req.write_text(json.dumps(request))
        try:
            proc = subprocess.run([str(py), "-m", "draftsmith.integrations.openvino_worker", str(req), str(resp)],
                                  stdout=subprocess.PIPE, stderr=None if progress else subprocess.PIPE, text=True,
                                  timeout=timeout, env=_env(), **child_options())
        except subprocess.TimeoutExpired as e:
            raise OpenVinoError(f"OpenVINO GenAI did not answer in {timeout:.0f} s") from e
        if not resp.is_file():
            raise OpenVinoError(f"OpenVINO's worker died (exit {proc.returncode}): {_tail(proc.stderr or '')}")
        answer = json.loads(resp.read_text())
    if "error" in answer:
        raise OpenVinoError(f"OpenVINO GenAI: {answer['error']}")
    return answer


__all__ = ["OpenVinoError", "available", "openvino_python", "optimum_export", "run_worker"]
