"""Issue 19 (hardening): corrupt files, bad inputs and misleading advice end in one line naming the culprit."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.cli import main
from draftsmith.core import vocab as vocab_mod
from draftsmith.model.drafter import new_drafter
from draftsmith.model.target import load_target
from draftsmith.testing.models import save_tiny_target

DRAFT_VOCAB = 40


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny target directory and a drafter for it with a reduced (non-identity) draft vocabulary."""
    root = tmp_path_factory.mktemp("hardening")
    target_dir = save_tiny_target(root / "target")
    target = load_target(target_dir)
    ids = torch.arange(target.vocab_size - 1, target.vocab_size - 1 - 2 * DRAFT_VOCAB, -2).flip(0)
    dv = vocab_mod.from_target_ids(ids, target.vocab_size)
    drafter = new_drafter(target, draft_vocab=dv)
    drafter_dir = drafter.save(root / "drafter")
    return {"root": root, "target": target_dir, "drafter": drafter_dir, "t2d": dv.t2d, "d2t": dv.d2t}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _truncated(src: Path, dst: Path) -> Path:
    d = _copy(src, dst)
    f = d / "model.safetensors"
    os.truncate(f, f.stat().st_size - 5)
    return d


def _err(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "Loading weights" not in ln]


def _one_line(capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    err = _err(capsys)
    assert len(err) == 1 and err[0].startswith("draftsmith: error:"), err
    for n in needles:
        assert n in err[0], err
    return err[0]


# --- 5: truncated safetensors ---------------------------------------------------------------------------
def test_decode_truncated_target(dirs, tmp_path, capsys):
    bad = _truncated(dirs["target"], tmp_path / "t")
    assert main(["decode", "--target", str(bad), "--prompt", "hi", "--max-new-tokens", "1"]) == 2
    _one_line(capsys, str(bad / "model.safetensors"), "not a valid safetensors file")


def test_capture_truncated_target(dirs, tmp_path, capsys):
    bad = _truncated(dirs["target"], tmp_path / "t")
    conv = tmp_path / "c.jsonl"
    conv.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"},
                                                         {"role": "assistant", "content": "yo"}]}) + "\n")
    argv = ["capture", "--target", str(bad), "--conversations", str(conv), "--out", str(tmp_path / "s"),
            "--no-progress"]
    assert main(argv) == 2
    line = _one_line(capsys, str(bad / "model.safetensors"), "not a valid safetensors file")
    assert "rerun" not in line


def test_decode_truncated_drafter(dirs, tmp_path, capsys):
    bad = _truncated(dirs["drafter"], tmp_path / "d")
    argv = ["decode", "--target", str(dirs["target"]), "--drafter", str(bad), "--prompt", "hi",
            "--max-new-tokens", "1"]
    assert main(argv) == 2
    _one_line(capsys, str(bad / "model.safetensors"), "not a valid safetensors file")


def test_export_truncated_drafter(dirs, tmp_path, capsys):
    bad = _truncated(dirs["drafter"], tmp_path / "d")
    assert main(["export", "--drafter", str(bad), "--format", "vllm", "--out", str(tmp_path / "o")]) == 2
    _one_line(capsys, str(bad / "model.safetensors"), "not a valid safetensors file")


def test_import_truncated_checkpoint(dirs, tmp_path, capsys):
    exported = tmp_path / "sg"
    assert main(["export", "--drafter", str(dirs["drafter"]), "--format", "sglang", "--out", str(exported)]) == 0
    capsys.readouterr()
    f = exported / "model.safetensors"
    os.truncate(f, f.stat().st_size - 5)
    assert main(["import", "--from", str(exported), "--out", str(tmp_path / "back")]) == 2
    _one_line(capsys, str(f), "not a valid safetensors file")


def test_cli_catches_safetensor_error_as_last_resort(dirs, tmp_path, capsys, monkeypatch):
    from safetensors import SafetensorError

    import draftsmith.stages.export as export_mod

    def boom(*a, **k):
        raise SafetensorError("Error while deserializing header: incomplete metadata")

    monkeypatch.setattr(export_mod, "import_drafter", boom)
    assert main(["import", "--from", str(dirs["drafter"]), "--out", str(tmp_path / "x")]) == 2
    _one_line(capsys, "incomplete metadata")


# --- 8a: invalid config.json names the file --------------------------------------------------------------
def test_bad_config_json_names_the_file(dirs, tmp_path, capsys):
    t = _copy(dirs["target"], tmp_path / "t")
    (t / "config.json").write_text("{not json")
    assert main(["decode", "--target", str(t), "--prompt", "hi", "--max-new-tokens", "1"]) == 2
    _one_line(capsys, str(t / "config.json"))
    d = _copy(dirs["drafter"], tmp_path / "d")
    (d / "config.json").write_text("{not json")
    argv = ["decode", "--target", str(dirs["target"]), "--drafter", str(d), "--prompt", "hi", "--max-new-tokens", "1"]
    assert main(argv) == 2
    _one_line(capsys, str(d / "config.json"))


# --- 8b: rerun advice only where a rerun helps -----------------------------------------------------------
def _conv_file(path: Path, n: int = 2) -> Path:
    lines = [json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": "the cat sat"},
                                                      {"role": "assistant", "content": "on a mat"}]})
             for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_capture_missing_weights_no_rerun_advice(dirs, tmp_path, capsys):
    t = _copy(dirs["target"], tmp_path / "t")
    (t / "model.safetensors").unlink()
    argv = ["capture", "--target", str(t), "--conversations", str(_conv_file(tmp_path / "c.jsonl")),
            "--out", str(tmp_path / "s"), "--no-progress"]
    assert main(argv) == 2
    line = _one_line(capsys, str(t))
    assert "rerun" not in line


def test_capture_store_locked_no_rerun_advice(dirs, tmp_path, capsys):
    from draftsmith.data.store import FeatureStoreWriter

    out = tmp_path / "s"
    argv = ["capture", "--target", str(dirs["target"]), "--conversations", str(_conv_file(tmp_path / "c.jsonl")),
            "--out", str(out), "--no-progress", "--draft-vocab-size", "0"]
    holder = FeatureStoreWriter(out, meta={"kind": "other"})
    try:
        code = main(argv)
    finally:
        holder.close()
    assert code != 0
    line = _one_line(capsys, "another FeatureStoreWriter")
    assert "rerun" not in line


# --- 8c: export --out onto a regular file ----------------------------------------------------------------
def test_export_out_is_a_file(dirs, tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["export", "--drafter", str(dirs["drafter"]), "--format", "vllm", "--out", str(f)]) == 2
    _one_line(capsys, str(f))


# --- 7: capture on empty / invalid input -----------------------------------------------------------------
def _capture(dirs, conv: Path, out: Path) -> int:
    return main(["capture", "--target", str(dirs["target"]), "--conversations", str(conv), "--out", str(out),
                 "--no-progress", "--draft-vocab-size", "0"])


def test_capture_empty_input_exits_2(dirs, tmp_path, capsys):
    conv = tmp_path / "empty.jsonl"
    conv.write_text("\n")
    assert _capture(dirs, conv, tmp_path / "s") == 2
    _one_line(capsys, str(conv), "no usable conversation in 0 lines")


def test_capture_all_invalid_exits_2_naming_lines(dirs, tmp_path, capsys):
    conv = tmp_path / "bad.jsonl"
    conv.write_text('{not json\n{"id": "x", "text": "unknown shape"}\n[1, 2]\n')
    assert _capture(dirs, conv, tmp_path / "s") == 2
    _one_line(capsys, str(conv), "no usable conversation in 3 lines", "line 1: invalid JSON",
                     "line 2: unknown record shape", "line 3:")


def test_capture_partly_invalid_writes_reasons(dirs, tmp_path, capsys):
    conv = _conv_file(tmp_path / "c.jsonl")
    with conv.open("a") as f:
        f.write("{not json\n")
    out = tmp_path / "s"
    assert _capture(dirs, conv, out) == 0
    captured = capsys.readouterr()
    sidecar = out.with_name(out.name + ".errors.jsonl")
    rows = [json.loads(ln) for ln in sidecar.read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["line"] == 3 and "invalid JSON" in rows[0]["reason"]
    assert "skipped 1 line" in captured.out and str(sidecar) in captured.out
    # A clean rerun leaves no stale reasons behind.
    clean = _conv_file(tmp_path / "clean.jsonl")
    assert _capture(dirs, clean, out) == 0
    assert not sidecar.exists()


# --- 10: speculators export keeps t2d --------------------------------------------------------------------
def test_speculators_export_keeps_t2d(dirs, tmp_path, capsys):
    out = tmp_path / "spec"
    argv = ["export", "--drafter", str(dirs["drafter"]), "--format", "speculators", "--out", str(out),
            "--verifier", str(dirs["target"])]
    assert main(argv) == 0
    w = load_file(str(out / "model.safetensors"))
    assert "t2d" in w and torch.equal(w["t2d"].bool(), dirs["t2d"])
    assert "d2t" in w and torch.equal(w["d2t"].long(), dirs["d2t"])
    back = tmp_path / "back"
    assert main(["import", "--from", str(out), "--out", str(back)]) == 0
    wb = load_file(str(back / "model.safetensors"))
    assert torch.equal(wb["t2d"], dirs["t2d"]) and torch.equal(wb["d2t"], dirs["d2t"])


def test_train_interrupted_says_how_to_resume(tmp_path, capsys, monkeypatch):
    """Ctrl-C in train: one line naming the kept checkpoints and --resume, exit 130, no traceback."""
    from draftsmith.stages.train import run as train_run

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_run, "train", interrupted)
    code = main(["train", "--store", str(tmp_path / "store"), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 130
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert str(tmp_path / "run" / "checkpoints") in err and "--resume" in err
