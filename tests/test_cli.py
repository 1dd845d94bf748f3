"""The `draftsmith decode` command: JSON report, drafters, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import run_cli as _run

from draftsmith.model.drafter import new_drafter
from draftsmith.model.target import Target
from draftsmith.testing.models import build_tiny_model
from draftsmith.testing.tokenizer import make_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tok = make_tokenizer("chatml")
    model = build_tiny_model("llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_plain_and_speculative_json_agree(model_dir, capsys, tmp_path):
    args = ["decode", "--target", str(model_dir), "--prompt", "hello there", "--chat", "--max-new-tokens", "12"]
    code, out, _ = _run(capsys, *args, "--json")
    assert code == 0
    plain = json.loads(out)
    for key in ("text", "token_ids", "acceptance_length", "target_forward_passes", "tokens_per_second"):
        assert key in plain
    assert plain["mode"] == "plain" and plain["acceptance_length"] == 1.0
    assert plain["target_forward_passes"] == len(plain["token_ids"])

    code, out, _ = _run(capsys, *args, "--json", "--random-drafter", "--chain", "2")
    chain = json.loads(out)
    assert code == 0 and chain["mode"] == "chain" and chain["token_ids"] == plain["token_ids"]

    # A saved drafter directory loads and decodes identically with a tree.
    from draftsmith.model.target import load_target

    new_drafter(load_target(model_dir)).save(tmp_path / "drafter")
    code, out, _ = _run(capsys, *args, "--json", "--drafter", str(tmp_path / "drafter"), "--tree", "3,2,6")
    tree = json.loads(out)
    assert code == 0 and tree["mode"] == "tree" and tree["token_ids"] == plain["token_ids"]


def test_text_output(model_dir, capsys):
    code, out, err = _run(capsys, "decode", "--target", str(model_dir), "--prompt", "hi", "--max-new-tokens", "4")
    assert code == 0 and "acceptance length 1.00" in err


@pytest.mark.parametrize("args, message", [
    (["--target", "/nonexistent/model"], "no such file or directory"),
    (["--aux-layers", "2,4,99"], "out of range"),
    (["--chain", "3"], "need --drafter"),
    (["--tree", "3,2"], "DEPTH,TOPK,TOTAL"),
    (["--max-new-tokens", "0"], "must be >= 1"),
    (["--max-new-tokens", "-5"], "must be >= 1"),
    # issue 19.6/19.7: bounded, validated draft shapes (no silent defaults, no crash mid-decode)
    (["--random-drafter", "--chain", "0"], "chain length must be >= 1, got 0"),
    (["--random-drafter", "--chain", "65"], "at most 64"),
    (["--random-drafter", "--tree", "65,2,10"], "at most 64"),
    (["--random-drafter", "--tree", "3,2,100000"], "at most 1024"),
    (["--random-drafter", "--tree", "1,600,10"], "draft vocabulary"),  # depth 1: within the candidates bound
    (["--prompt-lookup", "-1"], "prompt lookup length must be >= 1, got -1"),
    (["--prompt-lookup", "100000"], "at most 64"),
])
def test_bad_input_one_line_exit_2(model_dir, capsys, args, message):
    base = ["decode", "--target", str(model_dir), "--prompt", "hi"]
    code, out, err = _run(capsys, *base, *args)
    assert code == 2
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow  # the console entry point in an interpreter of its own, which imports torch
def test_non_model_directory_subprocess(tmp_path):
    """The installed console script: one line on stderr, exit code 2, no traceback."""
    (tmp_path / "readme.txt").write_text("not a model")
    proc = subprocess.run([sys.executable, "-m", "draftsmith.cli", "decode", "--target", str(tmp_path),
                           "--prompt", "x"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("draftsmith: error:") and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # the console entry point in an interpreter of its own, which imports torch
def test_huge_chain_fails_fast_subprocess(model_dir):
    """Issue 19.6: `--chain 100000` drafted 100000 tokens per round (over 5 minutes); now a one-line error."""
    proc = subprocess.run([sys.executable, "-m", "draftsmith.cli", "decode", "--target", str(model_dir),
                           "--prompt", "x", "--random-drafter", "--chain", "100000", "--max-new-tokens", "4"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("draftsmith: error: chain length must be at most 64")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_drafter_for_another_target_refused(model_dir, capsys, tmp_path):
    other = Target(build_tiny_model("llama", vocab_size=300, hidden_size=32, num_attention_heads=2,
                                    num_key_value_heads=1, dtype=torch.float32))
    new_drafter(other).save(tmp_path / "other")
    code, _, err = _run(capsys, "decode", "--target", str(model_dir), "--prompt", "hi",
                        "--drafter", str(tmp_path / "other"))
    assert code == 2 and "target_hidden_size 32 != target hidden_size 64" in err
