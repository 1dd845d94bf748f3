"""The main job end to end on a tiny random target: every artefact exists and bench counts like the decoder."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.app.demo import PRESETS, run_demo
from draftsmith.core.vocab import load_vocab
from draftsmith.data.prompts import load_prompts
from draftsmith.data.store import FeatureStore
from draftsmith.model.drafter import load_drafter
from draftsmith.model.target import load_target
from draftsmith.stages.decode import ChainSpec, SpeculativeDecoder
from draftsmith.testing.models import save_tiny_target


def bench_in_this_process(target, dtype, drafter, p, out, progress, conversations, device="auto"):
    """The demo's bench command run by this process's CLI entry point: the same arguments and report as the
    child process the demo starts, without its second start-up (the imports cost more than a tiny bench)."""
    from draftsmith.app import demo
    from draftsmith.app.cli import main

    assert main(demo.bench_argv(target, dtype, drafter, p, out, progress, conversations, device)) == 0
    return demo.read_bench(out)


def test_tiny_demo_pipeline(tmp_path, monkeypatch):
    work = tmp_path / "demo"
    save_tiny_target(work / "target")
    # The bench command runs in this process; test_demo_child runs it in the demo's child process.
    monkeypatch.setattr("draftsmith.app.demo.bench_in_fresh_process", bench_in_this_process)
    result = run_demo("tiny", work, target=str(work / "target"), progress=False)
    preset = PRESETS["tiny"]
    # Every stage left its artefact.
    lines = (work / "conversations.jsonl").read_text().splitlines()
    assert len(lines) == preset.conversations
    assert all(json.loads(line)["messages"][-1]["role"] == "assistant" for line in lines)
    store = FeatureStore(work / "store")
    store.verify()
    assert len(store) == preset.conversations
    target = load_target(work / "target")
    vocab = load_vocab(work / "store" / "vocab.safetensors", target.vocab_size)
    assert vocab.draft_vocab_size == preset.draft_vocab_size
    assert (work / "run" / "checkpoints" / "latest").is_file()
    assert result["train_steps"] == preset.max_steps  # no budget: the preset's steps
    assert (work / "run" / "best" / "model.safetensors").is_file()
    exported = json.loads((work / "export" / "vllm" / "config.json").read_text())
    assert exported["eagle_aux_hidden_state_layer_ids"] == list(target.aux_layers)
    report = json.loads((work / "bench" / "bench.json").read_text())
    assert (work / "bench" / "bench.png").is_file()
    # Issue 60: the card promises what the bench's calibration (the mixed set) expects, and says so; training's
    # simulated number stays beside it.
    card = json.loads((work / "export" / "vllm" / "drafter_card.json").read_text())
    assert card["expected_acceptance"] == report["card_expectation"]
    assert card["expected_acceptance"]["prompts"]["set"] == "draftsmith-mixed-v1"
    assert card["simulated_acceptance"]["source"].startswith("held-out split at training")
    assert all("expected" in m for m in report["results"][0]["methods"].values())
    assert result["bench"]["plain"]["speedup"] == 1.0

    # bench's acceptance equals the decoder's own count on the same prompts.
    drafter = load_drafter(work / "run" / "best", target)
    tok = target.tokenizer
    from draftsmith.data.chat import stop_token_ids

    accepted = passes = 0
    decoder = SpeculativeDecoder(target, drafter, ChainSpec(preset.chain))
    for prompt in load_prompts("mt-bench", preset.bench_limit, turns=1):
        text = tok.apply_chat_template([{"role": "user", "content": prompt.turns[0]}], add_generation_prompt=True,
                                       tokenize=False)
        r = decoder.generate(tok(text, add_special_tokens=False)["input_ids"], preset.bench_tokens,
                             eos_token_ids=stop_token_ids(tok), generator=torch.Generator().manual_seed(0))
        accepted += sum(r.accepted_per_step)
        passes += len(r.accepted_per_step)
    chain = report["results"][0]["methods"][f"eagle3 chain k={preset.chain}"]
    assert (chain["accepted"], chain["verify_passes"]) == (accepted, passes)
    assert chain["acceptance_length"] == 1 + accepted / passes
    # In float32 speculative output equals plain greedy decoding for every prompt, and bench says so.
    assert report["dtype"] == "float32"
    for name, m in report["results"][0]["methods"].items():
        if name != "plain":
            assert m["identical_to_plain"] == f"{preset.bench_limit}/{preset.bench_limit}", name
            assert m["diverged_at_tie"] == 0
            per_round = (m["verify_time"] + m["draft_time"]) / m["verify_passes"]
            plain = report["results"][0]["methods"]["plain"]
            assert abs(m["speedup_bound"] - m["acceptance_length"] * plain["step_time"] / per_round) < 1e-9

    # Rerunning resumes: nothing is generated, captured or trained again.
    trained = [work / "run" / "final" / "model.safetensors", work / "run" / "checkpoints" / "latest"]
    stamps = [f.stat().st_mtime_ns for f in trained]
    again = run_demo("tiny", work, target=str(work / "target"), progress=False)
    assert again["bench"][f"eagle3 chain k={preset.chain}"]["acceptance_length"] == chain["acceptance_length"]
    assert [f.stat().st_mtime_ns for f in trained] == stamps  # not a wall-time bound: nothing was rewritten
    # Its summary counts both sessions' work: training's from its checkpoint, the rest from times.json.
    every = again["seconds_all_sessions"]
    assert every["sessions"] == 2 and every["train"] >= result["seconds"]["train"] * 0.5
    assert every["bench"] == pytest.approx(result["seconds"]["bench"] + again["seconds"]["bench"])
    assert every["total"] > result["seconds"]["total"] * 0.9 + again["seconds"]["bench"]


def test_stage_times_add_up_over_killed_and_resumed_sessions(tmp_path):
    from draftsmith.app.demo import StageTimes

    path = tmp_path / "times.json"
    first = StageTimes(path)
    first["load"], first["capture"] = 1.0, 10.0  # then killed during training
    second = StageTimes(path)
    second["load"], second["capture"], second["train"] = 2.0, 0.5, 30.0
    every = second.all_sessions(train_s=50.0)  # the checkpoint counts the first session's training too
    assert every == {"load": 3.0, "capture": 10.5, "train": 50.0, "total": 63.5, "sessions": 2}
    assert second.all_sessions(train_s=None)["train"] == 30.0 == second.all_sessions(train_s=5.0)["train"]
    path.write_text("{not json")
    assert StageTimes(path).all_sessions() == {"total": 0.0, "sessions": 1}  # unreadable: this session alone


def test_demo_on_conversations_as_written(tmp_path, monkeypatch):
    """data = a ShareGPT-shaped file: no generation; the first turns are captured as written, evaluation
    prompts dropped, and bench is told which conversations trained the drafter."""
    monkeypatch.setattr("draftsmith.app.demo.bench_in_fresh_process", bench_in_this_process)  # test_demo_child
    work = tmp_path / "demo"
    save_tiny_target(work / "target")
    mt = load_prompts("mt-bench", 1, turns=1)[0].turns[0] if _has_mtbench() else None
    rows = [{"id": f"s{i}", "conversations": [
        {"from": "human", "value": f"question number {i} about the sea"}, {"from": "gpt", "value": f"answer {i} " * 8},
        {"from": "human", "value": "and a second turn"}, {"from": "gpt", "value": "dropped by max_turns"}]}
        for i in range(10)]
    if mt is not None:
        rows.insert(3, {"id": "eval", "conversations": [{"from": "human", "value": mt}, {"from": "gpt", "value": "x"}]})
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(rows))
    # An earlier session of this workdir spent 10 minutes and stopped before training: the budget counts them.
    (work / "times.json").write_text(json.dumps({"sessions": [{"load": 30.0, "generate": 0.0, "capture": 570.0}]}))
    result = run_demo("tiny", work, target=str(work / "target"), progress=False, data=str(data), max_turns=1,
                      minutes=30, step_ceiling=50, eval_every=15, warmup_steps=3)
    assert result["train_steps"] == 50  # under a budget, up to the ceiling: a roomy one trains every step
    assert result["plan"]["cuts"] == [] and (work / "plan.json").is_file()  # nothing to cut on a tiny model
    config = json.loads((work / "run" / "config.json").read_text())
    # The 30 minutes less what the stages before training took, in this session and the earlier one (and the
    # bench's estimate): a budget, however long those stages took on a busy machine, and never more than they left.
    seconds = result["seconds"]
    assert 1.0 < config["max_minutes"] <= 30 - 10 - (seconds["load"] + seconds["generate"] + seconds["capture"]) / 60
    # A preset's own evaluation cadence and warm-up, not fractions of its step ceiling.
    assert (config["eval_every"], config["save_every"], config["warmup_steps"]) == (15, 15, 3)
    assert config["max_steps"] == 50
    assert not (work / "conversations.jsonl").exists() and result["seconds"]["generate"] == 0.0
    store = FeatureStore(work / "store")
    assert len(rows) <= PRESETS["tiny"].conversations  # the preset's limit reads them all
    assert sorted(store.sample_ids) == sorted(f"s{i}" for i in range(10))  # never the evaluation prompt
    tok = load_target(work / "target").tokenizer
    assert "second turn" not in tok.decode(store.get_by_id("s0")["input_ids"])
    assert (work / "run" / "best" / "model.safetensors").is_file() and result["bench"]["plain"]["speedup"] == 1.0


def test_the_time_budget_leaves_training_what_the_other_stages_do_not_use():
    from draftsmith.app.demo_budget import EXPORT_S, MIN_TRAIN_MINUTES, train_minutes

    assert train_minutes(20, 300, 200) == (1200 - 300 - 200 - EXPORT_S) / 60
    assert train_minutes(20, 1200, 200) == MIN_TRAIN_MINUTES  # already spent: still a short run, not none
    assert train_minutes(None, 300, 200) == 0.0  # no budget: the preset's steps


def _rates(step_s: float, per_token_s: float, tok_s: float, records: list[int]):
    from draftsmith.app.demo_budget import Rates
    from draftsmith.stages.verify_cost import VerifyCost

    verify = {n: step_s + (n - 1) * per_token_s for n in (1, 4, 11)}
    return Rates(VerifyCost(step_s, verify), tok_s, records)


def test_the_budget_cuts_capture_and_bench_only_where_they_would_not_fit():
    from draftsmith.app.demo_budget import (
        BENCH_SHARE,
        CAPTURE_SHARE,
        MIN_BENCH_PROMPTS,
        MIN_BENCH_TOKENS,
        MIN_CONVERSATIONS,
        bench_seconds,
        plan,
        verified_per_method,
    )

    methods = verified_per_method(2, 6)
    assert methods == [3, 6, 4, 11]
    records = [500] * 400
    # A fast machine: cheap verify passes, fast capture. Nothing is cut.
    fast = _rates(0.02, 0.001, 2000, records)
    sizes = plan(20, 400, 8, 192, methods, fast)
    assert (sizes.conversations, sizes.bench_limit, sizes.bench_tokens, sizes.cuts) == (400, 8, 192, ())
    assert sizes.capture_s == 400 * 500 / 2000
    # A slow one (emulated bf16: each extra token of a pass costs a third of a step; capture 350 tok/s).
    slow = _rates(0.04, 0.014, 350, records)
    assert bench_seconds(slow, 8, 192, methods) > BENCH_SHARE * 1200  # the preset's bench would not fit
    sizes = plan(20, 400, 8, 192, methods, slow)
    assert MIN_CONVERSATIONS <= sizes.conversations < 400 and len(sizes.cuts) == 2
    assert sizes.capture_s <= CAPTURE_SHARE * 1200 < sizes.capture_s + 500 / 350  # the most that fits
    assert sizes.bench_s <= BENCH_SHARE * 1200 or (sizes.bench_limit, sizes.bench_tokens) == (MIN_BENCH_PROMPTS,
                                                                                              MIN_BENCH_TOKENS)
    assert sizes.bench_limit < 8
    # Two prompt sets (the full preset's MT-bench and HumanEval) decode twice the prompts: a smaller cut each.
    middling = _rates(0.02, 0.004, 2000, records)
    one, two = plan(20, 400, 8, 192, methods, middling), plan(20, 400, 8, 192, methods, middling, datasets=2)
    assert one.cuts == () and two.bench_limit < 8
    # No budget: the preset as it is, however slow.
    assert plan(None, 400, 8, 192, methods, slow).cuts == ()
    # Where capture reads what generation wrote (no record sizes), only the bench may be cut.
    assert plan(20, 400, 8, 192, methods, _rates(0.04, 0.014, 350, [])).conversations == 400


def test_the_plan_is_decided_once_per_workdir(tmp_path):
    """A rerun reads plan.json, so a resumed capture stops where the first run meant to; new settings replan."""
    from dataclasses import replace

    from draftsmith.app.demo import bench_estimate, demo_plan

    target = load_target(save_tiny_target(tmp_path / "t"))
    p = replace(PRESETS["tiny"], minutes=20)
    first = demo_plan(p, tmp_path, target, target, 0.01, None)
    assert first.conversations == p.conversations and first.bench_s > 0
    # after capture the bench is probed again at the plan's sizes; the demo keeps the lower estimate
    assert 0 < bench_estimate(p, target, first) < 10 * first.bench_s
    assert demo_plan(p, tmp_path, None, None, None, None) == first  # nothing measured: no target needed
    with pytest.raises(AttributeError):  # other settings: measured again (here on no target at all)
        demo_plan(replace(p, minutes=5), tmp_path, None, None, None, None)


def _has_mtbench() -> bool:
    try:
        return bool(load_prompts("mt-bench", 1))
    except FileNotFoundError:
        return False


def test_a_resumed_demo_trains_to_the_budget_its_first_run_gave_training(tmp_path):
    """Training plans against the time its checkpoint spent; a rerun's fresh (larger) budget would stretch it."""
    from draftsmith.app.demo import _first_train_budget

    run = tmp_path / "run"
    assert _first_train_budget(run) == 0.0
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"max_minutes": 11.6}))
    assert _first_train_budget(run) == 0.0  # no checkpoint: a fresh start gets what this run leaves
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "latest").write_text("step-0000160")
    assert _first_train_budget(run) == 11.6
    (run / "config.json").write_text("{not json")
    assert _first_train_budget(run) == 0.0
