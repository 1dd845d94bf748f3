"""``serve --check``: once vLLM's server answers, send a few prompts, read its spec-decode counters from ``/metrics``
and compare the acceptance length with the drafter's card; say so loudly on a collapse (``--check strict``: stop
the server and exit 1). The check a user keeps on a GPU deployment: a drafter that loads and accepts nothing
otherwise costs throughput with no error anywhere.

Acceptance length = 1 + ``vllm:spec_decode_num_accepted_tokens_total`` / ``vllm:spec_decode_num_drafts_total``
(the counters' increase over the check's own requests). Every HTTP call has a timeout; loopback never goes
through a proxy.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

#: Requests the check sends at most, in rounds of ``ROUND``; it stops early once it has seen ``MIN_DRAFTS`` drafts.
MAX_REQUESTS, ROUND, MIN_DRAFTS = 16, 4, 32
PROMPTS = (
    "Explain how a hash table works and when you would use one.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Give me three tips for writing clear emails, with an example of each.",
    "Write a Python function that merges two sorted lists into one sorted list.",
)
DRAFTS = "vllm:spec_decode_num_drafts_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"


@dataclass
class ServedCheck:
    requests: int
    drafts: int
    accepted: int
    expected: float | None
    verdict: str  # pass, partial loss, silent collapse, unchecked

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    def line(self) -> str:
        exp = f", the card expects {self.expected:.2f}" if self.expected else ""
        head = {"silent collapse": "SILENT COLLAPSE: ", "partial loss": "PARTIAL LOSS: "}.get(self.verdict, "")
        return (f"draftsmith serve --check: {head}served acceptance length {self.tau:.2f} over {self.requests} "
                f"requests ({self.drafts} drafts){exp}: {self.verdict}")


def _opener():
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def metrics(base: str, timeout: float = 10.0) -> dict[str, float]:
    """The spec-decode counters of ``base``/metrics, summed over label sets (0 where absent)."""
    with _opener().open(f"{base}/metrics", timeout=timeout) as r:
        text = r.read().decode()
    out = {DRAFTS: 0.0, ACCEPTED: 0.0}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def wait_ready(base: str, proc=None, timeout: float = 1800.0, poll: float = 2.0) -> bool:
    """True once ``base``/health answers 200; False when the server process exits or ``timeout`` passes."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            with _opener().open(f"{base}/health", timeout=5.0) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(poll)
    return False


def _post(url: str, payload: dict, timeout: float) -> None:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with _opener().open(req, timeout=timeout) as r:
        r.read()


def _complete(base: str, model: str, prompt: str, max_tokens: int, timeout: float) -> None:
    """A greedy chat request; a server that cannot render chat (no template) gets the prompt as plain text."""
    try:
        _post(f"{base}/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": prompt}],
                                              "max_tokens": max_tokens, "temperature": 0.0}, timeout)
    except urllib.error.HTTPError as e:
        if e.code not in (400, 500):
            raise
        _post(f"{base}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                         "temperature": 0.0}, timeout)


def served_model(base: str, timeout: float = 10.0) -> str:
    with _opener().open(f"{base}/v1/models", timeout=timeout) as r:
        return json.loads(r.read())["data"][0]["id"]


def check_server(base: str, expected: float | None, *, max_tokens: int = 64, max_requests: int = MAX_REQUESTS,
                 request_timeout: float = 300.0) -> ServedCheck:
    """Send up to ``max_requests`` greedy chat requests; compare the counters' acceptance with ``expected``."""
    from draftsmith.stages.check.verdict import acceptance_verdict

    model = served_model(base)
    before = metrics(base)
    sent, delta = 0, {DRAFTS: 0.0, ACCEPTED: 0.0}
    while sent < max_requests:
        for _ in range(min(ROUND, max_requests - sent)):
            _complete(base, model, PROMPTS[sent % len(PROMPTS)], max_tokens, request_timeout)
            sent += 1
        now = metrics(base)
        delta = {k: now[k] - before[k] for k in delta}
        if delta[DRAFTS] >= MIN_DRAFTS:
            break
    check = ServedCheck(sent, int(delta[DRAFTS]), int(delta[ACCEPTED]), expected, "unchecked")
    if expected and check.drafts:
        check.verdict = acceptance_verdict(check.tau, expected, "card")
    return check


def card_expectation(drafter, k: int) -> float | None:
    """The card's acceptance length at chain k, else at the longest shorter chain it holds (a floor; None: no
    card, or none measured)."""
    from draftsmith.stages.export.card import expected_at_k, read_card

    return expected_at_k(read_card(drafter) or {}, k)[0]
