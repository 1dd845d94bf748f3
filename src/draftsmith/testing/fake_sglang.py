"""A stand-in for SGLang's server (``python -m sglang.launch_server``), for tests of ``check --engine sglang`` on a
machine without SGLang: the same flags, ``/health``, ``/get_server_info`` and ``/generate`` with token ids, and
SGLang's ``meta_info`` fields (``completion_tokens``, ``spec_verify_ct``, ``output_top_logprobs``).

``write_fake_sglang(dir)`` writes a package ``sglang`` whose ``launch_server`` runs this, and a ``python`` script
that puts it on the path (SGLang's "own environment"). What the fake serves is read from a JSON file named by
$FAKE_SGLANG: ``outputs`` (prompt ids joined by commas -> output ids), ``verify_per_token`` (speculative verify
passes per generated token after the first), ``die_speculative`` (exit at start when drafting, with a message),
``hang`` (never answer), ``log`` (a file each launch appends its argv to; its pid goes to ``log``.pids).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def serve(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--speculative-algorithm")
    ap.add_argument("--speculative-draft-model-path")
    ap.add_argument("--speculative-num-steps", type=int)
    ap.add_argument("--speculative-eagle-topk", type=int)
    ap.add_argument("--speculative-num-draft-tokens", type=int)
    args, _ = ap.parse_known_args(argv)
    spec = json.loads(Path(os.environ["FAKE_SGLANG"]).read_text())
    with open(spec["log"], "a") as f:
        f.write(json.dumps(argv) + "\n")
    with open(spec["log"] + ".pids", "a") as f:
        f.write(f"{os.getpid()}\n")
    drafting = args.speculative_algorithm is not None
    if spec.get("hang"):  # never answers: a server stuck loading
        import time

        time.sleep(3600)
    if drafting and spec.get("die_speculative"):
        print("RuntimeError: fake SGLang cannot load the draft model", file=sys.stderr)
        return 3

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, obj: dict) -> None:
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._send({"version": "0.0.fake"} if self.path == "/get_server_info" else {})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert body["sampling_params"]["temperature"] == 0.0
            out = spec["outputs"][",".join(map(str, body["input_ids"]))][: body["sampling_params"]["max_new_tokens"]]
            meta = {"completion_tokens": len(out)}
            if drafting:
                meta["spec_verify_ct"] = max(round((len(out) - 1) * spec["verify_per_token"]), 1)
            if body.get("return_logprob"):
                meta["output_top_logprobs"] = [[[-0.01, t, None], [-5.0, (t + 1) % 50, None]] for t in out]
            self._send({"text": "", "output_ids": out, "meta_info": meta})

    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
    return 0


def write_fake_sglang(root: str | Path) -> Path:
    """A ``python`` (a script that runs this interpreter with the fake ``sglang`` package on its path); returns it."""
    root = Path(root)
    pkg = root / "site" / "sglang"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text("import sys\nfrom draftsmith.testing.fake_sglang import serve\n"
                                          "sys.exit(serve(sys.argv[1:]))\n")
    src = Path(__file__).resolve().parents[2]
    py = root / "python"
    py.write_text(f"#!/bin/sh\nPYTHONPATH={root / 'site'}:{src} exec {sys.executable} \"$@\"\n")
    py.chmod(0o755)
    return py
