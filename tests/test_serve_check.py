"""Issue 52, ``serve --check``: the served acceptance read from a vLLM-like server's /metrics and compared with the
drafter's card; a collapse is flagged within the first 16 requests, and ``--check strict`` stops the server.

The server here is a stand-in on 127.0.0.1 that speaks the four endpoints the check uses (health, models, chat
completions, Prometheus metrics) and counts drafts like vLLM; the real vLLM run is test_check_engines.py (slow).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from draftsmith.app import serve as serve_mod
from draftsmith.app.serve_check import MAX_REQUESTS, check_server


class FakeVllm:
    """Each chat request drafts ``drafts`` times and accepts ``accepted`` tokens in all (vLLM's counters)."""

    def __init__(self, drafts: int, accepted: int, port: int = 0):
        self.drafts, self.accepted, self.requests = drafts, accepted, 0
        self.counters = {"drafts": 0, "accepted": 0}
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, body: bytes, ctype="application/json"):
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/health":
                    self._send(b"")
                elif self.path == "/v1/models":
                    self._send(json.dumps({"data": [{"id": "target"}]}).encode())
                elif self.path == "/metrics":
                    c = fake.counters
                    text = (f'# TYPE vllm:spec_decode_num_drafts_total counter\n'
                            f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="t"}} {c["drafts"]}.0\n'
                            f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="t"}} '
                            f'{c["accepted"]}.0\n')
                    self._send(text.encode(), "text/plain")

            def do_POST(self):
                n = int(self.headers["Content-Length"])
                body = json.loads(self.rfile.read(n))
                assert body["temperature"] == 0.0 and body["messages"][0]["role"] == "user"
                fake.requests += 1
                fake.counters["drafts"] += fake.drafts
                fake.counters["accepted"] += fake.accepted
                self._send(json.dumps({"choices": [{"message": {"content": "x"}}]}).encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_collapse_flagged_within_16_requests():
    fake = FakeVllm(drafts=10, accepted=1)  # tau 1.1, the card expects 3.0
    try:
        r = check_server(f"http://127.0.0.1:{fake.port}", expected=3.0)
    finally:
        fake.close()
    assert r.verdict == "silent collapse" and r.requests <= MAX_REQUESTS == 16
    assert abs(r.tau - 1.1) < 1e-9 and "SILENT COLLAPSE" in r.line()


def test_served_as_trained_passes():
    fake = FakeVllm(drafts=10, accepted=19)  # tau 2.9 against 3.0
    try:
        r = check_server(f"http://127.0.0.1:{fake.port}", expected=3.0)
    finally:
        fake.close()
    assert r.verdict == "pass"


@pytest.mark.parametrize("mode, code", [("strict", 1), ("on", 0)])
def test_serve_check_strict_stops_the_server(tmp_path, monkeypatch, capsys, mode, code):
    """serve launches the server, checks it once it answers, and under strict stops it on a collapse."""
    from types import SimpleNamespace

    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "drafter_card.json").write_text(json.dumps(
        {"schema": "draftsmith-card/1", "expected_acceptance": {"by_k": {"3": 3.0}}}))
    state = {}

    class Proc:
        def __init__(self, cmd):
            state["cmd"] = cmd
            port = int(cmd[cmd.index("--port") + 1])
            state["fake"] = FakeVllm(drafts=10, accepted=1, port=port)
            self.stopped = False

        def poll(self):
            return 0 if self.stopped else None

        def terminate(self):
            self.stopped = True
            state["terminated"] = True
            state["fake"].close()

        def wait(self, timeout=None):
            if not self.stopped:  # "on": the server keeps running until the user stops it; here it exits
                self.terminate()
            return 0

        def kill(self):
            self.stopped = True

    monkeypatch.setattr(serve_mod, "diagnose", lambda *a, **k: SimpleNamespace(blocking=False, summary=lambda: "ok"))
    monkeypatch.setattr(serve_mod, "_launch", Proc)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fake_bin = tmp_path / "vllm"
    fake_bin.write_text("#!/bin/sh\nexit 0\n")  # never run: _launch is the stand-in
    fake_bin.chmod(0o755)  # serve checks that --vllm-bin is an executable before anything else
    rc = serve_mod.serve(str(tmp_path / "target"), str(tmp_path / "drafter"), 3, port=port, check=mode,
                         vllm_bin=str(fake_bin))
    err = capsys.readouterr().err
    assert rc == code and "SILENT COLLAPSE" in err
    assert state["fake"].requests <= 16
