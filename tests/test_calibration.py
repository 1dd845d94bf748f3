"""Issue 52: acceptance estimates (``--shape auto``, the model card) are calibrated on prompts the drafter never
trained on: its training run's own held-out split, recomputed from the run's config and data."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from draftsmith.data.chat import encode_prompt
from draftsmith.stages import shapes
from draftsmith.stages.calibration import CALIBRATION_LIMIT
from draftsmith.stages.shapes import calibration_set
from draftsmith.stages.train.data import split_eval
from draftsmith.testing.tokenizer import make_tokenizer


def _run(tmp_path, n: int = 60, fraction: float = 0.2):
    conv = tmp_path / "conversations.jsonl"
    with open(conv, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"c{i}", "messages": [
                {"role": "user", "content": f"question number {i} about topic {i * 7 % 13}"},
                {"role": "assistant", "content": f"answer {i}"}]}) + "\n")
    run = tmp_path / "run"
    (run / "best").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"target": "t", "conversations": str(conv), "store": None,
                                                 "ttt_steps": 3, "eval_fraction": fraction}))
    ids = [f"c{i}" for i in range(n)]
    train, held = split_eval(ids, fraction)
    return run, ids, {ids[i] for i in train}, {ids[i] for i in held}


def test_calibration_prompts_are_the_runs_held_out_split(tmp_path):
    tok = make_tokenizer("chatml")
    run, ids, train, held = _run(tmp_path)
    assert held and train  # the split has both sides
    cal = calibration_set(run / "best", tok)
    assert cal.held_out and "held-out" in cal.source
    assert len(cal.ids) == min(CALIBRATION_LIMIT, len(held))
    assert set(cal.ids) <= held and not set(cal.ids) & train  # never a prompt the drafter trained on
    texts = {f"c{i}": f"question number {i} about topic {i * 7 % 13}" for i in range(len(ids))}
    assert cal.prompts == [encode_prompt(tok, texts[sid], chat=True) for sid in cal.ids]


def test_calibration_without_a_run_says_it_is_not_held_out(tmp_path):
    tok = make_tokenizer("chatml")
    cal = calibration_set(tmp_path, tok)
    assert not cal.held_out and "hand-written" in cal.source
    assert cal.prompts == shapes.calibration_prompts(tok)


def test_shape_auto_calibrates_on_the_held_out_prompts(tmp_path, monkeypatch):
    """auto_shape hands the held-out prompts to calibration (it used the hand-written ones whatever the drafter)."""
    tok = make_tokenizer("chatml")
    run, _, train, held = _run(tmp_path)
    seen = {}

    def fake_acceptance(target, drafter, drafter_dir, prompts, refresh=False, **kw):
        seen["prompts"] = [list(p) for p in prompts]
        return shapes.Acceptance(((0.5,),), "calibration on 4 prompts"), False

    monkeypatch.setattr(shapes, "cached_verify_cost", lambda *a, **k: (None, True))
    monkeypatch.setattr(shapes, "cached_acceptance", fake_acceptance)
    monkeypatch.setattr(shapes, "choose_shape", lambda acc, cost, cands, max_top_k=None: acc)
    target = SimpleNamespace(tokenizer=tok, device=torch.device("cpu"))
    drafter = SimpleNamespace(kind="eagle3", config=SimpleNamespace(draft_vocab_size=64))
    _, _, acc = shapes.auto_shape(target, drafter, run / "best")
    expected = calibration_set(run / "best", tok)
    assert seen["prompts"] == expected.prompts and expected.held_out
    assert seen["prompts"] != shapes.calibration_prompts(tok)
    assert "held-out" in acc.source
