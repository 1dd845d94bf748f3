"""Issue 52, ``draftsmith check`` without an engine: the verdict, the near-tie rule, and the cause named for every
planted fault of an HF-layout export, with the engine stood in by draftsmith's own decoder reading the served files
(the real engines are in test_check_engines.py, slow)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_prompts, save_tiny_chat_model

from draftsmith.stages import check as check_mod
from draftsmith.stages.check import CheckOptions, run_check
from draftsmith.stages.check.engines import EngineOutcome, Served
from draftsmith.stages.check.replay import chain_tau, load_pair
from draftsmith.stages.check.verdict import acceptance_verdict, compare_outputs
from draftsmith.testing.planted import HF_FAULTS, fit_chain_drafter, plant_hf

K, NEW = 3, 24


def test_near_tie_flip_is_told_from_a_real_divergence():
    plain = [[5, 6, 7], [5, 6, 7], [5, 6, 7]]
    spec = [[5, 6, 7], [5, 9, 1], [5, 8, 1]]
    top = [[[[5, -0.1], [4, -3.0]]] * 3,
           [[[5, -0.1], [4, -3.0]], [[6, -0.70], [9, -0.75]], [[7, -0.1], [1, -3.0]]],
           [[[5, -0.1], [4, -3.0]], [[6, -0.70], [8, -1.50]], [[7, -0.1], [1, -3.0]]]]
    eq = compare_outputs(plain, spec, top)
    assert eq.identical == 1 and len(eq.near_ties) == 1 and "0.050 nats" in eq.near_ties[0]
    assert len(eq.divergences) == 1 and "prompt 2, token 1" in eq.divergences[0]


def test_verdict_thresholds():
    assert acceptance_verdict(2.95, 3.0, "draftsmith") == "pass"
    assert acceptance_verdict(2.6, 3.0, "draftsmith") == "partial loss"  # norm_output stripped in vLLM: 3.38 -> 3.03
    assert acceptance_verdict(1.2, 3.0, "card") == "silent collapse"
    assert acceptance_verdict(2.7, 3.0, "card") == "pass"
    # OpenVINO GenAI's measured gap on good drafters (tau -9.3%: 2.528 against 2.788) passes there, not elsewhere
    assert acceptance_verdict(2.528, 2.788, "draftsmith", "openvino") == "pass"
    assert acceptance_verdict(2.528, 2.788, "draftsmith", "llamacpp") == "partial loss"
    assert acceptance_verdict(2.2, 2.788, "draftsmith", "openvino") == "partial loss"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target directory and a run whose drafter (reduced vocabulary, norm_before_residual and norm_output on)
    is fitted to the target's greedy continuations; exported as vLLM's layout with its card."""
    from draftsmith.core import vocab as vocab_mod
    from draftsmith.model.target import load_target
    from draftsmith.stages.decode import SpeculativeDecoder
    from draftsmith.stages.export import export_drafter

    root = tmp_path_factory.mktemp("check")
    save_tiny_chat_model(root / "target", seed=1, initializer_range=0.3)  # noisy text: flags matter
    target = load_target(str(root / "target"), dtype=torch.float32, pack=False)
    prompts = random_prompts(6, seed=3, vocab=200, max_len=8)
    plain = SpeculativeDecoder(target)
    seqs = [p + plain.generate(p, NEW).token_ids for p in prompts]
    kept = torch.cat([torch.tensor([t for s in seqs for t in s]), torch.arange(64)])
    dv = vocab_mod.from_target_ids(kept, target.vocab_size)
    drafter, acc = fit_chain_drafter(target, dv, seqs, steps=120, norm_before_residual=True, norm_output=True)
    run = root / "run"
    drafter.save(run / "best")
    (run / "best" / "eval.json").write_text(json.dumps({"step": 120, "acc": acc, "tokens": 100}))
    (run / "config.json").write_text(json.dumps({"target": str(root / "target"), "ttt_steps": 3,
                                                 "eval_fraction": 0.1}))
    good = export_drafter(run / "best", root / "good", "vllm", dtype="fp32").path
    return {"root": root, "target": str(root / "target"), "good": good, "prompts": prompts, "best": run / "best"}


def _draftsmith_engine(read=None):
    """An engine stand-in: draftsmith's decoder on the files as served (``read`` may misread the loaded pair)."""

    def run(opts: CheckOptions, served) -> EngineOutcome:
        from draftsmith.stages.decode import SpeculativeDecoder

        try:
            target, drafter = load_pair(opts.target, served)
        except Exception as e:  # noqa: BLE001 - what an engine refusing the files looks like
            return EngineOutcome("stand-in", "0", Served("plain"), Served("speculative", error=str(e)))
        if read is not None:
            read(target, drafter)
        plain = SpeculativeDecoder(target)
        p = Served("plain", token_ids=[plain.generate(x, NEW).token_ids for x in opts.prompts])
        tau, tokens = chain_tau(target, drafter, opts.prompts, opts.k, NEW)
        passes = sum(len(t) for t in tokens)  # stand-in counters giving exactly tau
        s = Served("speculative", token_ids=tokens, passes=passes, accepted=round((tau - 1) * passes))
        return EngineOutcome("stand-in", "0", p, s)

    return run


def _check(pair, drafter, monkeypatch, read=None):
    monkeypatch.setattr(check_mod, "_run_engine", _draftsmith_engine(read))
    monkeypatch.setattr(check_mod, "_doctor", lambda opts, served, report: True)  # doctor has its own tests
    return run_check(CheckOptions(engine="vllm", target=pair["target"], drafter=str(drafter), prompts=pair["prompts"],
                                  k=K, max_new_tokens=NEW, reference_drafter=str(pair["best"])))


def test_good_export_passes(pair, monkeypatch):
    r = _check(pair, pair["good"], monkeypatch)
    assert r.served_tau > 1.5, r.summary()  # the fitted drafter is worth checking
    assert r.verdict == "pass" and r.exit_code == 0, r.summary()
    assert r.equality.identical == r.equality.compared == len(pair["prompts"])


EXPECTED_CAUSE = {"norm-output-stripped": "norm-ignored", "aux-ids-minus-1": "aux-ids-off-by-one",
                  "d2t-dropped": "d2t-missing", "d2t-absolute": "d2t-offsets",
                  "norm-before-residual-dropped": "norm-before-residual", "d2t-shuffled": "wrong-draft-vocab"}


# One fault in the default run, the rest with the slow suite (each case decodes the pair twice; the default run
# keeps to its three minutes).
@pytest.mark.parametrize("fault", [f if i == 0 else pytest.param(f, marks=pytest.mark.slow)
                                   for i, f in enumerate(HF_FAULTS)])
def test_each_planted_fault_is_caught_with_its_cause(pair, monkeypatch, tmp_path, fault):
    planted = plant_hf(pair["good"], tmp_path / fault, fault)
    r = _check(pair, planted, monkeypatch)
    assert r.exit_code == 1, r.summary()
    assert EXPECTED_CAUSE[fault] in {f.cause for f in r.findings}, r.summary()


def test_an_engine_that_misreads_a_flag_is_named_by_replay(pair, monkeypatch):
    """Files as trained (the card agrees); the engine reads norm_before_residual otherwise (speculators' config
    defaults it to true when absent): the loss shows only in the engine, and the replay names it."""

    def flip(target, drafter):
        for m in drafter.modules():
            if hasattr(m, "norm_before_residual") and m is not drafter:
                m.norm_before_residual = not m.norm_before_residual

    r = _check(pair, pair["good"], monkeypatch, read=flip)
    assert r.verdict != "pass" and r.exit_code == 1, r.summary()
    assert r.findings[0].cause == "norm-before-residual", r.summary()
    assert "norm_before_residual flipped" in r.findings[0].evidence, r.summary()


def test_cli_check_bad_arguments_are_one_line(tmp_path, capsys):
    from draftsmith.cli import main

    assert main(["check", "--engine", "llamacpp", "--target", "smollm2", "--drafter", str(tmp_path),
                 "--limit", "0"]) == 2
    assert main(["check", "--engine", "llamacpp", "--target", "smollm2", "--drafter", str(tmp_path),
                 "--prompts", str(tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "--limit" in err and "missing.jsonl" in err and "Traceback" not in err


# --- OpenVINO GenAI #4425: a freshly built speculative pipeline that accepts no draft (output unchanged) ---------
def _with_first_try(first: Served, retry_accepts: bool):
    """The stand-in engine whose first speculative pipeline is ``first`` (GenAI #4425's zero run, or a crash); the
    retry in a fresh pipeline serves the files (``retry_accepts``) or accepts nothing again."""
    inner = _draftsmith_engine()

    def run(opts: CheckOptions, served) -> EngineOutcome:
        out = inner(opts, served)
        if not retry_accepts:
            out.spec.accepted = 0
        out.first_try = first
        return out

    return run


def _check_engine(pair, monkeypatch, engine_fn, replay: bool = True) -> check_mod.CheckReport:
    monkeypatch.setattr(check_mod, "_run_engine", engine_fn)
    monkeypatch.setattr(check_mod, "_doctor", lambda opts, served, report: True)
    return run_check(CheckOptions(engine="vllm", target=pair["target"], drafter=str(pair["good"]),
                                  prompts=pair["prompts"], k=K, max_new_tokens=NEW,
                                  reference_drafter=str(pair["best"]), replay=replay))


def test_a_pipeline_that_accepts_nothing_then_accepts_is_the_engines_zero_run(pair, monkeypatch):
    zero = Served("speculative", token_ids=[[1]], passes=NEW * len(pair["prompts"]), accepted=0)
    r = _check_engine(pair, monkeypatch, _with_first_try(zero, retry_accepts=True))
    assert r.served_tau > 1.5, r.summary()  # the verdict is the fresh pipeline's
    assert r.verdict == "intermittent zero acceptance" and r.exit_code == 1, r.summary()
    assert [f.cause for f in r.findings] == ["engine-zero-accept"], r.summary()
    assert "#4425" in r.summary() and "accepted 0 drafts" in r.summary()


@pytest.mark.slow  # the default run keeps to its three minutes; the zero-acceptance twin above runs there
def test_a_crash_at_the_first_generate_then_a_good_run_is_named_too(pair, monkeypatch):
    crash = Served("speculative", error="OpenVINO's worker died (exit -11): Segmentation fault")
    r = _check_engine(pair, monkeypatch, _with_first_try(crash, retry_accepts=True))
    assert [f.cause for f in r.findings] == ["engine-zero-accept"] and "crashed" in r.findings[0].evidence


def test_zero_acceptance_twice_is_the_drafter_not_the_engine(pair, monkeypatch):
    zero = Served("speculative", token_ids=[[1]], passes=NEW * len(pair["prompts"]), accepted=0)
    r = _check_engine(pair, monkeypatch, _with_first_try(zero, retry_accepts=False), replay=False)
    assert r.verdict == "silent collapse" and r.exit_code == 1, r.summary()
    assert "engine-zero-accept" not in {f.cause for f in r.findings}, r.summary()
    assert any("not GenAI's intermittent" in n for n in r.notes), r.summary()


def test_near_ties_measured_by_the_target_when_the_engine_reports_no_log_probabilities(pair):
    """GenAI returns no top-2: plain's own log-probabilities come from draftsmith's target along plain's output."""
    from draftsmith.model.target import load_target
    from draftsmith.stages.check.replay import plain_top2
    from draftsmith.stages.decode import SpeculativeDecoder

    target = load_target(pair["target"], dtype=torch.float32, pack=False)
    prompt = pair["prompts"][0]
    plain = SpeculativeDecoder(target).generate(prompt, NEW).token_ids
    j = 5
    with torch.no_grad():
        lp = torch.log_softmax(target(torch.tensor([prompt + plain])).logits[0, len(prompt) - 1 + j].float(), -1)
    second = int(lp.topk(2).indices[1])
    worst = int(lp.argmin())
    for other, tie in ((second, float(lp[plain[j]] - lp[second]) <= 0.12), (worst, False)):
        spec = plain[:j] + [other] + plain[j + 1:]
        top = plain_top2(target, [prompt], [plain], [spec])
        eq = compare_outputs([plain], [spec], top)
        gap = float(lp[plain[j]] - lp[other])
        said = (eq.near_ties or eq.divergences)[0]
        assert (len(eq.near_ties) == 1) == tie, eq
        assert f"token {j}" in said and f"{gap:.3f} nats" in said, (said, gap)


def test_openvino_runs_a_zero_pipeline_again_in_a_fresh_one(monkeypatch):
    """run_openvino against a stand-in worker: the first speculative pipeline accepts nothing (GenAI #4425), the
    fresh one accepts; a refused draft is reported with GenAI's words, plain still measured."""
    import draftsmith.integrations.openvino as ov
    from draftsmith.stages.check.engines import run_openvino

    calls = []

    def worker(req, python=None, timeout=0):
        calls.append([m["name"] for m in req["methods"]])
        runs = {"plain": [{"tokens": [1, 2, 3, 4, 5], "accepted": 0}] * 2}
        if "speculative" in calls[-1]:
            accepted = 0 if len(calls) == 1 else 2
            runs["speculative"] = [{"tokens": [1, 2, 3, 4, 5], "accepted": accepted}] * 2
        if req["draft"] == "refused" and "speculative" in calls[-1]:
            return {"error": "speculative: RuntimeError: Exception from src/... d2t"}
        if req["draft"] == "crash" and len(calls) == 1:
            raise ov.OpenVinoError("OpenVINO's worker died (exit -11): Segmentation fault")
        return {"runs": runs, "versions": {"openvino-genai": "2026.4.1.0"}}

    monkeypatch.setattr(ov, "run_worker", worker)
    out = run_openvino("t", "d", [[1], [2]], 3, 4, eos=[0])
    assert calls == [["plain", "speculative"], ["speculative"]]
    assert out.first_try is not None and out.first_try.accepted == 0 and out.first_try.passes == 8
    assert out.spec.accepted == 4 and out.spec.per_prompt == [2, 2] and out.spec.tau == 2.0
    assert out.version == "2026.4.1.0"
    calls.clear()
    out = run_openvino("t", "refused", [[1], [2]], 3, 4, eos=[0])
    assert calls == [["plain", "speculative"], ["plain"]]
    assert out.plain.error is None and out.plain.token_ids == [[1, 2, 3, 4, 5]] * 2
    assert "d2t" in out.spec.error and out.first_try is None
    calls.clear()
    out = run_openvino("t", "crash", [[1], [2]], 3, 4, eos=[0])  # GenAI #4425's other face: a crash, retried
    assert calls == [["plain", "speculative"], ["plain"], ["speculative"]]
    assert "worker died" in out.first_try.error and out.spec.accepted == 4


# --- check --record: a pass writes the engine's version and the served acceptance into the card ----------------
def _passing(engine="llamacpp", version="2026.10.11549", served=2.9, verdict="pass"):
    r = check_mod.CheckReport(engine=engine, engine_version=version, served_tau=served, own_tau=3.0,
                              expected_from="draftsmith", verdict=verdict, prompts=6, k=K)
    return lambda opts: r


def test_check_record_writes_the_engine_into_the_card_on_a_pass_only(pair, tmp_path, monkeypatch, capsys):
    import shutil

    from huggingface_hub import ModelCard

    from draftsmith.cli import main
    from draftsmith.stages.export.card import CARD_FILE, read_card

    drafter = tmp_path / "export"
    shutil.copytree(pair["good"], drafter)
    args = ["check", "--engine", "llamacpp", "--target", pair["target"], "--drafter", str(drafter), "--limit", "2",
            "--record"]
    monkeypatch.setattr(check_mod, "run_check", _passing(verdict="partial loss", served=2.0))
    assert main(args) == 1
    assert "checks" not in read_card(drafter) and "not recorded" in capsys.readouterr().err
    monkeypatch.setattr(check_mod, "run_check", _passing())
    assert main(args) == 0
    card = read_card(drafter)
    assert card["versions"]["engines"] == {"llamacpp": "2026.10.11549"}
    [c] = card["checks"]
    assert (c["engine"], c["k"], c["served_tau"], c["expected_tau"], c["prompt_source"]) == \
        ("llamacpp", K, 2.9, 3.0, "mt-bench")
    text = (drafter / CARD_FILE).read_text()
    assert "## Checked in engines" in text and "| llamacpp | 2026.10.11549 | 3 |" in text
    assert "llamacpp 2026.10.11549 (checked)" in text
    assert ModelCard.load(drafter / CARD_FILE).data.base_model is not None
    monkeypatch.setattr(check_mod, "run_check", _passing(served=2.95))  # the same engine and k: replaced
    assert main(args) == 0
    assert [c["served_tau"] for c in read_card(drafter)["checks"]] == [2.95]


def test_check_record_keeps_a_users_readme_and_needs_a_card(pair, tmp_path, monkeypatch):
    import shutil

    from draftsmith.cli import main
    from draftsmith.stages.export.card import CARD_FILE, read_card

    drafter = tmp_path / "export"
    shutil.copytree(pair["good"], drafter)
    (drafter / CARD_FILE).write_text("# my own notes\n")
    monkeypatch.setattr(check_mod, "run_check", _passing())
    args = ["check", "--engine", "llamacpp", "--target", pair["target"], "--limit", "2", "--record", "--drafter"]
    assert main([*args, str(drafter)]) == 0
    assert (drafter / CARD_FILE).read_text() == "# my own notes\n"
    assert read_card(drafter)["checks"][0]["engine"] == "llamacpp"
    assert main([*args, str(pair["best"])]) == 2  # a draftsmith folder: no card to record into


# --- check --engine sglang, end to end against the stand-in SGLang server (testing/fake_sglang.py) --------------
# The collapse in the default run, the pass with the slow suite (the default run keeps to its three minutes).
@pytest.mark.parametrize("served", [pytest.param("as trained", marks=pytest.mark.slow), "collapsed"])
def test_sglang_check_end_to_end_against_a_stand_in_server(pair, tmp_path, monkeypatch, served):
    from draftsmith.data.chat import stop_token_ids
    from draftsmith.stages.decode import SpeculativeDecoder
    from draftsmith.testing.fake_sglang import write_fake_sglang

    target, drafter = load_pair(pair["target"], pair["best"])
    eos = stop_token_ids(target.tokenizer)
    plain = SpeculativeDecoder(target)
    outputs = {",".join(map(str, p)): plain.generate(p, NEW, eos_token_ids=eos).token_ids for p in pair["prompts"]}
    own, _ = chain_tau(target, drafter, pair["prompts"], K, NEW, eos)
    n = len(next(iter(outputs.values())))
    per_token = (1.0 / own) if served == "as trained" else 0.9  # verify passes per token: tau ~own, or ~1.05
    py = write_fake_sglang(tmp_path / "env")
    (tmp_path / "fake.json").write_text(json.dumps({"outputs": outputs, "verify_per_token": per_token,
                                                    "log": str(tmp_path / "log.jsonl")}))
    monkeypatch.setenv("FAKE_SGLANG", str(tmp_path / "fake.json"))
    # draftsmith's own folder: exported as SGLang's layout on the fly (the vLLM layout's architecture name is one
    # SGLang does not register, which doctor blocks)
    r = run_check(CheckOptions(engine="sglang", target=pair["target"], drafter=str(pair["best"]),
                               prompts=pair["prompts"], k=K, max_new_tokens=NEW, sglang_python=str(py),
                               reference_drafter=str(pair["best"]), replay=False))
    assert r.engine_version == "0.0.fake", (r.verdict, r.doctor, r.notes)
    assert r.equality.identical == len(pair["prompts"]), r.summary()
    assert n > 4 and r.own_tau == pytest.approx(own)
    if served == "as trained":
        assert r.verdict == "pass" and r.exit_code == 0, r.summary()
    else:
        assert r.served_tau < 1.2 and r.verdict == "silent collapse" and r.exit_code == 1, r.summary()


def test_cli_check_openvino_bad_target_is_one_line(tmp_path, capsys):
    from draftsmith.cli import main

    assert main(["check", "--engine", "openvino", "--target", str(tmp_path / "nope"), "--drafter", str(tmp_path),
                 "--openvino-python", str(tmp_path / "no-python")]) == 2
    assert main(["check", "--engine", "openvino", "--target", str(tmp_path / "nope"), "--drafter", str(tmp_path),
                 "--openvino-python", "/bin/sh"]) == 2
    err = capsys.readouterr().err
    assert "OpenVINO's environment is not installed" in err and "Hugging Face folder" in err
    assert "Traceback" not in err


def test_an_identity_d2t_is_a_missing_one():
    """A d2t of zero offsets reads draft id i as target id i, as an engine without d2t does: the card names it d2t
    missing, not another draft vocabulary."""
    from draftsmith.stages.check.files import _d2t_hashes
    from draftsmith.stages.check.signatures import causes_from_card

    trained = torch.tensor([0, 3, 3, 7])  # offsets: the reduced vocabulary's target ids 0, 4, 5, 10
    card = {"draft_ids_sha256": _d2t_hashes(trained, absolute=False)["draft_ids_sha256"], "draft_vocab_size": 4,
            "vocab_size": 64}
    zeros = _d2t_hashes(torch.zeros(4, dtype=torch.int64), absolute=False)
    assert [c for c, _ in causes_from_card(card, zeros)] == ["d2t-missing"]
    other = _d2t_hashes(torch.tensor([1, 3, 3, 7]), absolute=False)
    assert [c for c, _ in causes_from_card(card, other)] == ["wrong-draft-vocab"]
    assert causes_from_card(card, _d2t_hashes(trained, absolute=False)) == []
