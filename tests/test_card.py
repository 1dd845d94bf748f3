"""Issue 52: every export carries a hub-ready model card (README.md) and the same facts in drafter_card.json, and
``export --push-to-hub`` uploads the folder through huggingface_hub (offline here: its HfApi methods patched)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_target

from draftsmith.cli import main
from draftsmith.core import vocab as vocab_mod
from draftsmith.model.drafter import new_drafter
from draftsmith.stages.export import export_drafter
from draftsmith.stages.export.card import (
    CARD_FILE,
    CARD_JSON,
    expected_acceptance,
    expected_by_k,
    provenance_line,
    read_card,
    set_expected,
)

ACC = [0.8, 0.6, 0.5]


def _run(tmp_path: Path) -> Path:
    """A run directory as train leaves it: config.json, metrics.jsonl, best/ with its eval.json."""
    target = tiny_target("llama", torch.float32)
    dv = vocab_mod.from_target_ids(torch.arange(10, 210, 2), target.vocab_size)
    run = tmp_path / "run"
    new_drafter(target, draft_vocab=dv).save(run / "best")
    (run / "best" / "eval.json").write_text(json.dumps({"step": 40, "loss": 1.0, "acc": ACC, "tokens": 900,
                                                        "simulated_tau": 2.0}))
    (run / "config.json").write_text(json.dumps({"target": "smollm2", "conversations": "data/conv.jsonl",
                                                 "store": None, "ttt_steps": 3, "lr": 3e-3, "eval_fraction": 0.1,
                                                 "batch_tokens": 1024}))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (10, 20, 40)))
    return run


def test_expected_by_k_is_the_chain_acceptance_length():
    assert expected_by_k(ACC) == {"1": 1.8, "2": 2.28, "3": 2.52}


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_export_writes_a_card_the_hub_parser_reads(tmp_path, fmt):
    from huggingface_hub import ModelCard
    from huggingface_hub.repocard import metadata_load

    run = _run(tmp_path)
    out = tmp_path / fmt
    export_drafter(run / "best", out, fmt, dtype="fp32", verifier="HuggingFaceTB/SmolLM2-135M-Instruct")
    card = ModelCard.load(out / CARD_FILE)
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert {"speculative-decoding", "eagle3"} <= set(card.data.tags)
    assert metadata_load(out / CARD_FILE)["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    facts = read_card(out)
    assert facts["expected_acceptance"]["by_k"] == {"1": 1.8, "2": 2.28, "3": 2.52}
    assert facts["expected_acceptance"]["held_out"] is True
    assert facts["training"]["steps"] == 40 and facts["training"]["recipe"]["lr"] == 3e-3
    assert facts["versions"]["torch"] == torch.__version__
    assert ("vllm" in facts["usage"]) and ("sglang" in facts["usage"]) == (fmt == "sglang")
    if fmt != "speculators":
        assert "--speculative-config" in facts["usage"]["vllm"]
    assert "| acceptance length | 1.80 | 2.28 | 2.52 |" in card.text


def test_card_records_where_its_expectation_came_from(tmp_path):
    """Training's held-out split is named as such (in distribution), with how many samples and at what k."""
    run = _run(tmp_path)
    (run / "best" / "eval.json").write_text(json.dumps({"step": 40, "acc": ACC, "tokens": 900, "samples": 12}))
    exp = expected_acceptance(run / "best")
    assert exp["prompts"]["count"] == 12 and exp["prompts"]["in_distribution"] and exp["k"] == len(ACC)
    assert exp["temperature"] == 0.0 and "held-out split of" in exp["prompts"]["set"]
    line = provenance_line(exp)
    assert line.startswith("Calibrated on 12 prompts of held-out split of") and "training distribution" in line
    assert f"k={len(ACC)}" in line


def test_set_expected_puts_a_calibrated_expectation_into_an_exported_card(tmp_path):
    """The demo's card promises what its calibration replayed (``shapes.chain_expectation``), not training's
    simulation, which it keeps as simulated_acceptance; README.md says where the numbers came from."""
    from draftsmith.stages.rounds import MISS, Trace
    from draftsmith.stages.shapes import Acceptance, chain_expectation

    run = _run(tmp_path)
    out = tmp_path / "export"
    export_drafter(run / "best", out, "vllm", dtype="fp32")
    ranks = [(0, 0, MISS)] * 30 + [(MISS,) * 3] * 30
    traces = (Trace(tuple(ranks), {}), Trace(tuple([(0, MISS, MISS)] * 60), {}))
    acc = Acceptance(((0.5,),) * 3, "calibration on 2 prompts",
                     traces=traces, prompts={"set": "draftsmith-mixed-v1", "count": 2, "held_out": True})
    exp = chain_expectation(acc, max_new_tokens=64)
    assert list(exp["by_k"]) == ["1", "2", "3"] and exp["prompts"]["count"] == 2 and exp["k"] == 3
    assert all(exp["by_k"][k] <= exp["by_k_point"][k] for k in exp["by_k"])
    set_expected(out, exp)
    facts = read_card(out)
    assert facts["expected_acceptance"] == exp and facts["simulated_acceptance"]["by_k"] == expected_by_k(ACC)
    readme = (out / CARD_FILE).read_text()
    assert "Calibrated on 2 prompts of draftsmith-mixed-v1 (out of the training distribution" in readme
    assert "64 new tokens each" in readme and "| point estimate |" in readme


def test_card_without_a_run_says_so_and_takes_base_model_from_the_run_or_target(tmp_path):
    from huggingface_hub import ModelCard

    run = _run(tmp_path)
    # no verifier: the run's target ('smollm2') names the base model
    export_drafter(run / "best", tmp_path / "a", "vllm", dtype="fp32")
    assert ModelCard.load(tmp_path / "a" / CARD_FILE).data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    # a drafter outside a run: no expected numbers, no training facts, and the card says it
    target = tiny_target("llama", torch.float32)
    export_drafter(new_drafter(target), tmp_path / "b", "vllm", dtype="fp32", verifier="org/base")
    facts = read_card(tmp_path / "b")
    assert facts["expected_acceptance"] is None and facts["training"] is None
    assert "Not measured at export" in (tmp_path / "b" / CARD_FILE).read_text()


def test_cli_export_license_bench_report_and_push_to_hub(tmp_path, monkeypatch, capsys):
    """--push-to-hub creates the repo and uploads the export folder, under a client with a timeout."""
    from huggingface_hub import HfApi, ModelCard, get_session

    run = _run(tmp_path)
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"results": [{"dataset": "mt-bench", "prompts": 10, "methods": {
        "plain": {"acceptance_length": 1.0, "speedup": 1.0},
        "chain 3": {"acceptance_length": 2.31, "speedup": 1.5}}}]}))
    calls = []

    def create_repo(self, repo_id, **kw):
        calls.append(("create_repo", repo_id, kw))

    def upload_folder(self, **kw):
        timeout = get_session().timeout
        calls.append(("upload_folder", kw, sorted(p.name for p in Path(kw["folder_path"]).iterdir()),
                      timeout.connect, timeout.read))
        return type("Info", (), {"commit_url": "https://hub.example/commit/1"})()

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    out = tmp_path / "export"
    assert main(["export", "--drafter", str(run / "best"), "--format", "vllm", "--out", str(out),
                 "--export-dtype", "float32", "--license", "apache-2.0", "--bench-report", str(bench),
                 "--push-to-hub", "me/my-drafter"]) == 0
    assert calls[0][:2] == ("create_repo", "me/my-drafter") and calls[0][2]["exist_ok"] is True
    name, kw, files, connect, read = calls[1]
    assert name == "upload_folder" and kw["repo_id"] == "me/my-drafter" and Path(kw["folder_path"]) == out
    assert {CARD_FILE, CARD_JSON, "config.json", "model.safetensors"} <= set(files)
    assert connect and read and connect <= read  # every upload call has a timeout
    assert get_session().timeout.read is None  # huggingface_hub's own default restored afterwards
    card = ModelCard.load(out / CARD_FILE)
    assert card.data.license == "apache-2.0"
    facts = read_card(out)
    assert facts["benchmarks"] == [{"dataset": "mt-bench", "engine": "draftsmith", "method": "chain 3",
                                    "prompts": 10, "acceptance_length": 2.31, "speedup": 1.5}]
    assert "me/my-drafter" in facts["usage"]["vllm"]  # the serve line names the repo it was pushed to
    assert "pushed" in capsys.readouterr().err


def test_push_to_hub_failure_is_one_line(tmp_path, monkeypatch, capsys):
    from huggingface_hub import HfApi

    def create_repo(self, repo_id, **kw):
        raise OSError("connection refused")

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    run = _run(tmp_path)
    code = main(["export", "--drafter", str(run / "best"), "--format", "vllm", "--out", str(tmp_path / "o"),
                 "--push-to-hub", "me/x"])
    err = capsys.readouterr().err
    assert code == 2 and "upload failed" in err and (tmp_path / "o" / CARD_FILE).is_file()
    assert main(["export", "--drafter", str(run / "best"), "--format", "vllm", "--out", str(tmp_path / "p"),
                 "--push-to-hub", "not a repo"]) == 2


@pytest.mark.slow  # decodes the calibration prompts: the slow suite
def test_card_expectation_measured_by_decoding_calibration_prompts(tmp_path):
    """export --calibrate-target: the card's expected acceptance is a decode of the mixed calibration prompts
    (training's simulated one kept beside it), its chain-5 point is exactly what that decode accepts, the promise is
    the low end of its interval, and the card says which prompts, how many, at what k and temperature."""
    from conftest import save_tiny_chat_model

    from draftsmith.model.drafter import load_drafter
    from draftsmith.model.target import load_target
    from draftsmith.stages.calibration import MIXED_SET, calibration_set
    from draftsmith.stages.check.replay import chain_tau

    save_tiny_chat_model(tmp_path / "target")
    target = load_target(str(tmp_path / "target"), dtype=torch.float32)
    run = _run(tmp_path)
    new_drafter(target).save(run / "best")  # the run's drafter, for this target
    (run / "best" / "eval.json").write_text(json.dumps({"step": 40, "acc": ACC, "tokens": 900}))
    conv = tmp_path / "conv.jsonl"
    conv.write_text("".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": f"say {i} now"},
                                                                    {"role": "assistant", "content": "ok"}]}) + "\n"
                            for i in range(40)))
    cfg = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**cfg, "conversations": str(conv), "eval_fraction": 0.25}))
    out = tmp_path / "export"
    assert main(["export", "--drafter", str(run / "best"), "--format", "vllm", "--out", str(out),
                 "--export-dtype", "float32", "--calibrate-target", str(tmp_path / "target")]) == 0
    facts = read_card(out)
    exp = facts["expected_acceptance"]
    assert exp["source"].startswith("draftsmith decode") and exp["held_out"] is True
    assert list(exp["by_k"]) == ["1", "2", "3", "4", "5"]
    assert facts["simulated_acceptance"]["by_k"] == {"1": 1.8, "2": 2.28, "3": 2.52}
    drafter = load_drafter(run / "best", target)
    cal = calibration_set(run / "best", target.tokenizer)
    from draftsmith.data.chat import stop_token_ids

    tau5 = chain_tau(target, drafter, cal.prompts, 5, 96, list(stop_token_ids(target.tokenizer)))[0]
    assert abs(exp["by_k_point"]["5"] - tau5) < 1e-3
    lo, hi = exp["by_k_interval"]["5"]
    assert exp["by_k"]["5"] == lo <= tau5 + 1e-3 and tau5 <= hi + 1e-3
    assert exp["prompts"]["set"] == MIXED_SET and exp["prompts"]["count"] == len(cal.prompts)
    assert (exp["k"], exp["temperature"], exp["max_new_tokens"]) == (5, 0.0, 96)
    readme = (out / CARD_FILE).read_text()
    assert f"Calibrated on {len(cal.prompts)} prompts of {MIXED_SET}" in readme and "k=5" in readme
    assert "| point estimate |" in readme and "interval over prompts |" in readme
