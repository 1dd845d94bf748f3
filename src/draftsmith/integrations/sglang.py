"""SGLang, run in its own environment (``--sglang-python``), as ``serve`` runs vLLM: a server process launched with
``python -m sglang.launch_server``, greedy requests to its native ``/generate`` endpoint as token ids, and its
own speculative counters from each response's ``meta_info``.

SGLang's fields (sgl-project/sglang, ``tokenizer_manager.py``; its tests compute the acceptance length as
``completion_tokens / spec_verify_ct``): ``completion_tokens``, ``spec_verify_ct`` (verify passes of a speculative
server; absent on a plain one), and in newer releases ``spec_num_correct_drafts`` / ``spec_accepted_drafts`` (draft
tokens accepted). Top log-probabilities come back as ``meta_info.output_top_logprobs``: per position a list of
``[log-prob, token id, text]``. Not run against a real SGLang here: it needs a GPU build (sglang-kernel is CUDA);
tested against a stand-in server module (tests/test_check_sglang.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.processes import child_options

ACCEPTED_KEYS = ("spec_num_correct_drafts", "spec_accepted_drafts", "spec_accept_token_num")


class SglangError(DraftsmithError, RuntimeError):
    """SGLang's server did not start, died, or answered something unreadable: the message quotes it."""


def launch_argv(python: str | Path, target: str, port: int, *, drafter: str | Path | None = None, k: int = 3,
                dtype: str = "auto", extra: list[str] | None = None) -> list[str]:
    """The server's command line: plain, or EAGLE-3 chains of ``k`` (top-k 1, k + 1 tokens verified a pass)."""
    argv = [str(python), "-m", "sglang.launch_server", "--model-path", str(target), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", dtype, "--skip-server-warmup"]
    if drafter is not None:
        argv += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(drafter),
                 "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
                 "--speculative-num-draft-tokens", str(k + 1)]
    return argv + list(extra or [])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SglangServer:
    """One server process; ``with`` stops it (terminate, then kill) whatever happens inside."""

    def __init__(self, argv: list[str], port: int, *, startup_s: float = 900.0, request_s: float = 600.0):
        self.argv, self.port, self.startup_s, self.request_s = argv, port, startup_s, request_s
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self._log = None

    def __enter__(self) -> SglangServer:
        import tempfile

        self._log = tempfile.TemporaryFile(mode="w+")
        env = {**os.environ}
        env.pop("PYTHONPATH", None)  # SGLang's environment, not ours
        # its own process group (SGLang starts scheduler and detokenizer processes: stopped together), and a
        # SIGTERM to it when draftsmith dies, kill -9 included (core/processes.py)
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, **child_options())
        try:
            self._wait_healthy()
        except BaseException:  # a server that never came up is stopped too, and its log closed
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SglangError(f"SGLang's server exited at start (exit {self.proc.returncode}): {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise SglangError(f"SGLang's server did not answer /health in {self.startup_s:.0f} s: {self.tail()}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(timeout=30)
        if self._log is not None:
            self._log.close()
            self._log = None

    def _signal(self, sig: int) -> None:
        """The server's whole process group (its own session: the group id is its pid)."""
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            self.proc.send_signal(sig)

    def tail(self, lines: int = 4) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0)
        kept = [x.strip() for x in self._log.read().splitlines() if x.strip()]
        return " | ".join(kept[-lines:])

    def get(self, path: str) -> dict:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as r:
                return json.loads(r.read() or b"{}")
        except (urllib.error.URLError, OSError, ValueError):
            return {}

    def generate(self, ids: list[int], max_new_tokens: int, top_logprobs: int = 0) -> dict:
        """One greedy request as token ids; SGLang's response (output_ids, meta_info)."""
        body = {"input_ids": [int(t) for t in ids],
                "sampling_params": {"temperature": 0.0, "max_new_tokens": int(max_new_tokens)}}
        if top_logprobs:
            body |= {"return_logprob": True, "top_logprobs_num": int(top_logprobs), "logprob_start_len": len(ids)}
        req = urllib.request.Request(self.url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.request_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise SglangError(f"SGLang refused the request (HTTP {e.code}): {e.read()[:300]!r}") from None
        except (urllib.error.URLError, OSError) as e:
            raise SglangError(f"SGLang did not answer ({e}); its log: {self.tail()}") from None


def counters(meta: dict) -> tuple[int, int]:
    """(accepted draft tokens, verify passes) of one response; the first token comes from prefill."""
    passes = int(meta.get("spec_verify_ct") or 0)
    done = int(meta.get("completion_tokens") or 0)
    accepted = next((int(meta[k]) for k in ACCEPTED_KEYS if meta.get(k) is not None), None)
    if accepted is None:  # older releases: only the passes; every pass emits its accepted drafts and one more
        accepted = max(done - 1 - passes, 0)
    return accepted, max(passes, 1)


def top_logprobs(meta: dict) -> list[list[list[float]]]:
    """``output_top_logprobs`` as ``[position] -> [[id, log-prob], ...]`` best first."""
    out = []
    for pos in meta.get("output_top_logprobs") or []:
        out.append([[int(t[1]), float(t[0])] for t in (pos or []) if t is not None and t[0] is not None])
    return out


__all__ = ["SglangError", "SglangServer", "counters", "free_port", "launch_argv", "top_logprobs"]
