"""``check --engine sglang`` against a stand-in SGLang server module (testing/fake_sglang.py): the launch flags, the
counters read from each response's meta_info, plain's top-2, a server that dies at start. SGLang itself is not
installed here (it needs a GPU build); these tests are all that ran."""

from __future__ import annotations

import json

import pytest

from draftsmith.integrations.sglang import counters, top_logprobs
from draftsmith.stages.check.engines import run_sglang
from draftsmith.testing.fake_sglang import write_fake_sglang

PROMPTS = [[1, 2, 3], [4, 5]]


def _fake(tmp_path, monkeypatch, **over):
    py = write_fake_sglang(tmp_path / "env")
    spec = {"outputs": {"1,2,3": list(range(10, 42)), "4,5": list(range(20, 52))}, "verify_per_token": 0.25,
            "log": str(tmp_path / "launches.jsonl"), **over}
    (tmp_path / "fake.json").write_text(json.dumps(spec))
    monkeypatch.setenv("FAKE_SGLANG", str(tmp_path / "fake.json"))
    return py


def _launches(tmp_path) -> list[list[str]]:
    return [json.loads(line) for line in (tmp_path / "launches.jsonl").read_text().splitlines()]


def test_plain_then_eagle3_server_and_their_counters(tmp_path, monkeypatch):
    py = _fake(tmp_path, monkeypatch)
    out = run_sglang(py, "org/target", tmp_path / "drafter", PROMPTS, 3, 32, startup_s=60)
    plain, spec = _launches(tmp_path)
    assert "--speculative-algorithm" not in plain and plain[plain.index("--model-path") + 1] == "org/target"
    flags = {spec[i]: spec[i + 1] for i in range(len(spec) - 1) if spec[i].startswith("--")}
    assert flags["--speculative-algorithm"] == "EAGLE3"
    assert flags["--speculative-draft-model-path"] == str(tmp_path / "drafter")
    assert (flags["--speculative-num-steps"], flags["--speculative-eagle-topk"],
            flags["--speculative-num-draft-tokens"]) == ("3", "1", "4")
    assert out.version == "0.0.fake" and out.plain.error is None and out.spec.error is None
    assert out.plain.token_ids == out.spec.token_ids == [list(range(10, 42)), list(range(20, 52))]
    # 32 tokens in 8 verify passes: the first from prefill, 31 - 8 = 23 accepted drafts per prompt
    assert (out.spec.passes, out.spec.accepted, out.spec.per_prompt) == (16, 46, [23, 23])
    assert out.spec.tau == pytest.approx(1 + 46 / 16)
    assert out.plain.top[0][0] == [[10, -0.01], [11, -5.0]]


def test_a_server_that_dies_at_start_is_the_engines_refusal_in_its_words(tmp_path, monkeypatch):
    py = _fake(tmp_path, monkeypatch, die_speculative=True)
    out = run_sglang(py, "org/target", tmp_path / "drafter", PROMPTS, 3, 32, startup_s=60)
    assert out.plain.error is None and len(out.plain.token_ids) == 2
    assert "exited at start (exit 3)" in out.spec.error and "cannot load the draft model" in out.spec.error


def test_newer_sglang_counts_accepted_drafts_itself():
    assert counters({"completion_tokens": 32, "spec_verify_ct": 8}) == (23, 8)
    assert counters({"completion_tokens": 32, "spec_verify_ct": 8, "spec_num_correct_drafts": 24}) == (24, 8)
    assert top_logprobs({"output_top_logprobs": [[[-0.1, 7, "a"], [-0.3, 9, "b"]], None]}) == [[[7, -0.1], [9, -0.3]],
                                                                                               []]


def test_cli_sglang_needs_its_python(tmp_path, capsys):
    from draftsmith.cli import main

    args = ["check", "--engine", "sglang", "--target", str(tmp_path), "--drafter", str(tmp_path)]
    assert main(args) == 2
    assert main([*args, "--sglang-python", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "--sglang-python" in err and "Traceback" not in err


def test_a_server_that_never_answers_is_stopped(tmp_path, monkeypatch):
    import os

    py = _fake(tmp_path, monkeypatch, hang=True)
    out = run_sglang(py, "org/target", tmp_path / "drafter", PROMPTS, 3, 32, startup_s=1)
    assert "did not answer /health in 1 s" in out.plain.error and "did not answer" in out.spec.error
    pids = tmp_path / "launches.jsonl.pids"
    for pid in (pids.read_text().split() if pids.exists() else []):
        with pytest.raises(ProcessLookupError):  # stopped and reaped, not left running
            os.kill(int(pid), 0)
