"""Issue 60: acceptance estimates (``--shape auto``, the model card, bench's expected column) are calibrated out of the
training distribution (draftsmith's mixed prompt set, never an evaluation set), replay decoding's rounds instead of a
formula over averaged rates, and come with an interval over prompts whose low end is what is promised."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from draftsmith.data.calibration_prompts import MIXED_PROMPTS
from draftsmith.data.chat import encode_prompt
from draftsmith.stages import shapes
from draftsmith.stages.calibration import CALIBRATION_LIMIT, MIXED_SET, calibration_set
from draftsmith.stages.decode import ChainSpec, HybridSpec, NgramSpec, TreeSpec
from draftsmith.stages.rounds import MISS, Trace, bootstrap
from draftsmith.stages.shapes import Acceptance, choose_shape, expectation, expected_speedup, expected_tau
from draftsmith.stages.verify_cost import VerifyCost
from draftsmith.testing.tokenizer import make_tokenizer


def _run(tmp_path, users: list[str]):
    conv = tmp_path / "conversations.jsonl"
    conv.write_text("".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": u},
                                                                    {"role": "assistant", "content": "ok"}]}) + "\n"
                            for i, u in enumerate(users)))
    run = tmp_path / "run"
    (run / "best").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"target": "t", "conversations": str(conv), "store": None,
                                                 "ttt_steps": 3, "eval_fraction": 0.2}))
    return run


def test_calibration_is_the_mixed_set_less_what_the_run_trained_on(tmp_path):
    tok = make_tokenizer("chatml")
    trained = MIXED_PROMPTS[2][1]
    run = _run(tmp_path, ["an unrelated question", "  " + trained.upper() + " "])  # case and spacing do not matter
    cal = calibration_set(run / "best", tok)
    assert cal.held_out and cal.name == MIXED_SET
    kept = [text for i, (_, text) in enumerate(MIXED_PROMPTS[:CALIBRATION_LIMIT]) if i != 2]
    assert cal.prompts == [encode_prompt(tok, t, chat=True) for t in kept]
    assert len(cal.ids) == CALIBRATION_LIMIT - 1 and not any(i.startswith(f"{MIXED_SET}/2-") for i in cal.ids)
    assert "1 found there, dropped" in cal.source
    assert cal.provenance() == {"set": MIXED_SET, "count": CALIBRATION_LIMIT - 1, "ids": list(cal.ids),
                                "held_out": True}


def test_calibration_without_a_run_says_what_it_trained_on_is_unknown(tmp_path):
    cal = calibration_set(tmp_path, make_tokenizer("chatml"))
    assert not cal.held_out and "unknown" in cal.source and len(cal.prompts) == CALIBRATION_LIMIT
    # Every category once before any twice, so a prefix is mixed.
    assert len({c for c, _ in MIXED_PROMPTS[:CALIBRATION_LIMIT]}) == CALIBRATION_LIMIT


def test_the_mixed_set_is_no_evaluation_set():
    """Never calibrate on what is reported on: no prompt of the installed MT-bench or HumanEval."""
    from draftsmith.data.prompts import evaluation_keys, prompt_key

    keys = evaluation_keys()
    if not keys:
        pytest.skip("no evaluation set installed")
    assert not [t for _, t in MIXED_PROMPTS if prompt_key(t) in keys]


def test_shape_auto_calibrates_on_the_mixed_set(tmp_path, monkeypatch):
    tok = make_tokenizer("chatml")
    run = _run(tmp_path, ["hello"])
    seen = {}

    def fake_acceptance(target, drafter, drafter_dir, prompts, refresh=False, **kw):
        seen["prompts"] = [list(p) for p in prompts]
        return Acceptance(((0.5,),), "calibration on 8 prompts"), False

    monkeypatch.setattr(shapes, "cached_verify_cost", lambda *a, **k: (None, True))
    monkeypatch.setattr(shapes, "cached_acceptance", fake_acceptance)
    monkeypatch.setattr(shapes, "choose_shape", lambda acc, cost, cands, max_top_k=None: acc)
    target = SimpleNamespace(tokenizer=tok, device=torch.device("cpu"))
    drafter = SimpleNamespace(kind="eagle3", config=SimpleNamespace(draft_vocab_size=64))
    _, _, acc = shapes.auto_shape(target, drafter, run / "best")
    assert seen["prompts"] == calibration_set(run / "best", tok).prompts
    assert MIXED_SET in acc.source and acc.prompts["set"] == MIXED_SET and acc.prompts["count"] == CALIBRATION_LIMIT


# --- rounds replayed, not a formula over averaged rates ---------------------------------------------------------
def _trace(ranks, lookup=None) -> Trace:
    return Trace(tuple(tuple(r) for r in ranks), {1: tuple(lookup) if lookup else (MISS,) * len(ranks),
                                                  2: (MISS,) * len(ranks)})


def test_uneven_text_is_weighed_by_its_rounds():
    """Half the text accepts every draft, half none: chain 3 covers the easy half in rounds of 4 and the hard one in
    rounds of 1, so tau is a harmonic mean (tokens / rounds), well under the formula's 1 + 0.5 + 0.25 + 0.125."""
    easy, hard = [0, 0, 0], [MISS, MISS, MISS]
    ranks = [easy] * 40 + [hard] * 40
    acc = Acceptance(((0.5,), (0.5,), (0.5,)), "test", traces=(_trace(ranks),))
    # The easy half: 40 positions in 10 rounds of 4; the hard half: 40 rounds of 1 (the last cut at the end).
    assert expected_tau(acc, ChainSpec(3)) == pytest.approx(80 / 50)
    assert expected_tau(Acceptance(acc.ranks), ChainSpec(3)) == pytest.approx(1.875)  # the old formula's promise


def test_a_hybrid_gains_only_where_lookup_reaches_past_the_tree():
    """Lookup right exactly where the tree is: the two are not independent, and the hybrid accepts what the tree
    does; lookup right where the tree is not: it adds its own reach."""
    tree, hybrid = TreeSpec(2, 2, 4), HybridSpec(TreeSpec(2, 2, 4), NgramSpec(3))
    ranks = [[0, 0], [MISS, MISS]] * 30
    same = Acceptance(((0.5, 0.0), (0.5, 0.0)), "t", traces=(_trace(ranks, [2, MISS] * 30),))
    assert expected_tau(same, hybrid) == pytest.approx(expected_tau(same, tree))
    apart = Acceptance(same.ranks, "t", traces=(_trace(ranks, [MISS, 3] * 30),))
    assert expected_tau(apart, hybrid) > expected_tau(apart, tree) + 0.5


def test_replay_matches_decoding_on_a_fitted_drafter():
    """Greedy chain and tree rounds replayed on calibration traces land where decoding the same prompts does."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import fit_drafter, random_prompts, tiny_target

    from draftsmith.stages.decode import SpeculativeDecoder

    target = tiny_target("llama", num_hidden_layers=3)
    prompts = random_prompts(6, seed=5, max_len=10)
    plain = SpeculativeDecoder(target)
    drafter = fit_drafter(target, [p + plain.generate(p, 32).token_ids for p in prompts], steps=80)
    acc = shapes.calibrate_acceptance(target, drafter, prompts, depth=3, top_k=2, max_new_tokens=32)
    assert len(acc.traces) == len(prompts)
    for spec in (ChainSpec(2), ChainSpec(3), TreeSpec(3, 2, 6)):
        decoder = SpeculativeDecoder(target, drafter, spec)
        steps = [a for p in prompts for a in decoder.generate(p, 32).accepted_per_step]
        real = 1 + sum(steps) / len(steps)
        assert real > 1.5  # the drafter is right often enough for the comparison to mean something
        assert expected_tau(acc, spec) == pytest.approx(real, rel=0.08)
    assert Acceptance.from_dict(acc.to_dict()).traces == acc.traces  # the cache keeps them


# --- the interval and the conservative choice ------------------------------------------------------------------
def test_bootstrap_interval_over_prompts():
    same = bootstrap([3, 3, 3, 3], [1, 1, 1, 1])
    assert same.low == same.point == same.high == 3
    spread = bootstrap([1, 2, 4, 8, 3, 5], [1, 1, 1, 1, 1, 1])
    assert spread.low < spread.point < spread.high and spread.point == pytest.approx(23 / 6)
    assert spread == bootstrap([1, 2, 4, 8, 3, 5], [1, 1, 1, 1, 1, 1])  # seeded: the same every time
    one = bootstrap([5], [2])
    assert one.low == one.high == 2.5


def test_shape_auto_promises_the_low_end_and_says_so():
    cost = VerifyCost(0.01, {n: 0.01 * (1 + 0.05 * (n - 1)) for n in (1, 2, 4, 8, 16, 32, 64)},
                      draft={w: 5e-4 for w in (1, 4, 6, 8, 10)})
    easy, hard, mid = [0] * 4, [MISS] * 4, [0, 0, MISS, MISS]
    traces = (_trace([easy] * 50), _trace([hard] * 50), _trace([mid] * 50), _trace([easy, hard] * 25))
    acc = Acceptance(((0.6,), (0.5,), (0.2,), (0.2,)), "t", traces=traces)
    cands = [ChainSpec(k) for k in (1, 2, 3, 4)]
    choice = choose_shape(acc, cost, cands)
    exp = expectation(acc, choice.shape, cost)
    assert exp.speedup.low < exp.speedup.point < exp.speedup.high
    assert choice.speedup == pytest.approx(exp.speedup.low) and choice.speedup < expected_speedup(acc, choice.shape,
                                                                                                  cost)
    assert choice.table == {f"chain {s.k}": pytest.approx(expectation(acc, s, cost).speedup.low) for s in cands}
    assert "the low end of" in choice.reason and "over 4 prompts" in choice.reason
    d = choice.to_dict()
    assert d["expected_speedup"] == choice.speedup and d["expected"]["speedup"]["point"] > choice.speedup
