"""The demo's llama.cpp stage (app/demo_llamacpp.py) and its summary line (app/demo_summary.py), without an engine."""

from __future__ import annotations

import json
import subprocess

import pytest

from draftsmith.app import demo_llamacpp
from draftsmith.app.bench_llamacpp import EngineStats, round_profile
from draftsmith.app.cli import parse_args
from draftsmith.app.demo_llamacpp import bench_command, run_llamacpp_stage
from draftsmith.app.demo_summary import llamacpp_lines, llamacpp_numbers, summary_text
from draftsmith.integrations.llamacpp import EngineRun

K = 2


def llamacpp_report(eagle_ms: float, accepted: int, ngram_ms: float = 95.0) -> dict:
    """A report as run_llamacpp_bench writes it: 11 tokens per method; plain at 10 ms a pass."""
    stats = {"plain": EngineStats(), f"eagle3 k={K}": EngineStats(), f"ngram k={K}": EngineStats()}
    stats["plain"].add(EngineRun("", 11, 100.0, 1.0))
    stats[f"eagle3 k={K}"].add(EngineRun("", 11, eagle_ms, 1.0, draft_n=2 * (10 - accepted), draft_n_accepted=accepted))
    stats[f"ngram k={K}"].add(EngineRun("", 11, ngram_ms, 1.0, draft_n=4, draft_n_accepted=1))
    rows = {name: s.to_dict() for name, s in stats.items()}
    for row in rows.values():
        row["speedup"] = round(row["tokens_per_second"] / rows["plain"]["tokens_per_second"], 3)
    return {"engine": "llamacpp", "target": "t.gguf", "threads": 1, "max_new_tokens": 10,
            "results": [{"dataset": "mt-bench", "prompts": 1, "methods": rows, "profile": round_profile(rows, [K])}]}


def outcome(report: dict) -> dict:
    return {"k": K, "report": "w/bench-llamacpp/bench-llamacpp.json", "target_gguf": "t.gguf",
            "export_command": "draftsmith export --drafter w/run/best --format gguf --target smollm2 "
                              "--out w/export/gguf/drafter.gguf", **llamacpp_numbers(report, K)}


def test_the_line_says_eagle3_does_not_pay_and_the_tau_it_would_need():
    # 5 passes of 30 ms for 10 tokens (tau 2): 150 ms against plain's 100 ms; a round costs 3 plain steps
    lines = llamacpp_lines(outcome(llamacpp_report(150.0, 5)))
    assert lines[0] == ("llama.cpp (CPU engine users run): plain 110.0 tok/s, EAGLE-3 k=2 73.3 tok/s (tau 2.00), "
                        "n-gram 115.8 tok/s — does not pay here (0.67x plain; a round costs 3.00 plain steps, so it "
                        "pays above tau 3.00)")
    assert lines[1].endswith("draftsmith export --drafter w/run/best --format gguf --target smollm2 "
                             "--out w/export/gguf/drafter.gguf")
    assert parse_args(lines[1].split(": ", 1)[1].split()[1:]).format == "gguf"


def test_the_line_says_eagle3_pays_and_when_ngram_is_faster_still():
    pays = llamacpp_lines(outcome(llamacpp_report(60.0, 5)))[0]
    assert "EAGLE-3 k=2 183.3 tok/s (tau 2.00)" in pays and pays.endswith("— pays here (1.67x plain)")
    beaten = llamacpp_lines(outcome(llamacpp_report(80.0, 5, ngram_ms=50.0)))[0]
    assert beaten.endswith("— pays here (1.25x plain; n-gram lookup is faster, with no drafter)")


def test_the_line_reports_the_fastest_k_measured():
    # k=1 at 60 ms for 11 tokens beats the chain k=2's 150 ms: the line is k=1's, the n-gram row stays k=2's
    report = llamacpp_report(150.0, 5)
    one = EngineStats()
    one.add(EngineRun("", 11, 60.0, 1.0, draft_n=8, draft_n_accepted=2))
    methods = report["results"][0]["methods"]
    methods["eagle3 k=1"] = {**one.to_dict(), "speedup": round(one.to_dict()["tokens_per_second"]
                                                               / methods["plain"]["tokens_per_second"], 3)}
    numbers = llamacpp_numbers(report, K)
    assert numbers["k"] == 1 and numbers["pays"]
    assert numbers["ngram_tok_s"] == methods[f"ngram k={K}"]["tokens_per_second"]
    line = llamacpp_lines({**outcome(report), **numbers})[0]
    assert "EAGLE-3 k=1 183.3 tok/s" in line and "pays here (1.67x plain" in line
    assert llamacpp_numbers(llamacpp_report(150.0, 5), K)["k"] == K  # one k measured: that one


def test_the_summary_prints_the_line_only_where_llama_cpp_was_measured_or_skipped():
    bench = {"results": [{"dataset": "mt-bench", "methods": {"plain": {"speedup": 1.0, "acceptance_length": 1.0},
                                                             "eagle3 chain k=2": {"speedup": 0.7,
                                                                                  "acceptance_length": 1.4}}}]}
    result = {"target": "smollm2", "drafter": "w/run/best", "export": "w/export/vllm", "workdir": "w",
              "settings": {"chain": 2}, "vllm_serve": "vllm serve m", "seconds": {"total": 60.0},
              "seconds_all_sessions": {"total": 60.0, "sessions": 1}}
    assert "llama.cpp (CPU" not in summary_text({**result, "llamacpp": None}, bench, "TABLE")
    text = summary_text({**result, "llamacpp": outcome(llamacpp_report(150.0, 5))}, bench, "TABLE")
    assert "llama.cpp (CPU engine users run): plain 110.0 tok/s" in text
    skipped = summary_text({**result, "llamacpp": {"k": 2, "export_command": None, "skipped": "no GGUF"}}, bench, "T")
    assert "llama.cpp (CPU engine users run): not measured: no GGUF" in skipped


def never_run(*args, **kwargs):
    raise AssertionError("the llama.cpp bench must not run here")


def stage(tmp_path, target, enabled=True):
    return run_llamacpp_stage(str(target), tmp_path / "run" / "best", ("mt-bench",), 8, 32, K, tmp_path,
                              enabled=enabled, progress=False)


def test_without_xllamacpp_or_with_no_llamacpp_nothing_runs_and_nothing_is_said(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo_llamacpp.subprocess, "run", never_run)
    gguf = tmp_path / "t.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr("draftsmith.integrations.llamacpp.available", lambda: False)
    assert stage(tmp_path, gguf) is None
    monkeypatch.setattr("draftsmith.integrations.llamacpp.available", lambda: True)
    assert stage(tmp_path, gguf, enabled=False) is None
    assert capsys.readouterr().err == "" and not (tmp_path / "bench-llamacpp").exists()


def test_a_target_llama_cpp_cannot_load_is_skipped_with_the_reason(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("draftsmith.integrations.llamacpp.available", lambda: True)
    monkeypatch.setattr(demo_llamacpp.subprocess, "run", never_run)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text("{}")
    got = stage(tmp_path, tmp_path / "tiny")
    assert "needs the target's .gguf" in got["skipped"] and "report" not in got
    assert "llama.cpp not measured:" in capsys.readouterr().err
    assert llamacpp_lines(got)[0].startswith("llama.cpp (CPU engine users run): not measured: ")


def test_a_failed_llama_cpp_run_is_one_line_and_the_demo_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("draftsmith.integrations.llamacpp.available", lambda: True)
    gguf = tmp_path / "t.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(demo_llamacpp.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 2, stderr="llama log\ndraftsmith: error: architecture qwen2 is not a llama.cpp EAGLE-3 target\n"))
    got = stage(tmp_path, gguf)
    assert "exit 2" in got["skipped"] and "qwen2 is not a llama.cpp EAGLE-3 target" in got["skipped"]
    assert "llama log" in (tmp_path / "bench-llamacpp" / "llamacpp.log").read_text()
    assert got["export_command"].endswith(f"--target {gguf} --out {tmp_path / 'export' / 'gguf' / 'drafter.gguf'}")


def test_a_rerun_reads_the_report_it_wrote(tmp_path, monkeypatch):
    monkeypatch.setattr("draftsmith.integrations.llamacpp.available", lambda: True)
    monkeypatch.setattr(demo_llamacpp.subprocess, "run", never_run)
    gguf = tmp_path / "t.gguf"
    gguf.write_bytes(b"GGUF")
    (tmp_path / "bench-llamacpp").mkdir()
    (tmp_path / "bench-llamacpp" / "bench-llamacpp.json").write_text(json.dumps(llamacpp_report(150.0, 5)))
    got = stage(tmp_path, gguf)
    assert got["report"] == str(tmp_path / "bench-llamacpp" / "bench-llamacpp.json") and "skipped" not in got
    assert demo_llamacpp.read_llamacpp_report(got)["results"][0]["methods"]["plain"]["tokens"] == 11


def test_the_bench_it_runs_is_a_short_bench_engine_llamacpp_command(tmp_path):
    cmd = bench_command("smollm2", tmp_path / "best", ("mt-bench", "humaneval"), 20, 192, 5, 2, tmp_path, False)
    assert cmd[1:4] == ["-m", "draftsmith.cli", "bench"]
    args = parse_args(cmd[3:])
    assert (args.engine, args.draft_max, args.prompt_lookup, args.turns) == ("llamacpp", "1,5", "5", 1)
    assert args.limit == demo_llamacpp.LLAMACPP_PROMPTS and args.datasets == "mt-bench,humaneval"
    assert args.threads == 2 and args.max_new_tokens == 192 and args.progress is False


@pytest.mark.parametrize("argv, want", [(["demo"], True), (["demo", "--no-llamacpp"], False)])
def test_demo_no_llamacpp_parses(argv, want):
    assert parse_args(argv).llamacpp is want
