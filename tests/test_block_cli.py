"""`decode` and `bench` with --kind dflash|dspark: random and saved block drafters, lossless, and one-line errors."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli as _run

from draftsmith.model.block_drafter import new_block_drafter
from draftsmith.model.target import load_target
from draftsmith.testing.models import build_tiny_model
from draftsmith.testing.tokenizer import make_tokenizer


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("block-cli")
    tok = make_tokenizer("chatml")
    model = build_tiny_model("llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id, num_hidden_layers=4)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    new_block_drafter(load_target(root / "model"), "dspark", markov_rank=8, block_size=4).save(root / "dspark")
    (root / "one.jsonl").write_text(json.dumps({"prompt": "hello there"}) + "\n")
    return root


def test_decode_block_kinds_equal_plain(dirs, capsys):
    args = ["decode", "--target", str(dirs / "model"), "--prompt", "hello there", "--chat", "--max-new-tokens",
            "10", "--json"]
    code, out, _ = _run(capsys, *args)
    plain = json.loads(out)["token_ids"]
    for extra, kind in ((["--random-drafter", "--kind", "dflash", "--block", "3"], "dflash"),
                        (["--random-drafter", "--kind", "dspark"], "dspark"),
                        (["--drafter", str(dirs / "dspark")], "dspark")):  # the saved drafter's kind is read
        code, out, err = _run(capsys, *args, *extra)
        assert code == 0, err
        report = json.loads(out)
        assert report["mode"] == "block" and report["kind"] == kind and report["token_ids"] == plain


@pytest.mark.parametrize("args, message", [
    (["--random-drafter", "--kind", "dflash", "--chain", "2"], "drafts blocks: use --block K, not --chain"),
    (["--random-drafter", "--kind", "dspark", "--hybrid"], "not --hybrid"),
    (["--random-drafter", "--block", "2"], "--block K drafts with a dflash or dspark drafter"),
    (["--random-drafter", "--kind", "dflash", "--block", "99"], "1..64"),
    (["--random-drafter", "--kind", "dflash", "--block", "9"], "at most 7"),
    (["--drafter", "{dspark}", "--kind", "dflash"], "holds a dspark drafter"),
    (["--kind", "dflash"], "--kind needs --drafter"),
])
def test_decode_kind_errors_are_one_line_exit_2(dirs, capsys, args, message):
    args = [a.format(dspark=dirs / "dspark") for a in args]
    code, out, err = _run(capsys, "decode", "--target", str(dirs / "model"), "--prompt", "hi",
                          "--max-new-tokens", "3", *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_bench_block_drafter_reports_per_position_acceptance(dirs, capsys, tmp_path):
    code, _, err = _run(capsys, "bench", "--target", str(dirs / "model"), "--drafter", str(dirs / "dspark"),
                        "--datasets", str(dirs / "one.jsonl"), "--max-new-tokens", "8", "--dtype", "float32",
                        "--prompt-lookup", "0", "--block", "2,4", "--out", str(tmp_path / "b"), "--no-progress")
    assert code == 0, err
    methods = json.loads((tmp_path / "b" / "bench.json").read_text())["results"][0]["methods"]
    assert list(methods) == ["plain", "dspark block k=2", "dspark block k=4"]
    assert methods["dspark block k=2"]["identical_to_plain"] == "1/1"
    row = methods["dspark block k=4"]
    assert row["identical_to_plain"] == "1/1" and row["acceptance_length"] >= 1.0
    assert len(row["acceptance_per_position"]) == 5  # positions 1..k+1 (the last is never reached by drafts)
    code, _, err = _run(capsys, "bench", "--target", str(dirs / "model"), "--random-drafter", "--kind", "dflash",
                        "--datasets", str(dirs / "one.jsonl"), "--max-new-tokens", "4", "--chain", "2",
                        "--out", str(tmp_path / "c"), "--no-progress")
    assert code == 2 and "drafts blocks" in err


def test_decode_shape_auto_chooses_a_block_length(dirs, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path))
    args = ["decode", "--target", str(dirs / "model"), "--prompt", "hello there", "--chat", "--max-new-tokens",
            "6", "--json", "--dtype", "float32"]
    code, out, _ = _run(capsys, *args)
    plain = json.loads(out)["token_ids"]
    code, out, err = _run(capsys, *args, "--drafter", str(dirs / "dspark"), "--shape", "auto")
    assert code == 0, err
    report = json.loads(out)
    assert report["token_ids"] == plain
    assert all(name.startswith("dspark block ") for name in report["auto_shape"]["candidates"])
