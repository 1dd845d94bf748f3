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
