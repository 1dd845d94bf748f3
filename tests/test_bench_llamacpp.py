"""`bench --engine llamacpp`: its report arithmetic (fast, no engine) and its refusals."""

from __future__ import annotations

import pytest

from draftsmith.app.bench_llamacpp import EngineStats, format_llamacpp_table, round_profile
from draftsmith.integrations.llamacpp import EngineRun


def test_engine_run_tau_counts_verify_passes():
    # 33 tokens: 1 from prefill, then 32 from passes; 20 drafted tokens accepted -> 12 passes, tau 1 + 20/12
    r = EngineRun(text="", completion_tokens=33, predicted_ms=1000.0, prompt_ms=10.0, draft_n=36, draft_n_accepted=20)
    assert r.verify_passes == 12
    assert r.acceptance_length == pytest.approx(1 + 20 / 12)
    assert r.tokens_per_second == pytest.approx(33.0)


def test_profile_splits_a_round_and_says_when_it_pays():
    plain, eagle, ngram = EngineStats(), EngineStats(), EngineStats()
    plain.add(EngineRun("", 11, 100.0, 1.0))  # 10 ms per pass
    eagle.add(EngineRun("", 11, 60.0, 1.0, draft_n=12, draft_n_accepted=6))  # 4 passes, 15 ms each
    ngram.add(EngineRun("", 11, 96.0, 1.0, draft_n=3, draft_n_accepted=2))  # 8 passes, 12 ms each
    rows = {"plain": plain.to_dict(), "eagle3 k=3": eagle.to_dict(), "ngram k=3": ngram.to_dict()}
    p = round_profile(rows, [3])["k=3"]
    assert p["verify_ms_per_pass"] == 12.0 and p["drafter_ms_per_round"] == 3.0
    assert p["break_even_tau"] == 1.5 and p["tau"] == 2.5
    for row in rows.values():
        row["speedup"] = 1.0
    report = {"target": "t.gguf", "threads": 1, "max_new_tokens": 10,
              "results": [{"dataset": "d", "prompts": 1, "methods": rows, "profile": round_profile(rows, [3])}]}
    assert "pays above tau 1.5 (measured 2.5)" in format_llamacpp_table(report)
    assert "round 15.0 ms = verify 12.0 ms + drafter ~3.0 ms;" in format_llamacpp_table(report)
    # a k with no n-gram row at that k: the round and its break-even, no split (and no 'None')
    del rows["ngram k=3"]
    report["results"][0]["profile"] = round_profile(rows, [3])
    line = next(x for x in format_llamacpp_table(report).splitlines() if "profile k=3" in x)
    assert line == "  profile k=3: round 15.0 ms; one plain step 10.0 ms, so EAGLE-3 pays above tau 1.5 (measured 2.5)"


def test_bench_llamacpp_refuses_sampling(capsys):
    pytest.importorskip("xllamacpp")
    from draftsmith.cli import main

    code = main(["bench", "--engine", "llamacpp", "--drafter", "d", "--temperature", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "greedy" in err and "Traceback" not in err


def test_block_drafter_rows_and_profile_carry_its_kind(tmp_path):
    """A dflash-arch GGUF is benched as its kind (dspark when it has a Markov head): rows, profile and the line."""
    pytest.importorskip("gguf")
    from test_doctor_block import _tiny_target_gguf

    from draftsmith.app.bench_llamacpp import engine_methods
    from draftsmith.integrations.llamacpp import drafter_mode
    from draftsmith.stages.export.block_gguf import export_block_gguf
    from draftsmith.testing.blocks import random_block_checkpoint, tiny_spec

    tg = _tiny_target_gguf(tmp_path / "t.gguf")
    for kind in ("dflash", "dspark"):
        spec = tiny_spec(kind, hidden_size=128, target_hidden_size=128, head_dim=32)
        gguf = export_block_gguf(random_block_checkpoint(spec), tmp_path / f"{kind}.gguf", target=tg).path
        assert drafter_mode(gguf) == kind
        assert [m for _, m, _ in engine_methods([2], [2], kind)] == ["plain", kind, "ngram"]
    plain, spark = EngineStats(), EngineStats()
    plain.add(EngineRun("", 11, 100.0, 1.0))
    spark.add(EngineRun("", 11, 60.0, 1.0, draft_n=12, draft_n_accepted=6))
    rows = {"plain": plain.to_dict(), "dspark k=3": spark.to_dict()}
    for row in rows.values():
        row["speedup"] = 1.0
    report = {"target": "t.gguf", "threads": 1, "max_new_tokens": 10, "kind": "dspark",
              "results": [{"dataset": "d", "prompts": 1, "methods": rows,
                           "profile": round_profile(rows, [3], "dspark")}]}
    assert "so DSpark pays above tau 1.5 (measured 2.5)" in format_llamacpp_table(report)
