"""Issue 51 (hardening, round three): hub calls, exports, recipes and OS errors end in one line, never hang, and
leave nothing half-written. (The GGUF and llama.cpp defects are in test_hardening3_gguf.py.)"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

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



# --- 3: a hub that accepts and never answers ---------------------------------------------------------------------
@pytest.fixture
def silent_hub():
    """A loopback socket that accepts connections and never writes a byte (a stalled proxy); closed afterwards."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.2)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):  # the accept timeout: look at `stop` again
                held.append(server.accept()[0])

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    t.join(5)
    for c in held:
        c.close()
    server.close()


def _cli(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 60) -> tuple[int, str, str, float]:
    """The CLI in a child process (huggingface_hub reads HF_ENDPOINT once, at import), timed."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "draftsmith.cli", *args], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=timeout)
    return r.returncode, r.stdout, r.stderr, time.perf_counter() - t0


def _online_env(tmp_path: Path, endpoint: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_TOKEN")}
    return env | {"HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(tmp_path / "hf-cache"),
                  "HF_HUB_DISABLE_TELEMETRY": "1", **extra}


@pytest.mark.parametrize("command", ["doctor", "serve"])
def test_a_silent_hub_is_one_line_within_the_timeout(tmp_path, silent_hub, command):
    env = _online_env(tmp_path, silent_hub, DRAFTSMITH_HUB_TIMEOUT="1")
    extra = ["--drafter", "otherorg/y", "--dry-run"] if command == "serve" else []
    code, out, err, seconds = _cli([command, "--target", "someorg/x", *extra], tmp_path, env, timeout=30)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    assert "someorg/x" in lines[0] and "did not answer within 1 s" in lines[0] and "DRAFTSMITH_HUB_TIMEOUT" in err
    assert seconds < 30


def test_a_mistyped_two_part_local_path_is_refused_without_the_hub(tmp_path, silent_hub):
    (tmp_path / "runs" / "drafter").mkdir(parents=True)
    env = _online_env(tmp_path, silent_hub)  # the default deadline (30 s): the answer must come before any wait
    code, out, err, seconds = _cli(["doctor", "--target", "runs/drafterr"], tmp_path, env, timeout=30)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "runs/drafterr: no such local folder" in err and "runs/ exists" in err
    assert seconds < 20


def test_hub_timeout_setting_is_checked(monkeypatch):
    from draftsmith.stages.doctor.hub import HubResolutionError, hub_timeout

    assert hub_timeout({}) == 30 and hub_timeout({"DRAFTSMITH_HUB_TIMEOUT": "2.5"}) == 2.5
    for bad in ("0", "-1", "nan", "inf", "soon"):
        with pytest.raises(HubResolutionError, match="DRAFTSMITH_HUB_TIMEOUT"):
            hub_timeout({"DRAFTSMITH_HUB_TIMEOUT": bad})


# --- 12: OS errors -------------------------------------------------------------------------------------------------
def test_doctor_path_component_over_the_name_limit(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    llama = str(Path(__file__).parent / "fixtures" / "configs" / "llama")
    for args in (["--target", "a" * 300], ["--target", llama, "--drafter", "b" * 300],
                 ["--engine", "llamacpp", "--target", "a" * 300 + ".gguf"]):
        assert _run(["doctor", *args]) == 2
        _one_error(capsys, "too long")
    assert _run(["doctor", "--target", "org/" + "c" * 300]) == 2  # too long for a hub id too (96 at most)
    _one_error(capsys, "no such")


def test_serve_vllm_bin_that_is_not_a_program(tmp_path, capsys):
    d = tmp_path / "no-model"
    for vllm_bin in ("/etc/passwd", str(tmp_path), str(tmp_path / "missing")):
        assert _run(["serve", "--target", str(d), "--drafter", str(d), "--vllm-bin", vllm_bin]) == 2
        _one_error(capsys, "--vllm-bin")


@pytest.mark.parametrize("port", ["0", "99999", "-1"])
def test_serve_port_out_of_range(tmp_path, capsys, port):
    d = tmp_path / "no-model"
    assert _run(["serve", "--target", str(d), "--drafter", str(d), "--port", port, "--dry-run"]) == 2
    _one_error(capsys, "--port")


# --- 5: export --force over an existing export swaps whole directories ------------------------------------------
class _Killed(BaseException):
    """A kill at a chosen point (BaseException: no except-Exception clause swallows it)."""


def _files(d: Path, *where: Path) -> dict[str, bytes]:
    """A directory's files by name. The model card names the export's own path: that (``d``, or the ``where``
    paths a copied export was written at) reads as OUT."""
    import re

    from draftsmith.stages.export.card import shown_path

    if not d.is_dir():
        return {}
    paths = sorted((str(p.resolve()).encode() for p in (where or (d,))), key=len, reverse=True)
    # the card's serve lines show a path outside the working directory by its name (card.shown_path)
    shown = [re.compile(rb"(?<![\w./-])" + re.escape(shown_path(p).encode()) + rb"(?![\w./-])")
             for p in (where or (d,))]

    def norm(b: bytes) -> bytes:
        for here in paths:
            b = b.replace(here, b"OUT")
        for name in shown:
            b = name.sub(b"OUT", b)
        return b
    return {p.name: norm(p.read_bytes()) for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def two_exports(tmp_path_factory):
    """Drafters A and B for one tiny target, differing in weights and aux layer ids, and their clean exports."""
    import torch
    from conftest import tiny_target

    from draftsmith.model.drafter import new_drafter
    from draftsmith.stages.export import export_drafter

    root = tmp_path_factory.mktemp("swap")
    target = tiny_target("llama", torch.float32)
    a = new_drafter(target, seed=0)
    b = new_drafter(target, seed=1)
    b.config.aux_layer_ids = (1, 3, 5)
    for name, d in (("a", a), ("b", b)):
        d.save(root / name)
        export_drafter(root / name, root / f"ref-{name}", "vllm")
    return root


def _kill_at(monkeypatch, n: int, calls: list[str]) -> None:
    """Raise _Killed at the n-th file system step of an export (writes, renames, links, removals, the swap)."""
    import shutil as shutil_mod

    from draftsmith.core import io as io_mod

    def wrap(owner, name):
        real = getattr(owner, name)

        def step(*a, **k):
            calls.append(name)
            if len(calls) - 1 == n:
                raise _Killed(name)
            return real(*a, **k)

        monkeypatch.setattr(owner, name, step)

    import safetensors.torch

    wrap(safetensors.torch, "save_file")  # Eagle3Drafter.save (import) writes through these two
    wrap(Path, "write_text")
    wrap(io_mod, "write_file_durably")
    wrap(io_mod, "_exchange")
    wrap(os, "replace")
    wrap(os, "link")
    wrap(shutil_mod, "rmtree")


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_a_kill_during_export_force_leaves_the_old_or_the_new_export(two_exports, tmp_path, monkeypatch, exchange):
    from draftsmith.core import io as io_mod
    from draftsmith.core.io import restore_dir
    from draftsmith.stages.export import export_drafter

    root = two_exports
    old, new = _files(root / "ref-a"), _files(root / "ref-b")
    assert old != new and set(old) == set(new) == {"config.json", "model.safetensors", "draftsmith-export.json",
                                                   "README.md", "drafter_card.json"}
    if not exchange:
        monkeypatch.setattr(io_mod, "_exchange", lambda a, b: False)
    seen = set()
    for n in range(100):
        out = tmp_path / f"run{n}" / "out"
        out.parent.mkdir()
        shutil.copytree(root / "ref-a", out)
        (out / "NOTES.md").write_text("the user's notes")
        calls: list[str] = []
        with monkeypatch.context() as m:
            _kill_at(m, n, calls)
            try:
                export_drafter(root / "b", out, "vllm", overwrite=True)
                finished = True
            except _Killed:
                finished = False
        now = {k: v for k, v in _files(out, out, root / "ref-a").items() if k != "NOTES.md"}
        if not now:  # the two-rename route, killed between its renames: the old export waits aside, complete
            aside = _files(io_mod.aside_dir(out), out, root / "ref-a")
            assert not exchange and aside == old | {"NOTES.md": b"the user's notes"}
        else:
            assert now in (old, new), (n, calls)
            seen.add("old" if now == old else "new")
        restore_dir(out)  # what the next export does first
        now = _files(out, out, root / "ref-a")
        assert now.pop("NOTES.md") == b"the user's notes"
        assert now in (old, new), (n, calls)
        if finished:
            assert now == new and not list(out.parent.glob(".out.*")), list(out.parent.iterdir())
            break
    else:
        raise AssertionError("the export never finished")
    assert seen == {"old", "new"} and n >= 4


@pytest.mark.parametrize("where", ["under-a-file", "unwritable"])
def test_export_out_that_cannot_be_written(two_exports, tmp_path, capsys, where):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "sub" / "out" if where == "under-a-file" else Path("/sys/draftsmith-h51b/out")
    assert _run(["export", "--drafter", str(two_exports / "a"), "--format", "vllm", "--out", str(out)]) == 2
    _one_error(capsys, str(out) if where == "under-a-file" else "/sys/draftsmith-h51b")
    assert not Path("/sys/draftsmith-h51b").exists()


def test_export_through_a_symlinked_out_keeps_the_link(two_exports, tmp_path):
    from draftsmith.stages.export import export_drafter

    real = tmp_path / "real"
    shutil.copytree(two_exports / "ref-a", real)
    (tmp_path / "link").symlink_to(real)
    export_drafter(two_exports / "b", tmp_path / "link", "vllm", overwrite=True)
    assert (tmp_path / "link").is_symlink() and _files(real, tmp_path / "link") == _files(two_exports / "ref-b")


# --- 8: a target GGUF without (all of) its tensors -------------------------------------------------------------
_TINY = {"llama.block_count": 4, "llama.embedding_length": 64, "llama.feed_forward_length": 128,
         "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2, "llama.rope.dimension_count": 16}


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """The embedded default's GGUF metadata (tokenizer included) shrunk to a 4-layer, 64-wide llama: with no
    tensors at all, and with only its embedding (every other weight missing)."""
    import numpy as np
    from gguf import GGUFValueType, GGUFWriter

    from draftsmith.core.gguf_file import open_gguf
    from draftsmith.model.sources import smollm2_gguf_path
    from draftsmith.stages.export.gguf import copy_field

    root = tmp_path_factory.mktemp("gguf")
    reader = open_gguf(smollm2_gguf_path())
    vocab = int(reader.fields["llama.vocab_size"].contents())
    out = {}
    for name, tensors in (("empty", {}), ("embedding-only", {"token_embd.weight": np.zeros((vocab, 64), np.float16)})):
        w = GGUFWriter(root / f"{name}.gguf", "llama")
        for key, f in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            if key in _TINY:
                w.add_key_value(key, _TINY[key], GGUFValueType.UINT32)
            else:
                copy_field(w, f)
        for t_name, array in tensors.items():
            w.add_tensor(t_name, array)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        out[name] = root / f"{name}.gguf"
    return out


def test_gguf_without_tensors_is_refused_by_decode_capture_and_train(ggufs, tmp_path, capsys):
    target = str(ggufs["empty"])
    convs = tmp_path / "c.jsonl"
    convs.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}, '
                     '{"role": "assistant", "content": "hello"}]}\n')
    for argv in (["decode", "--target", target, "--prompt", "hi", "--max-new-tokens", "2"],
                 ["capture", "--target", target, "--conversations", str(convs), "--out", str(tmp_path / "s"),
                  "--no-progress"],
                 ["train", "--target", target, "--conversations", str(convs), "--out", str(tmp_path / "r"),
                  "--max-steps", "1", "--no-progress", "--no-plot"]):
        assert _run(argv) == 2, argv
        _one_error(capsys, "no tensors", "random weights")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


@pytest.mark.slow  # seconds of model loading / two torchrun ranks: the slow suite
def test_gguf_missing_most_weights_is_refused_at_load(ggufs):
    from draftsmith.model.target import TargetError, load_target

    with pytest.raises(TargetError, match=r"lacks \d+ of the model's weights .*random weights"):
        load_target(ggufs["embedding-only"])


# --- 9: a target with no usable tokenizer ------------------------------------------------------------------------
def _tokenized_target(tmp_path: Path) -> Path:
    from test_doctor_hub import target_files

    d = tmp_path / "target"
    d.mkdir()
    for name, data in target_files(tmp_path).items():
        (d / name).write_bytes(data)
    return d


def _doctor_ids(target):
    from draftsmith.stages.doctor.diagnosis import diagnose

    report = diagnose(target, engine_version="0.32")
    return report, report.ids("error")


def test_a_complete_tokenizer_passes(tmp_path):
    report, errors = _doctor_ids(_tokenized_target(tmp_path))
    assert errors == [] and report.exit_code == 0, report.summary()


@pytest.mark.parametrize("tokenizer_class", [None, "TokenizersBackend"])
def test_tokenizer_json_deleted_is_a_finding(tmp_path, tokenizer_class):
    t = _tokenized_target(tmp_path)
    (t / "tokenizer.json").unlink()
    if tokenizer_class:
        cfg = json.loads((t / "tokenizer_config.json").read_text()) | {"tokenizer_class": tokenizer_class}
        (t / "tokenizer_config.json").write_text(json.dumps(cfg))
    report, errors = _doctor_ids(t)
    assert errors == ["tokenizer.no-vocabulary"] and report.exit_code == 1, report.summary()
    if tokenizer_class:
        assert "TokenizersBackend reads tokenizer.json" in report.summary()


def test_dangling_tokenizer_symlink_is_a_finding(tmp_path):
    t = _tokenized_target(tmp_path)
    (t / "tokenizer.json").unlink()
    (t / "tokenizer.json").symlink_to(tmp_path / "gone" / "tokenizer.json")
    report, errors = _doctor_ids(t)
    assert errors == ["tokenizer.unreadable"] and report.exit_code == 1, report.summary()
    assert "symlink to a missing file" in report.summary()


def test_dangling_tokenizer_symlink_in_the_hub_cache_is_a_finding(tmp_path, monkeypatch, capsys):
    from test_doctor_hub import TARGET_SHA, cache_repo, target_files

    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snap = cache_repo(cache, "org/target", TARGET_SHA, target_files(tmp_path))
    (snap / "tokenizer.json").resolve().unlink()  # the blob went (a cache cleaned by hand), the link stayed
    assert main(["doctor", "--target", "org/target", "--engine-version", "0.32"]) == 1
    out = capsys.readouterr().out
    assert "tokenizer.unreadable" in out and "symlink to a missing file" in out, out


# --- also worth fixing ----------------------------------------------------------------------------------------
LLAMA_FIXTURE = Path(__file__).parent / "fixtures" / "configs" / "llama"


@pytest.mark.parametrize("version, profile", [("1.5", "0.32"), ("2.0", "0.32"), ("0.32", "0.32"), ("0.11", "legacy")])
def test_engine_version_past_every_table_uses_the_newest_facts(version, profile):
    from draftsmith.stages.doctor.diagnosis import diagnose

    assert diagnose(LLAMA_FIXTURE, engine_version=version).engine_profile == profile


def test_help_with_a_recipe_lacking_the_commands_section(capsys):
    recipe = Path(__file__).parents[1] / "recipes" / "dense-8b.toml"
    assert _run(["decode", "--config", str(recipe), "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: draftsmith decode")


def test_train_reads_a_recipe_by_the_rules_of_the_other_commands(tmp_path, capsys):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[train]\nstore = "nowhere"\n[trian]\nmax_steps = 1\n')
    assert _run(["train", "--config", str(recipe)]) == 2
    _one_error(capsys, "unknown section [trian]", "did you mean [train]")
    recipe.write_text('[generate]\nlimit = 1\n')
    assert _run(["train", "--config", str(recipe)]) == 2
    _one_error(capsys, "no [train] section")
    recipe.write_text(f'[train]\nstore = "{tmp_path / "nowhere"}"\nttt-steps = "2"\n[generate]\nlimit = 1\n')
    assert _run(["train", "--config", str(recipe)]) == 2  # the string int and the kebab key are taken: the store
    _one_error(capsys, "nowhere")                          # is what is missing


def test_gguf_export_error_counts_the_files_it_found(two_exports, tmp_path, capsys):
    (tmp_path / "t").mkdir()
    assert _run(["export", "--drafter", str(two_exports / "a"), "--format", "gguf", "--target", str(tmp_path / "t"),
                 "--out", str(tmp_path / "d.gguf")]) == 2
    assert "found 0 in that directory" in _one_error(capsys)


# --- leftovers ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A tiny target, a few conversations and a small store captured from them."""
    from draftsmith.testing.models import save_tiny_target, tiny_chat_corpus

    root = tmp_path_factory.mktemp("leftovers")
    target = save_tiny_target(root / "target")
    convs = root / "convs.jsonl"
    convs.write_text("".join(json.dumps({"id": f"c{i}", "messages": m}) + "\n"
                             for i, m in enumerate(tiny_chat_corpus(8))))
    store = root / "store"
    assert main(["capture", "--target", str(target), "--conversations", str(convs), "--out", str(store),
                 "--max-length", "128", "--draft-vocab-size", "64", "--no-progress"]) == 0
    return {"target": target, "convs": convs, "store": store}


def test_generate_leaves_no_lock_file(ws, tmp_path):
    out = tmp_path / "g.jsonl"
    assert main(["generate", "--input", str(ws["convs"]), "--target", str(ws["target"]), "--out", str(out),
                 "--max-new-tokens", "2", "--limit", "1", "--no-progress"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.jsonl"]


def test_a_lock_removed_on_release_still_excludes(tmp_path):
    from draftsmith.core.io import ExclusiveLock, LockHeld

    path = tmp_path / ".x.lock"
    a = ExclusiveLock(path, "x")
    with pytest.raises(LockHeld):
        ExclusiveLock(path, "x")
    a.release(remove=True)
    assert not path.exists()
    b = ExclusiveLock(path, "x")  # a fresh file, locked
    with pytest.raises(LockHeld):
        ExclusiveLock(path, "x")
    b.release(remove=True)


def test_refused_grad_accum_leaves_no_out(ws, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--target", str(ws["target"]), "--store", str(ws["store"]), "--out", str(out),
                 "--grad-accum", "1000", "--batch-tokens", "256", "--no-progress", "--no-plot"]) == 2
    _one_error(capsys, "--grad-accum 1000")
    assert not out.exists()


# --- torchrun: one summary; a resume by another process count is refused --------------------------------------
@pytest.mark.slow  # seconds of model loading / two torchrun ranks: the slow suite
def test_torchrun_prints_one_summary_and_a_resume_needs_the_same_ranks(ws, tmp_path):
    out = tmp_path / "run"
    args = ["train", "--target", str(ws["target"]), "--store", str(ws["store"]), "--out", str(out),
            "--max-steps", "2", "--batch-tokens", "128", "--ttt-steps", "1", "--save-every", "1", "--eval-every",
            "100", "--device", "cpu", "--no-progress", "--no-plot", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # --standalone: the rendezvous on a free port of torchrun's own choosing, as the other torchrun tests do
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "draftsmith.cli", *args, "--stop-at-step", "1"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summaries = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert len(summaries) == 1 and json.loads(summaries[0])["steps"] == 1, r.stdout
    code, _, err, _ = _cli([*args, "--resume"], tmp_path, env, timeout=300)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "trained by 2 process(es)" in err and "this run has 1" in err


def test_a_killed_runs_temp_dir_goes_at_the_next_start(tmp_path, monkeypatch):
    import signal
    import tempfile

    from draftsmith.core.io import process_temp_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); from draftsmith.core.io import process_temp_dir\n"
            "with process_temp_dir('draftsmith-gguf-') as d:\n"
            "    (d / 'drafter.gguf').write_bytes(b'x' * 1000); print(d, flush=True); time.sleep(60)\n")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", code, str(Path(__file__).parents[1] / "src")], env=env,
                            stdout=subprocess.PIPE, text=True)
    killed = Path(proc.stdout.readline().strip())
    assert killed.parent == tmp_path and (killed / "drafter.gguf").is_file()
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    proc.stdout.close()
    live = tmp_path / f"draftsmith-gguf-{os.getppid()}-keep"  # a live process's directory stays
    live.mkdir()
    with process_temp_dir("draftsmith-gguf-") as d:
        assert d.is_dir() and not killed.exists() and live.is_dir()
    assert not d.exists()


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_a_kill_during_import_force_leaves_the_old_or_the_new_import(two_exports, tmp_path, monkeypatch, exchange):
    """import --force over an older import: the same swap as the export's."""
    from draftsmith.core import io as io_mod
    from draftsmith.core.io import restore_dir
    from draftsmith.stages.export import import_drafter

    root = two_exports
    import_drafter(root / "ref-a", tmp_path / "ref-a")
    import_drafter(root / "ref-b", tmp_path / "ref-b")
    old, new = _files(tmp_path / "ref-a"), _files(tmp_path / "ref-b")
    assert old != new and set(old) == set(new) == {"config.json", "model.safetensors"}
    if not exchange:
        monkeypatch.setattr(io_mod, "_exchange", lambda a, b: False)
    seen = set()
    for n in range(100):
        out = tmp_path / f"run{n}" / "out"
        shutil.copytree(tmp_path / "ref-a", out)
        calls: list[str] = []
        with monkeypatch.context() as m:
            _kill_at(m, n, calls)
            try:
                import_drafter(root / "ref-b", out, overwrite=True)
                finished = True
            except _Killed:
                finished = False
        now = _files(out)
        assert now in (old, new) or (not now and not exchange and _files(io_mod.aside_dir(out)) == old), (n, calls)
        restore_dir(out)
        assert _files(out) in (old, new), (n, calls)
        seen.add("old" if _files(out) == old else "new")
        if finished:
            assert _files(out) == new and not list(out.parent.glob(".out.*"))
            break
    else:
        raise AssertionError("the import never finished")
    assert seen == {"old", "new"} and n >= 2
