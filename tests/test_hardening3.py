"""Issue 51 (hardening, round three): hub calls, exports, recipes and OS errors end in one line, never hang, and
leave nothing half-written. (The GGUF and llama.cpp defects are in test_hardening3_gguf.py.)"""

from __future__ import annotations

import pytest

from draftsmith.app.cli import parse_args
from draftsmith.cli import main


def _run(argv: list[str]) -> int:
    """main's exit code, also when argparse exits (a parse error is SystemExit(2))."""
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code or 0)


def _one_error(capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "error:" in err[0], err
    for n in needles:
        assert n in err[0], err
    return err[0]


# --- 13: abbreviated flags ----------------------------------------------------------------------------------------
def test_abbreviated_config_is_refused_not_ignored(tmp_path, capsys):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[doctor]\nengine = "llamacpp"\n')
    assert parse_args(["doctor", "--target", "t", "--config", str(recipe)]).engine == "llamacpp"
    with pytest.raises(SystemExit) as e:  # argparse took --co for --config while the recipe scanner did not
        parse_args(["doctor", "--target", "t", "--co", str(recipe)])
    assert e.value.code == 2
    _one_error(capsys, "--co")
    with pytest.raises(SystemExit):  # no flag takes abbreviations (a prefix changes meaning as flags are added)
        parse_args(["doctor", "--targ", "t"])
    _one_error(capsys, "--targ")


def test_full_config_flag_still_applies_the_recipe(tmp_path, capsys):
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[doctor]\ntarget = "{tmp_path / "nope"}"\n')
    assert _run(["doctor", "--config", str(recipe)]) == 2
    _one_error(capsys, "nope")


# --- 10: NaN and infinite floats -------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400"])
def test_demo_minutes_must_be_finite(tmp_path, capsys, value):
    work = tmp_path / "demo"
    assert _run(["demo", "--preset", "tiny", "--workdir", str(work), f"--minutes={value}"]) == 2
    _one_error(capsys, "--minutes", "finite")
    assert not work.exists()  # refused before any stage ran


@pytest.mark.parametrize("value", ["nan", '"inf"', "inf"])
def test_demo_minutes_must_be_finite_in_a_recipe(tmp_path, capsys, value):
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[demo]\npreset = "tiny"\nminutes = {value}\n')
    work = tmp_path / "demo"
    assert _run(["demo", "--config", str(recipe), "--workdir", str(work)]) == 2
    _one_error(capsys, "minutes", "finite")
    assert not work.exists()


def test_run_demo_refuses_a_nan_budget(tmp_path):
    from draftsmith.app.demo import run_demo
    from draftsmith.core.errors import UsageError

    with pytest.raises(UsageError, match="finite"):
        run_demo("tiny", tmp_path / "demo", minutes=float("nan"))
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize("argv", [
    ["decode", "--prompt", "x", "--temperature", "nan"],
    ["decode", "--prompt", "x", "--top-p", "inf"],
    ["capture", "--conversations", "c.jsonl", "--out", "s", "--shard-mb", "inf"],
    ["capture", "--conversations", "c.jsonl", "--out", "s", "--kv-cache-gib", "nan"],
    ["generate", "--self-prompt", "1", "--out", "o.jsonl", "--timeout", "inf"],
    ["train", "--store", "s", "--lr", "nan"],
    ["bench", "--drafter", "d", "--temperature", "0,nan"],
])
def test_float_options_must_be_finite(tmp_path, capsys, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    assert _run(argv) == 2
    _one_error(capsys, "finite")
    assert list(tmp_path.iterdir()) == []


def test_capture_shard_mb_beyond_any_machine_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _run(["capture", "--conversations", "c.jsonl", "--out", "s", "--shard-mb", "1e300"]) == 2
    _one_error(capsys, "--shard-mb")
    assert list(tmp_path.iterdir()) == []

