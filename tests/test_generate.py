"""`draftsmith generate`: prompts in, target-answered conversations out; resumable, counted, two backends.

The local backend runs a tiny random Llama (saved with a ChatML tokenizer and loaded through
`load_target`, as users do); the OpenAI backend runs against a fake OpenAI-compatible server started
here on 127.0.0.1, which scripts rejections, transient failures and reasoning output.
"""

from __future__ import annotations

import gzip
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from draftsmith.cli import main
from draftsmith.data.chat import read_jsonl
from draftsmith.model.target import Target, load_target
from draftsmith.stages.generate import run as generate_run
from draftsmith.stages.generate.backends import LocalBackend, _Sampling
from draftsmith.stages.generate.config import GenerateConfig, GenerateError, errors_path
from draftsmith.stages.generate.jobs import plan_turns
from draftsmith.stages.generate.output import _Progress
from draftsmith.stages.generate.run import generate
from draftsmith.testing.models import build_tiny_model
from draftsmith.testing.tokenizer import make_tokenizer

MAX_NEW = 6


# --------------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama whose vocabulary matches a ChatML tokenizer, saved like a real model."""
    tok = make_tokenizer("chatml")
    # head_scale 4: flat next-token distributions, so sampled questions vary (the chatty fixture relies on it)
    model = build_tiny_model("llama", vocab_size=len(tok), num_hidden_layers=4, bos_token_id=tok.bos_token_id,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, head_scale=4.0)
    d = tmp_path_factory.mktemp("tiny-chatml")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def target(model_dir) -> Target:
    return load_target(model_dir, dtype=torch.float64)


class _EosBias(torch.nn.Module):
    """Output head that favours end-of-turn, so the random model writes short questions and answers."""

    def __init__(self, head: torch.nn.Module, eos: int, bias: float) -> None:
        super().__init__()
        self.head = head
        self.eos = eos
        self.bias = bias

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(x)
        out[..., self.eos] += self.bias
        return out


@pytest.fixture(scope="module")
def chatty(model_dir) -> Target:
    """The same target, but it ends turns after a few tokens (a stand-in for a trained chat model)."""
    t = load_target(model_dir, dtype=torch.float64)
    # The random head's logits have a std of ~0.7 over ~500 tokens: +5 makes end-of-turn ~20% per sampled step.
    t.model.lm_head = _EosBias(t.model.lm_head, t.tokenizer.eos_token_id, bias=5.0)
    return t


def _write_jsonl(path: Path, rows: list) -> Path:
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def _records(path: Path) -> dict[str, dict]:
    recs = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    by_id = {r["id"]: r for r in recs}
    assert len(by_id) == len(recs), "an id was written twice"
    return by_id


def _cfg(tmp_path: Path, **kw) -> GenerateConfig:
    kw.setdefault("out", tmp_path / "out.jsonl")
    kw.setdefault("max_new_tokens", MAX_NEW)
    kw.setdefault("batch_size", 3)
    kw.setdefault("progress", False)
    return GenerateConfig(**kw)


def _check_counts(summary, lines: int) -> None:
    assert summary.done + summary.error + summary.skipped == summary.total == lines


PROMPTS = [
    {"prompt": "What is the capital of France?"},
    {"prompt": "Write a short poem about the sea."},
    {"prompt": "Hello! How can I help you today?"},
    {"prompt": "Python is a programming language; def main(): return 42"},
    {"prompt": "Let me think step by step about this problem."},
]


# --------------------------------------------------------------------------------------------------------
# planning turns


def test_plan_turns_keeps_users_and_marks_assistant_turns():
    msgs = [
        {"role": "assistant", "content": "greeting with nothing to answer"},
        {"role": "system", "content": "S"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "assistant", "content": "a1 again"},
        {"role": "user", "content": "u2"},
        {"role": "user", "content": "u2b"},
        {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "u3"},
    ]
    assert plan_turns(msgs) == [
        [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"}],
        [{"role": "user", "content": "u2"}, {"role": "user", "content": "u2b"}],
        [{"role": "user", "content": "u3"}],
    ]
    assert plan_turns([{"role": "assistant", "content": "a"}]) == []
    with_sys = plan_turns([{"role": "user", "content": "q"}], system="be brief")
    assert with_sys == [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}]]


# --------------------------------------------------------------------------------------------------------
# local backend


def test_three_input_shapes(tmp_path, target):
    inp = _write_jsonl(tmp_path / "in.jsonl", [
        {"id": "sg", "conversations": [{"from": "human", "value": "What is the capital of France?"},
                                       {"from": "gpt", "value": "ORIGINAL ANSWER"}]},
        {"messages": [{"role": "user", "content": "Write a short poem about the sea."}]},
        {"prompt": "Hello! How can I help you today?"},
    ])
    s = generate(_cfg(tmp_path, input=inp), target=target)
    assert (s.new, s.already, s.error, s.skipped) == (3, 0, 0, 0)
    _check_counts(s, 3)
    assert str(s) == "done 3 (new 3, already 0) error 0 skipped 0 total 3"
    recs = _records(s.out)
    assert "sg" in recs
    by_line = {r["source_line"]: r for r in recs.values()}
    assert set(by_line) == {1, 2, 3}
    users = {1: "What is the capital of France?", 2: "Write a short poem about the sea.",
             3: "Hello! How can I help you today?"}
    for line, rec in by_line.items():
        msgs = rec["messages"]
        assert [m["role"] for m in msgs] == ["user", "assistant"]
        assert msgs[0]["content"] == users[line]
        assert msgs[1]["content"] != "ORIGINAL ANSWER"
        assert rec["backend"] == "local"
        assert 1 <= rec["num_generated_tokens"] <= MAX_NEW
    assert s.generated_tokens == sum(r["num_generated_tokens"] for r in recs.values())
    # ids are stable: a second read of the input gives the same ids, and chat.py reads the output back
    again = [c.id for _, c in read_jsonl(inp)]
    assert set(again) == set(recs)
    assert all(not isinstance(c, Exception) for _, c in read_jsonl(s.out))
    assert not errors_path(s.out).exists()


def test_multi_turn_regenerates_each_assistant_turn_in_order(tmp_path, target):
    conv = {"id": "mt", "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "OLD ONE"},
        {"role": "user", "content": "And of the sea?"},
        {"role": "assistant", "content": "OLD TWO"},
    ]}
    inp = _write_jsonl(tmp_path / "in.jsonl", [conv])
    s = generate(_cfg(tmp_path, input=inp), target=target)
    assert s.new == 1
    msgs = _records(s.out)["mt"]["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert [msgs[i]["content"] for i in (0, 1, 3)] == [conv["messages"][i]["content"] for i in (0, 1, 3)]
    assert "OLD" not in msgs[2]["content"] + msgs[4]["content"]
    # each turn is exactly the target's greedy answer to the conversation so far (with regenerated turns)
    backend = LocalBackend(target)
    tok = target.tokenizer
    for k in (2, 4):
        ids = tok.apply_chat_template(msgs[:k], tokenize=False, add_generation_prompt=True)
        prompt = tok(ids, add_special_tokens=False)["input_ids"]
        (gen, reason), = backend.generate_ids([prompt], _Sampling(MAX_NEW, 0.0, 1.0), [0])
        assert backend._text(gen, reason) == msgs[k]["content"]


def test_max_turns_answers_only_the_first_turns(tmp_path, target):
    conv = {"id": "mt", "messages": [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "OLD ONE"},
        {"role": "user", "content": "And of the sea?"},
        {"role": "assistant", "content": "OLD TWO"},
    ]}
    inp = _write_jsonl(tmp_path / "in.jsonl", [conv])
    first = generate(_cfg(tmp_path, input=inp, max_turns=1, out=tmp_path / "one.jsonl"), target=target)
    both = generate(_cfg(tmp_path, input=inp, out=tmp_path / "all.jsonl"), target=target)
    one, full = _records(first.out)["mt"]["messages"], _records(both.out)["mt"]["messages"]
    assert [m["role"] for m in one] == ["user", "assistant"]
    assert one == full[:2]
    with pytest.raises(GenerateError, match="--max-turns must be >= 1"):
        _cfg(tmp_path, input=inp, max_turns=0).validate()


def test_batched_generation_matches_one_by_one(tmp_path, target):
    """Left padding must not leak into attention: every row equals its unbatched generation."""
    backend = LocalBackend(target, batch_size=8)
    tok = target.tokenizer
    prompts = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in PROMPTS]
    sampling = _Sampling(8, 0.0, 1.0)
    batched = backend.generate_ids(prompts, sampling, [0] * len(prompts))
    for p, b in zip(prompts, batched, strict=True):
        assert backend.generate_ids([p], sampling, [0])[0] == b
    # sampling uses one generator per row: a row's draw does not depend on its batch neighbours
    sampling = _Sampling(8, 1.0, 0.9)
    together = backend.generate_ids(prompts[:3], sampling, [11, 12, 13])
    alone = backend.generate_ids(prompts[1:2], sampling, [12])
    assert together[1] == alone[0]


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.7), (5, 0.8)])
def test_local_sampler_draws_the_target_distribution(target, top_k, top_p):
    """The question sampler keeps only top-k/top-p candidates; its draws must follow decode's reference."""
    from draftsmith.stages.decode import SamplingParams, logits_to_probs

    backend = LocalBackend(target)
    logits = torch.tensor([2.0, -3.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0], dtype=torch.float64)
    n = 20000
    picks = backend._pick(logits.expand(n, -1), _Sampling(1, 0.8, top_p, top_k),
                          [torch.Generator().manual_seed(i) for i in range(n)])
    freq = torch.bincount(torch.tensor(picks), minlength=len(logits)).double() / n
    want = logits_to_probs(logits[None], SamplingParams(temperature=0.8, top_p=top_p, top_k=top_k))[0].double()
    assert (freq[want == 0] == 0).all()  # nothing outside top-k / the nucleus is ever drawn
    assert ((freq - want).abs() <= 4 * (want * (1 - want) / n).sqrt() + 1e-12).all()


def test_resume_after_partial_run_and_crash_mid_line(tmp_path, target):
    inp = _write_jsonl(tmp_path / "in.jsonl", PROMPTS)
    full = generate(_cfg(tmp_path, input=inp, out=tmp_path / "full.jsonl"), target=target)
    assert full.new == 5
    reference = _records(full.out)

    # a run that was killed: two records written, the third torn mid-line
    out = tmp_path / "out.jsonl"
    lines = full.out.read_text(encoding="utf-8").splitlines(keepends=True)
    out.write_text(lines[0] + lines[1] + lines[2][: len(lines[2]) // 2], encoding="utf-8")
    s = generate(_cfg(tmp_path, input=inp, out=out), target=target)
    assert (s.new, s.already, s.error, s.skipped) == (3, 2, 0, 0)
    _check_counts(s, 5)
    assert _records(out) == reference  # greedy: the resumed file holds exactly what one run writes

    # rerunning a finished job generates nothing
    s = generate(_cfg(tmp_path, input=inp, out=out), target=target)
    assert (s.new, s.already) == (0, 5)
    assert _records(out) == reference


def test_progress_bar_counts_records_as_written(tmp_path, target, monkeypatch, capsys):
    """A batched backend writes a whole round at once: the bar shows every record, its ETA the average rate.

    Reported as `1/800 [09:24<125:13:57]` with 256 on disk: tqdm drew only a round's first record, then sat
    on it while the next round ran, and took its rate from one conversation per round.
    """
    bars = []

    class Recorded(_Progress):
        def __init__(self, total: int, enabled: bool) -> None:
            super().__init__(total, enabled)
            bars.append(self.bar)

    monkeypatch.setattr(generate_run, "_Progress", Recorded)
    out = tmp_path / "out.jsonl"
    stderr: list[str] = []
    rounds: list[tuple[int, int, int, float]] = []  # on disk, last count drawn, bar count, rate of its ETA
    real = LocalBackend.generate_ids

    def slow_round(self, prompts, sampling, seeds):
        stderr.append(capsys.readouterr().err)
        drawn = re.findall(r"(\d+)/\d+ \[", "".join(stderr))
        fd = bars[-1].format_dict
        rate = fd["rate"] or (fd["n"] - fd["initial"]) / fd["elapsed"]  # what tqdm's ETA divides by
        on_disk = len(out.read_text(encoding="utf-8").splitlines()) if out.exists() else 0
        rounds.append((on_disk, int(drawn[-1]), fd["n"], rate * fd["elapsed"]))
        time.sleep(0.2)  # a round takes longer than tqdm's 0.1 s between draws
        return real(self, prompts, sampling, seeds)

    monkeypatch.setattr(LocalBackend, "generate_ids", slow_round)
    inp = _write_jsonl(tmp_path / "in.jsonl", PROMPTS)
    s = generate(_cfg(tmp_path, input=inp, out=out, batch_size=3, progress=True), target=target)
    assert s.new == 5
    # round 2 starts with round 1's three records on disk: drawn, counted, and the rate is 3 per elapsed time
    assert rounds[1][:3] == (3, 3, 3)
    assert rounds[1][3] == pytest.approx(3)
    stderr.append(capsys.readouterr().err)
    assert bars[-1].n == 5 and re.findall(r"(\d+)/\d+ \[", "".join(stderr))[-1] == "5"

    # resumed: lines an earlier run finished advance the bar but not the rate the ETA comes from
    rounds.clear()
    stderr.clear()
    more = [*PROMPTS, {"prompt": "Name a colour."}, {"prompt": "Count to three."}]
    s = generate(_cfg(tmp_path, input=_write_jsonl(tmp_path / "in.jsonl", more), out=out, progress=True),
                 target=target)
    assert (s.new, s.already) == (2, 5)
    assert rounds[0][2:] == (5, 0)


def test_counts_add_up_with_bad_empty_and_duplicate_lines(tmp_path, target):
    inp = _write_jsonl(tmp_path / "in.jsonl", [
        PROMPTS[0],
        "{not json",
        {"messages": []},
        "",
        {"messages": [{"role": "assistant", "content": "a reply to nobody"}]},
        PROMPTS[0],
        {"weird": 1},
        PROMPTS[1],
    ])
    s = generate(_cfg(tmp_path, input=inp), target=target)
    _check_counts(s, 7)  # the blank line is not an input line
    assert (s.new, s.error, s.skipped) == (2, 2, 3)
    assert s.skip_reasons == {"empty conversation": 1, "no user turn": 1, "duplicate id": 1}
    errs = [json.loads(x) for x in errors_path(s.out).read_text().splitlines()]
    assert [e["line"] for e in errs] == [2, 7]
    assert "invalid JSON" in errs[0]["reason"] and "unknown record shape" in errs[1]["reason"]
    assert s.errors_file == errors_path(s.out)

    # errors are retried (and fail again), finished lines are not regenerated
    s = generate(_cfg(tmp_path, input=inp), target=target)
    _check_counts(s, 7)
    assert (s.new, s.already, s.error, s.skipped) == (0, 2, 2, 3)
    assert len(errors_path(s.out).read_text().splitlines()) == 2


def test_empty_or_all_invalid_input_is_an_error(tmp_path, target, model_dir, capsys):
    """Issue 19.7: nothing usable in the input is exit 2 naming the count and the first bad lines, not exit 0."""
    empty = _write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(GenerateError, match=r"empty\.jsonl: no usable conversation in 0 lines"):
        generate(_cfg(tmp_path, input=empty), target=target)
    bad = _write_jsonl(tmp_path / "convs.jsonl", [
        "{not json", {"messages": []}, {"weird": 1}, "", {"messages": [{"role": "assistant", "content": "hi"}]},
    ])
    with pytest.raises(GenerateError) as info:
        generate(_cfg(tmp_path, input=bad), target=target)
    msg = str(info.value)
    assert msg.startswith("convs.jsonl: no usable conversation in 4 lines (line 1: invalid JSON") or \
        msg.startswith(f"{bad}: no usable conversation in 4 lines (line 1: invalid JSON"), msg
    assert "line 2: no messages" in msg and "line 3: unknown record shape" in msg and "..." in msg
    assert "\n" not in msg
    out = tmp_path / "out.jsonl"
    assert not out.exists() and not errors_path(out).exists()

    rc = main(["generate", "--input", str(bad), "--out", str(out), "--target", str(model_dir), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("draftsmith: error: ") and "no usable conversation in 4 lines" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err

    # every line finished by an earlier run is usable: a resumed run with nothing left to do is fine
    ok = _write_jsonl(tmp_path / "ok.jsonl", [PROMPTS[0], "{not json"])
    assert generate(_cfg(tmp_path, input=ok), target=target).new == 1
    s = generate(_cfg(tmp_path, input=ok), target=target)
    assert (s.new, s.already, s.error) == (0, 1, 1)


def test_max_input_length(tmp_path, target):
    long_q = "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and symbols " * 4
    inp = _write_jsonl(tmp_path / "in.jsonl", [
        {"id": "short", "prompt": "Hi?"},
        {"id": "long", "prompt": long_q},
        {"id": "later", "messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "x"},
                                     {"role": "user", "content": long_q}]},
    ])
    s = generate(_cfg(tmp_path, input=inp, max_input_length=100), target=target)
    _check_counts(s, 3)
    assert (s.new, s.error) == (2, 1)
    err = json.loads(errors_path(s.out).read_text())
    assert err["id"] == "long" and err["line"] == 2 and "more than the limit of 100" in err["reason"]
    later = _records(s.out)["later"]
    assert later["truncated"] is True
    assert [m["role"] for m in later["messages"]] == ["user", "assistant"]


def test_self_prompt_is_deterministic_for_a_seed(tmp_path, chatty):
    # answers are sampled too (greedy would always pick the favoured end-of-turn): seeded per turn as well
    kw = dict(self_prompt=5, question_max_new_tokens=24, question_min_chars=3, batch_size=2, temperature=1.0,
              top_p=0.95)
    a = generate(_cfg(tmp_path, out=tmp_path / "a.jsonl", seed=7, **kw), target=chatty)
    b = generate(_cfg(tmp_path, out=tmp_path / "b.jsonl", seed=7, **kw), target=chatty)
    c = generate(_cfg(tmp_path, out=tmp_path / "c.jsonl", seed=8, **kw), target=chatty)
    for s in (a, b, c):
        _check_counts(s, 5)
        assert s.new == 5, s
    ra, rb, rc = _records(a.out), _records(b.out), _records(c.out)
    assert set(ra) == {f"self-7-{i}" for i in range(5)}
    assert ra == rb
    questions = [r["messages"][0]["content"] for r in ra.values()]
    assert all(r["messages"][0]["role"] == "user" and r["messages"][1]["role"] == "assistant" for r in ra.values())
    assert len({" ".join(q.lower().split()) for q in questions}) == 5  # deduplicated
    assert all(len(q.strip()) >= 3 for q in questions)
    assert questions != [r["messages"][0]["content"] for r in rc.values()]

    # resume: drop two records; the rerun regenerates exactly them
    lines = a.out.read_text(encoding="utf-8").splitlines(keepends=True)
    a.out.write_text("".join(lines[:3]), encoding="utf-8")
    s = generate(_cfg(tmp_path, out=a.out, seed=7, **kw), target=chatty)
    assert (s.new, s.already) == (2, 3)
    assert _records(a.out) == rb


def test_self_prompt_gives_up_with_a_counted_error(tmp_path, target):
    """The plain random model never ends its question: each index becomes an error, not a hang."""
    s = generate(_cfg(tmp_path, self_prompt=2, question_max_new_tokens=4, question_attempts=2), target=target)
    _check_counts(s, 2)
    assert s.error == 2
    reasons = [json.loads(x)["reason"] for x in errors_path(s.out).read_text().splitlines()]
    assert all("no usable self-prompted question after 2 attempt(s)" in r for r in reasons)


# --------------------------------------------------------------------------------------------------------
# the OpenAI-compatible backend against a fake server


class _FakeState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[tuple[int, str, dict | None]] = []  # (port, path, body)
        self.flaky_failures = 1


def _handler(state: _FakeState):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep pytest output clean
            pass

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            port = self.server.server_address[1]
            with state.lock:
                state.requests.append((port, self.path, None))
            if self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
            else:
                self._send(404, {"error": {"message": "not found"}})

        def do_POST(self) -> None:
            port = self.server.server_address[1]
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with state.lock:
                state.requests.append((port, self.path, body))
            if self.path == "/v1/completions":
                q = f"Question number {body['seed'] % 1000} about the sea?"
                self._send(200, {"id": "c", "object": "text_completion", "model": body["model"],
                                 "choices": [{"index": 0, "text": q + "<|im_end|>", "finish_reason": "stop"}],
                                 "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}})
                return
            if self.path != "/v1/chat/completions":
                self._send(404, {"error": {"message": "not found"}})
                return
            last = body["messages"][-1]["content"]
            if "REJECT" in last:  # what vLLM answers for a prompt over max_model_len
                self._send(400, {"object": "error", "type": "BadRequestError", "param": None, "code": 400,
                                 "message": "This model's maximum context length is 16 tokens."})
                return
            if "FLAKY" in last:
                with state.lock:
                    fail = state.flaky_failures > 0
                    state.flaky_failures -= 1
                if fail:
                    self._send(503, {"error": {"message": "overloaded", "code": 503}})
                    return
            message = {"role": "assistant", "content": f"answer {len(body['messages'])}: {last}"}
            if "THINK" in last:
                message["reasoning_content"] = "let me think"
            self._send(200, {
                "id": "x", "object": "chat.completion", "model": body["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13},
            })

    return Handler


@pytest.fixture
def fake_servers():
    state = _FakeState()
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _handler(state)) for _ in range(2)]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for t in threads:
        t.start()
    urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    yield urls, state
    for s in servers:
        s.shutdown()
        s.server_close()


def _openai_cfg(tmp_path: Path, urls: list[str], **kw) -> GenerateConfig:
    return _cfg(tmp_path, backend="openai", server_urls=urls, concurrency=4, retries=3, retry_backoff=0.01,
                timeout=10, **kw)


def test_openai_backend(tmp_path, fake_servers):
    urls, state = fake_servers
    inp = _write_jsonl(tmp_path / "in.jsonl", [
        {"id": "plain", "prompt": "hello"},
        {"id": "reject", "prompt": "REJECT me"},
        {"id": "flaky", "prompt": "FLAKY one"},
        {"id": "think", "prompt": "THINK first"},
        {"id": "multi", "conversations": [{"from": "human", "value": "u1"}, {"from": "gpt", "value": "old"},
                                          {"from": "human", "value": "u2"}]},
        {"id": "p6", "prompt": "six"},
    ])
    s = generate(_openai_cfg(tmp_path, [urls[0] + "/v1/", urls[1]], input=inp))
    _check_counts(s, 6)
    assert (s.new, s.error, s.skipped) == (5, 1, 0)
    recs = _records(s.out)

    # a 400 is a counted error with the server's reason, and it is not retried
    err = json.loads(errors_path(s.out).read_text())
    assert err["id"] == "reject" and err["line"] == 2
    assert "HTTP 400" in err["reason"] and "maximum context length" in err["reason"]
    chat_posts = [(p, b) for p, path, b in state.requests if path == "/v1/chat/completions"]
    assert sum("REJECT" in b["messages"][-1]["content"] for _, b in chat_posts) == 1
    # a 503 is retried and then succeeds
    assert sum("FLAKY" in b["messages"][-1]["content"] for _, b in chat_posts) == 2
    assert recs["flaky"]["messages"][-1]["content"] == "answer 1: FLAKY one"
    # reasoning is kept: stored as a field, folded into <think> by chat.py downstream
    think = recs["think"]["messages"][-1]
    assert think["reasoning_content"] == "let me think" and think["content"] == "answer 1: THINK first"
    folded = {c.id: c for _, c in read_jsonl(s.out)}
    assert folded["think"].messages[-1]["content"] == "<think>\nlet me think\n</think>\n\nanswer 1: THINK first"
    # multi-turn: the second request carries the regenerated first answer
    assert [m["content"] for m in recs["multi"]["messages"]] == ["u1", "answer 1: u1", "u2", "answer 3: u2"]
    # protocol: model from /v1/models, standard fields only; both servers served requests
    for _, body in chat_posts:
        assert body["model"] == "fake-model"
        assert set(body) <= {"model", "messages", "max_tokens", "temperature", "top_p", "seed", "stream"}
        assert body["max_tokens"] == MAX_NEW and body["temperature"] == 0.0
    assert {p for p, _ in chat_posts} == {int(u.rsplit(":", 1)[1]) for u in urls}
    assert all(r["backend"] == "openai" and r["model"] == "fake-model" for r in recs.values())
    assert recs["plain"]["num_generated_tokens"] == 3 and recs["multi"]["num_generated_tokens"] == 6

    # resume: only the rejected one is tried again
    before = len(state.requests)
    s = generate(_openai_cfg(tmp_path, urls, input=inp, served_model_name="fake-model"))
    assert (s.new, s.already, s.error) == (0, 5, 1)
    assert len(state.requests) - before == 1


def test_openai_dead_server(tmp_path):
    import socket

    with socket.socket() as sock:  # a port with nothing listening
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    inp = _write_jsonl(tmp_path / "in.jsonl", PROMPTS[:2])
    with pytest.raises(GenerateError, match="cannot list the served models"):
        generate(_openai_cfg(tmp_path, [dead], input=inp))
    s = generate(_openai_cfg(tmp_path, [dead], input=inp, served_model_name="m"))
    _check_counts(s, 2)
    assert s.error == 2
    assert "failed after 4 attempts" in errors_path(s.out).read_text()


def test_openai_self_prompt(tmp_path, fake_servers, model_dir):
    urls, state = fake_servers
    kw = dict(self_prompt=3, seed=5, tokenizer=model_dir)
    a = generate(_openai_cfg(tmp_path, urls, out=tmp_path / "a.jsonl", **kw))
    b = generate(_openai_cfg(tmp_path, urls, out=tmp_path / "b.jsonl", **kw))
    assert a.new == b.new == 3
    assert _records(a.out) == _records(b.out)
    comp = [body for _, path, body in state.requests if path == "/v1/completions"]
    tok = make_tokenizer("chatml")
    prefix = tok("<|im_start|>system\n", add_special_tokens=False)["input_ids"]
    assert all(isinstance(c["prompt"], list) and c["prompt"][: len(prefix)] == prefix for c in comp)
    q = _records(a.out)["self-5-0"]["messages"]
    assert q[0]["role"] == "user" and q[0]["content"].startswith("Question number")
    assert "<|im_end|>" not in q[0]["content"]
    with pytest.raises(GenerateError, match="--tokenizer"):
        generate(_openai_cfg(tmp_path, urls, self_prompt=2))


# --------------------------------------------------------------------------------------------------------
# CLI


def test_cli(tmp_path, model_dir, capsys):
    inp = tmp_path / "in.jsonl.gz"
    with gzip.open(inp, "wt", encoding="utf-8") as fh:
        fh.write(json.dumps(PROMPTS[0]) + "\n" + json.dumps({"messages": []}) + "\n")
    out = tmp_path / "o" / "conv.jsonl"
    rc = main(["generate", "--input", str(inp), "--out", str(out), "--target", str(model_dir),
               "--max-new-tokens", "3", "--no-progress"])
    assert rc == 0
    assert "done 1 (new 1, already 0) error 0 skipped 1 total 2" in capsys.readouterr().out
    assert len(_records(out)) == 1

    rc = main(["generate", "--input", str(tmp_path / "missing.jsonl"), "--out", str(out)])
    assert rc == 2 and "missing.jsonl" in capsys.readouterr().err
    rc = main(["generate", "--input", str(inp), "--out", str(out), "--backend", "openai"])
    assert rc == 2 and "--server-url" in capsys.readouterr().err
    rc = main(["generate", "--self-prompt", "0", "--out", str(out)])
    assert rc == 2 and "--self-prompt must be >= 1" in capsys.readouterr().err
    rc = main(["generate", "--input", str(inp), "--out", str(out), "--backend", "vllm"])
    assert rc == 2 and "--vllm-python" in capsys.readouterr().err
    rc = main(["generate", "--input", str(inp), "--out", str(out), "--backend", "vllm",
               "--vllm-python", str(tmp_path / "no-python")])
    assert rc == 2 and "no-python" in capsys.readouterr().err


def test_vllm_backend_worker_that_dies_is_a_clear_error(tmp_path, model_dir):
    """A vLLM that cannot start (wrong venv, no memory) ends the run with its status and log tail, nothing
    written; the real engine is exercised by the slow suite (tests/test_vllm_engine.py)."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'ImportError: No module named vllm' >&2\nexit 3\n")
    fake.chmod(0o755)
    out = tmp_path / "conv.jsonl"
    inp = _write_jsonl(tmp_path / "in.jsonl", PROMPTS[:2])
    with pytest.raises(GenerateError, match=r"(?s)status 3 .*No module named vllm"):
        generate(GenerateConfig(out=out, input=inp, target=str(model_dir), backend="vllm", vllm_python=str(fake),
                                progress=False))
    assert not out.exists() or out.read_text() == ""


def test_json_array_input_with_limit_drops_evaluation_prompts(tmp_path, target, monkeypatch):
    """A truncated ShareGPT-style JSON array is read object by object; evaluation prompts are never generated."""
    import draftsmith.stages.generate.run as run_mod

    convs = [{"id": f"sg{i}", "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "OLD"}]}
             for i, q in enumerate(["Name a colour.", "EVAL question?", "Count to three.", "Say hi."])]
    text = json.dumps(convs)
    inp = tmp_path / "sharegpt.json"
    inp.write_text(text[: text.rindex('{"id"') + 10])  # the last object is cut off, as in the packaged file
    monkeypatch.setattr(run_mod, "evaluation_keys", lambda: {"eval question?"})
    s = generate(_cfg(tmp_path, input=inp, limit=2), target=target)
    assert (s.new, s.skipped, s.total) == (1, 1, 2)  # the first two objects: one generated, one dropped
    assert set(_records(s.out)) == {"sg0"}
    s = generate(_cfg(tmp_path, input=inp), target=target)  # all three complete objects, resumed
    assert (s.already, s.new, s.skipped, s.total) == (1, 1, 1, 3)
    assert set(_records(s.out)) == {"sg0", "sg2"}
