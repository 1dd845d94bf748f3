"""The ``openai`` backend: any OpenAI-compatible server over plain HTTP, with retries and a thread pool."""

from __future__ import annotations

import ipaddress
import itertools
import json
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from draftsmith.stages.generate.backends import _assistant_message, _finish, _prompt_ids, _Sampling
from draftsmith.stages.generate.config import GenerateError, ServerError
from draftsmith.stages.generate.jobs import _derive_seed, _Job, _Outcome, _Reply


def _is_loopback(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _base_url(url: str) -> str:
    """Accept http://host:port, .../ and .../v1 alike; requests go to <base>/v1/..."""
    url = url.strip().rstrip("/")
    if not urllib.parse.urlsplit(url).scheme:
        url = "http://" + url
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _server_message(body: bytes) -> str:
    """The error text of an OpenAI-style error body (both vLLM's flat and OpenAI's nested shape)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body[:300].decode("utf-8", "replace").strip()
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:500]
        if isinstance(err, str):
            return err[:500]
    return json.dumps(data)[:300]


class OpenAIBackend:
    """Any OpenAI-compatible server (vLLM, SGLang): one thread per in-flight conversation, URLs round-robin.

    Speaks only the documented protocol: ``GET /v1/models``, ``POST /v1/chat/completions`` for answers
    and ``POST /v1/completions`` with a token-id prompt for self-prompted questions (token ids, so the
    server adds no second BOS to a prefix the chat template already opened). Connection errors, timeouts,
    429 and 5xx are retried with exponential backoff on the next URL; other 4xx (a prompt longer than the
    server's max model length) fail the conversation at once.
    """

    name = "openai"

    def __init__(self, urls: Sequence[str], *, model: str | None = None, tokenizer: Any = None,
                 api_key: str | None = None, concurrency: int = 16, timeout: float = 600.0, retries: int = 5,
                 retry_backoff: float = 1.0, max_input_length: int | None = None) -> None:
        self.urls = [_base_url(u) for u in urls]
        if not self.urls:
            raise GenerateError("the openai backend needs at least one server URL")
        self.tokenizer = tokenizer
        self.api_key = api_key
        self.concurrency = concurrency
        self.timeout = timeout
        self.retries = retries
        self.retry_backoff = retry_backoff
        self.max_input_length = max_input_length
        self._counter = itertools.count()
        self._lock = threading.Lock()
        self._tok_lock = threading.Lock()  # a fast tokenizer shared by threads can raise "Already borrowed"
        self._direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._proxied = urllib.request.build_opener()
        self.requests_per_url: Counter = Counter()
        self.model_name = model or self._discover_model()

    # --- HTTP --------------------------------------------------------------------------------------
    def _next_url(self) -> str:
        with self._lock:
            return self.urls[next(self._counter) % len(self.urls)]

    def _once(self, base: str, path: str, payload: dict | None) -> dict:
        headers = {"Accept": "application/json"}
        data = None
        if payload is not None:
            data = json.dumps(payload).encode("utf-8")
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(base + path, data=data, headers=headers,
                                     method="POST" if payload is not None else "GET")
        opener = self._direct if _is_loopback(base) else self._proxied
        with opener.open(req, timeout=self.timeout) as resp:
            body = resp.read()
        with self._lock:
            self.requests_per_url[base] += 1
        return json.loads(body)

    def request(self, path: str, payload: dict | None = None) -> dict:
        """One call with retries; raises ServerError when rejected or out of retries."""
        last = "no attempt"
        for attempt in range(self.retries + 1):
            base = self._next_url()
            delay = self.retry_backoff * (2**attempt)
            try:
                return self._once(base, path, payload)
            except urllib.error.HTTPError as exc:
                body = exc.read() if exc.fp is not None else b""
                last = f"{base}{path}: HTTP {exc.code}: {_server_message(body)}"
                if exc.code != 429 and exc.code != 408 and exc.code < 500:
                    raise ServerError(f"server rejected the request: {last}", exc.code) from None
                after = exc.headers.get("Retry-After") if exc.headers else None
                if after and after.strip().isdigit():
                    delay = max(delay, min(float(after), 60.0))
            except (urllib.error.URLError, OSError, ValueError) as exc:  # refused, reset, timeout, bad JSON
                reason = getattr(exc, "reason", exc)
                last = f"{base}{path}: {type(exc).__name__}: {reason}"
            if attempt < self.retries:
                time.sleep(delay * (0.75 + 0.5 * random.random()))
        raise ServerError(f"failed after {self.retries + 1} attempts: {last}")

    def _discover_model(self) -> str:
        try:
            data = self.request("/v1/models")
        except ServerError as exc:
            raise GenerateError(f"cannot list the served models (pass --served-model-name?): {exc}") from None
        models = data.get("data") if isinstance(data, dict) else None
        if not models or not isinstance(models[0], dict) or "id" not in models[0]:
            raise GenerateError(f"{self.urls[0]}/v1/models lists no model; pass --served-model-name")
        return str(models[0]["id"])

    # --- protocol ------------------------------------------------------------------------------------
    def chat(self, history: list[dict[str, str]], sampling: _Sampling, seed: int) -> _Reply:
        payload: dict[str, Any] = {
            "model": self.model_name,
            "messages": [{"role": m["role"], "content": m["content"]} for m in history],
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "stream": False,
        }
        if sampling.temperature > 0:
            payload["top_p"] = sampling.top_p
            payload["seed"] = seed
            if sampling.top_k > 0:
                payload["top_k"] = sampling.top_k  # not OpenAI's; vLLM and SGLang accept it
        data = self.request("/v1/chat/completions", payload)
        try:
            choice = data["choices"][0]
            message = choice["message"]
        except (KeyError, IndexError, TypeError):
            raise ServerError(f"malformed chat completion response: {json.dumps(data)[:300]}") from None
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        usage = data.get("usage") or {}
        return _Reply(
            content=message.get("content") or "",
            reasoning=reasoning if isinstance(reasoning, str) and reasoning else None,
            finish_reason=choice.get("finish_reason"),
            num_tokens=usage.get("completion_tokens"),
        )

    def _complete(self, prompt_ids: list[int], sampling: _Sampling, seed: int,
                  stop_texts: Sequence[str]) -> _Reply:
        payload: dict[str, Any] = {
            "model": self.model_name,
            "prompt": prompt_ids,
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": seed,
            "stop": list(stop_texts)[:4],  # OpenAI allows up to 4
        }
        if sampling.top_k > 0:
            payload["top_k"] = sampling.top_k
        data = self.request("/v1/completions", payload)
        try:
            choice = data["choices"][0]
            text = choice["text"] or ""
        except (KeyError, IndexError, TypeError):
            raise ServerError(f"malformed completion response: {json.dumps(data)[:300]}") from None
        for stop in stop_texts:
            i = text.find(stop)
            if i >= 0:
                text = text[:i]
        usage = data.get("usage") or {}
        return _Reply(text, finish_reason=choice.get("finish_reason"), num_tokens=usage.get("completion_tokens"))

    # --- backend interface -------------------------------------------------------------------------
    def write_questions(self, prefix_ids: list[int], seeds: list[int], sampling: _Sampling,
                        stop_texts: Sequence[str]) -> list[_Reply | Exception]:
        def one(s: int) -> _Reply | Exception:
            try:
                return self._complete(prefix_ids, sampling, s, stop_texts)
            except ServerError as exc:
                return exc

        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(seeds))) as pool:
            return list(pool.map(one, seeds))

    def _run_job(self, job: _Job, sampling: _Sampling, seed: int) -> _Outcome:
        history: list[dict[str, str]] = []
        replies: list[_Reply] = []
        for turn, segment in enumerate(job.segments):
            try:
                if self.tokenizer is not None and self.max_input_length is not None:
                    with self._tok_lock:
                        _prompt_ids(self.tokenizer, [*history, *segment], self.max_input_length, turn)
                reply = self.chat([*history, *segment], sampling, _derive_seed(seed, f"{job.id}/{turn}"))
            except Exception as exc:  # ServerError, _TurnTooLong, template errors: one conversation's failure
                if isinstance(exc, ServerError) and turn > 0:
                    exc = ServerError(f"turn {turn + 1}: {exc}", exc.status)
                return _finish(job, history, replies, exc)
            history.extend(segment)
            history.append(_assistant_message(reply))
            replies.append(reply)
        return _finish(job, history, replies, None)

    def run(self, jobs: Iterator[_Job], sampling: _Sampling, seed: int) -> Iterator[_Outcome]:
        """Keep `concurrency` conversations in flight; yield each as it completes (any order)."""
        pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="draftsmith-gen")
        pending: set[Future] = set()
        jobs = iter(jobs)
        try:
            while True:
                while len(pending) < self.concurrency:
                    job = next(jobs, None)
                    if job is None:
                        break
                    pending.add(pool.submit(self._run_job, job, sampling, seed))
                if not pending:
                    return
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    yield fut.result()
        finally:
            # On an interrupt, don't wait for requests in flight: their conversations are redone on resume.
            pool.shutdown(wait=not pending, cancel_futures=True)
