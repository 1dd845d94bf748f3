"""`doctor`/`serve` with hub ids (ORG/NAME[@REVISION]) and metadata-only targets, from a fake Hugging Face cache
written here (the layout huggingface_hub writes: refs/main, snapshots/<sha>/ symlinks into blobs/). No network:
HF_HUB_OFFLINE is set, and the online route is exercised with huggingface_hub's calls replaced.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import sys
from fnmatch import fnmatch
from pathlib import Path
from types import SimpleNamespace

import pytest

from draftsmith.cli import main
from draftsmith.core import vllm_facts
from draftsmith.core.pysource import VllmSource
from draftsmith.stages.doctor import hub as hub_mod
from draftsmith.stages.doctor.diagnosis import diagnose
from draftsmith.stages.doctor.hub import hub_cache_dir, parse_hub_id
from draftsmith.testing.tokenizer import make_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "configs"
TARGET_SHA = "a" * 40
DRAFTER_SHA = "b" * 40
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
REAL_FROM_HUB = hub_mod._from_hub  # the autouse fixture replaces it; the online test puts it back


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """No installed vLLM (tests state the version), an empty cache of our own, and no way to reach the hub."""
    monkeypatch.setattr(VllmSource, "installed", classmethod(lambda cls: None))
    monkeypatch.setattr(vllm_facts, "installed_vllm_version", lambda: None)
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_network(*a, **k):
        raise AssertionError("doctor reached for the hub while offline")

    monkeypatch.setattr(hub_mod, "_from_hub", no_network)
    return cache


# --- a fake cache, as huggingface_hub lays it out ----------------------------------------------------------------
def cache_repo(cache: Path, repo_id: str, commit: str, files: dict[str, bytes | Path], symlink: bool = True) -> Path:
    """models--ORG--NAME/{refs/main, blobs/<hash>, snapshots/<commit>/<file> -> ../../blobs/<hash>}."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, content in files.items():
        data = content.read_bytes() if isinstance(content, Path) else content
        if not symlink:
            (snap / name).write_bytes(data)
            continue
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if isinstance(content, Path):  # keep sparse files sparse
            shutil.copyfile(content, blob)
        else:
            blob.write_bytes(data)
        (snap / name).symlink_to(Path("../../blobs") / blob.name)
    return snap


def target_files(tmp_path: Path, *, index: bool = True) -> dict[str, bytes]:
    """config + tokenizer files of a tiny Llama target (vocab fitted to the tokenizer) and its shard index."""
    tok_dir = tmp_path / "tok"
    tok = make_tokenizer("chatml")
    tok.save_pretrained(tok_dir)
    cfg = json.loads((FIXTURES / "llama" / "config.json").read_text()) | {"vocab_size": len(tok)}
    files = {p.name: p.read_bytes() for p in tok_dir.iterdir()}
    files["config.json"] = json.dumps(cfg).encode()
    files["generation_config.json"] = b'{"bos_token_id": 1, "eos_token_id": 2}'
    if index:
        files["model.safetensors.index.json"] = json.dumps({"metadata": {"total_size": 1}, "weight_map": {
            "model.embed_tokens.weight": SHARDS[0], "lm_head.weight": SHARDS[1]}}).encode()
    return files


def drafter_config(vocab: int) -> bytes:
    cfg = json.loads((FIXTURES / "drafters" / "llama-eagle3" / "config.json").read_text())
    cfg["vocab_size"] = vocab
    cfg["draftsmith"]["target"]["vocab_size"] = vocab
    return json.dumps(cfg).encode()


@pytest.fixture
def cached_pair(tmp_path, offline):
    """org/target (configs, tokenizer, index; no shards) and org/drafter (config only) in the fake cache."""
    files = target_files(tmp_path)
    target = cache_repo(offline, "org/target", TARGET_SHA, files)
    vocab = json.loads(files["config.json"])["vocab_size"]
    drafter = cache_repo(offline, "org/drafter", DRAFTER_SHA, {"config.json": drafter_config(vocab)})
    return target, drafter


def doctor(capsys, *args) -> tuple[int, str, str]:
    code = main(["doctor", *args, "--engine-version", "0.32"])
    out, err = capsys.readouterr()
    return code, out, err


# --- hub ids from the cache ----------------------------------------------------------------------------------------
def test_cached_metadata_only_pair_exits_0_with_weights_not_checked(cached_pair, capsys):
    code, out, err = doctor(capsys, "--target", "org/target", "--drafter", "org/drafter")
    assert code == 0, out + err
    assert "target weights not checked" in out and "2 of the 2 shard(s)" in out
    assert "drafter weights not checked" in out and "nothing blocks" in out
    assert "org/target (Hugging Face cache, snapshot aaaaaaaaaaaa)" in out
    code, out, _ = doctor(capsys, "--target", "org/target", "--drafter", "org/drafter", "--json")
    report = json.loads(out)
    assert code == 0 and report["findings"] == [] and len(report["notes"]) == 2, report
    assert report["facts"]["layers_path"] == "model.layers"  # checked fully: the decoder was found


def test_metadata_only_doctor_never_imports_torch(cached_pair, offline):
    """What keeps a hub check to about a second: no torch (its import alone costs seconds) when no weights are read."""
    import subprocess
    import sys

    code = ("import sys; from draftsmith.cli import main; "
            "rc = main(['doctor', '--target', 'org/target', '--drafter', 'org/drafter', '--engine-version', '0.32']); "
            "print('TORCH', 'torch' in sys.modules); sys.exit(rc)")
    env = {**os.environ, "HF_HUB_CACHE": str(offline), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TORCH False" in done.stdout, done.stdout


def test_revision_and_real_files_in_the_snapshot(cached_pair, capsys):
    code, out, _ = doctor(capsys, "--target", f"org/target@{TARGET_SHA}")
    assert code == 0 and "weights not checked" in out
    code, _, err = doctor(capsys, "--target", "org/target@v9")
    assert code == 2 and "org/target@v9" in err and "--revision v9" in err


def test_hub_id_not_in_cache_is_one_line_exit_2(cached_pair, capsys):
    code, out, err = doctor(capsys, "--target", "org/missing")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert 'hf download org/missing --include "*.json" "tokenizer*"' in err and "HF_HUB_OFFLINE" in err
    code, _, err = doctor(capsys, "--target", "org/target", "--drafter", "org/nodrafter")
    assert code == 2 and "org/nodrafter" in err and len(err.strip().splitlines()) == 1


def test_a_local_path_wins_over_the_cache(cached_pair, tmp_path, monkeypatch, capsys):
    local = tmp_path / "cwd" / "org" / "target"
    shutil.copytree(FIXTURES / "llama", local)
    (local / "config.json").write_text(json.dumps(json.loads((local / "config.json").read_text()) | {
        "architectures": []}))
    monkeypatch.chdir(tmp_path / "cwd")
    report = diagnose("org/target", engine_version="0.32")
    assert report.target == "org/target" and "target.architecture" in report.ids("error")


def test_truncated_present_shard_in_the_cache_is_still_an_error(tmp_path, offline, capsys):
    from test_doctor import write_safetensors

    shard = tmp_path / "shard.safetensors"
    write_safetensors(shard, {}, {"lm_head.weight": ("BF16", (515, 128))})
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(shard.read_bytes()[:-7])
    cache_repo(offline, "org/target", TARGET_SHA, target_files(tmp_path) | {SHARDS[1]: cut})
    code, out, _ = doctor(capsys, "--target", "org/target")
    assert code == 1 and "ERROR   target.weights" in out and "truncated" in out and SHARDS[1] in out
    assert "1 of the 2 shard(s)" in out  # the absent one is a note, not the error


def test_cached_drafter_with_weights_is_checked(tmp_path, cached_pair, offline, capsys):
    from test_doctor import write_drafter_weights

    vocab = json.loads((cached_pair[0] / "config.json").read_text())["vocab_size"]
    d = tmp_path / "drafter-src"
    d.mkdir()
    (d / "config.json").write_bytes(drafter_config(vocab))
    write_drafter_weights(d, drop=("fc.weight",))
    cache_repo(offline, "org/drafter2", DRAFTER_SHA, {"config.json": d / "config.json",
                                                      "model.safetensors": d / "model.safetensors"})
    code, out, _ = doctor(capsys, "--target", "org/target", "--drafter", "org/drafter2")
    assert code == 1 and "weights.missing" in out and "fc.weight" in out and "drafter weights" not in out


@pytest.mark.parametrize("listing, want", [
    (None, "note"), (("config.json", "model.safetensors"), "note"),
    (("config.json", "pytorch_model.bin"), "target.pickle-weights"), (("config.json", "README.md"), "target.weights"),
])
def test_cached_target_without_index_or_weights(tmp_path, offline, monkeypatch, listing, want):
    """No index and no weights in a hub snapshot: the cached repo listing says what the repo has, else a note."""
    cache_repo(offline, "org/single", TARGET_SHA, target_files(tmp_path, index=False))
    monkeypatch.setattr(hub_mod, "_cached_listing", lambda *a: listing)
    report = diagnose("org/single", engine_version="0.32")
    if want == "note":
        assert report.findings == [] and report.exit_code == 0, report.summary()
        assert "target weights not checked" in report.notes[0]
    else:
        assert want in report.ids(None) and report.notes == [], report.summary()
    assert report.exit_code == (1 if want == "target.weights" else 0)


def test_listing_cached_by_huggingface_hub_is_read(tmp_path, offline):
    """huggingface_hub's own tree cache (written on download) lists a pickle-only repo; a listed metadata file
    missing from the snapshot (an incomplete snapshot to huggingface_hub) does not stop the check."""
    tree_cache = pytest.importorskip("huggingface_hub._tree_cache")
    snap = cache_repo(offline, "org/pickled", TARGET_SHA, target_files(tmp_path, index=False))
    listing = ["config.json", "pytorch_model.bin", "special_tokens_map.json", *(p.name for p in snap.iterdir())]
    tree_cache.write_tree_cache(str(snap.parents[1]), TARGET_SHA, {
        name: tree_cache.TreeCacheEntry(size=1, blob_id="0" * 40) for name in listing})
    report = diagnose("org/pickled", engine_version="0.32")
    assert report.ids("warning") == ["target.pickle-weights"], report.summary()
    assert "in the repository" in report.summary() and report.exit_code == 0


# --- the online route, with huggingface_hub's calls replaced -----------------------------------------------------
def test_online_fetches_metadata_only_and_reads_headers(tmp_path, monkeypatch, offline):
    import huggingface_hub
    from test_doctor import write_drafter_weights

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hub_mod, "_from_hub", REAL_FROM_HUB)
    files = target_files(tmp_path)
    vocab = json.loads(files["config.json"])["vocab_size"]
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "config.json").write_bytes(drafter_config(vocab))
    write_drafter_weights(staged, drop=("norm.weight",))
    from draftsmith.core.tensorfile import read_safetensors_header

    drafter_header = read_safetensors_header(staged / "model.safetensors")
    asked = []

    def snapshot_download(repo_id, *, revision=None, cache_dir=None, local_files_only=False, allow_patterns=None,
                          **kw):
        asked.append((repo_id, local_files_only, tuple(allow_patterns or ())))
        if local_files_only:
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        for weight in ("model-00001-of-00002.safetensors", "model.safetensors", "pytorch_model.bin",
                       "consolidated.safetensors", "model.pt"):
            assert not any(fnmatch(weight, p) for p in allow_patterns), (weight, allow_patterns)
        repo_files = files if repo_id == "org/target" else {"config.json": staged / "config.json"}
        return str(cache_repo(Path(cache_dir), repo_id, TARGET_SHA, repo_files))

    def get_safetensors_metadata(repo_id, revision=None, **kw):
        header = {k: SimpleNamespace(dtype=v.dtype, shape=list(v.shape), data_offsets=(v.start, v.end))
                  for k, v in drafter_header.items()}
        name = "model.safetensors" if repo_id == "org/drafter" else SHARDS[0]
        return SimpleNamespace(files_metadata={name: SimpleNamespace(tensors=header)})

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", get_safetensors_metadata)
    report = diagnose("org/target", "org/drafter", engine_version="0.32")
    assert {a[0] for a in asked if not a[1]} == {"org/target", "org/drafter"}
    assert "(hub metadata, snapshot" in report.target
    # the drafter's tensor names came from the hub's header: the dropped norm is found without any download
    assert "weights.missing" in report.ids("error") and "norm.weight" in report.summary(), report.summary()
    assert any("headers were read" in n for n in report.notes), report.notes
    assert not [p for p in offline.rglob("*") if p.name.endswith((".safetensors", ".bin"))]  # no weights came


# --- local folders: issue 44 defect 12 ---------------------------------------------------------------------------
def local_target(tmp_path: Path, *, index: bool) -> Path:
    d = tmp_path / "target"
    d.mkdir()
    for name, data in target_files(tmp_path, index=index).items():
        (d / name).write_bytes(data)
    return d


def test_local_metadata_only_target_is_exit_0_with_a_note(tmp_path):
    report = diagnose(local_target(tmp_path, index=True), engine_version="0.32")
    assert report.exit_code == 0 and report.findings == [], report.summary()
    assert "an engine loading this folder needs the shards" in report.notes[0]


def test_local_target_without_weights_or_index_is_an_error(tmp_path):
    report = diagnose(local_target(tmp_path, index=False), engine_version="0.32")
    assert report.ids("error") == ["target.weights"] and report.exit_code == 1
    assert "nothing blocks" not in report.summary() and "metadata-only copy keeps" in report.summary()


def test_local_target_missing_some_shards_is_an_error(tmp_path):
    from test_doctor import write_safetensors

    d = local_target(tmp_path, index=True)
    write_safetensors(d / SHARDS[0], {}, {"model.embed_tokens.weight": ("BF16", (515, 128))})
    report = diagnose(d, engine_version="0.32")
    assert report.ids("error") == ["target.weights"] and "1 of the 2 shard(s)" in report.summary()
    assert report.notes == []


@pytest.mark.parametrize("bad", [["../outside.safetensors"], [5], "not a map"])
def test_index_naming_files_outside_the_folder_or_not_names_is_an_error(tmp_path, bad):
    d = local_target(tmp_path, index=True)
    (tmp_path / "outside.safetensors").write_bytes(b"\0" * 8)
    weight_map = {"lm_head.weight": bad[0]} if isinstance(bad, list) else bad
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    report = diagnose(d, engine_version="0.32")
    assert report.ids("error") == ["target.weights"] and report.notes == [], report.summary()


@pytest.mark.parametrize("engine, severity", [("vllm", "warning"), ("sglang", "warning"), ("draftsmith", "error")])
def test_pickle_only_target_severity_follows_the_engine(tmp_path, engine, severity):
    d = local_target(tmp_path, index=False)
    (d / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not unpickled by doctor")
    report = diagnose(d, engine=engine, engine_version="0.32")
    [f] = [f for f in report.findings if f.id == "target.pickle-weights"]
    assert f.severity == severity and "pytorch_model.bin" in f.evidence, report.summary()
    assert "never unpickle" in f.message
    assert report.exit_code == (1 if severity == "error" else 0)


def test_truncated_tokenizer_json_is_an_error(tmp_path):
    d = local_target(tmp_path, index=True)
    raw = (d / "tokenizer.json").read_bytes()
    (d / "tokenizer.json").write_bytes(raw[: len(raw) // 2])
    report = diagnose(d, engine_version="0.32")
    assert "tokenizer.unreadable" in report.ids("error") and report.exit_code == 1, report.summary()
    assert "tokenizer.json" in report.summary()


# --- serve: hub ids pass doctor, and vllm serve gets them unchanged ----------------------------------------------
def test_serve_passes_hub_ids_to_vllm(cached_pair, tmp_path, capsys):
    fake = tmp_path / "vllm"
    fake.write_text(f"#!{sys.executable}\nimport sys\nsys.exit(7)\n")
    fake.chmod(0o755)
    code = main(["serve", "--target", f"org/target@{TARGET_SHA}", "--drafter", "org/drafter", "--engine-version",
                 "0.32", "--vllm-bin", str(fake), "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 0, err
    argv = shlex.split(out.strip())
    assert argv[:3] == [str(fake), "serve", "org/target"]
    assert json.loads(argv[4])["model"] == "org/drafter" and "revision" not in json.loads(argv[4])
    assert argv[5:7] == ["--revision", TARGET_SHA]
    assert "weights not checked" in err and "nothing blocks" in err


# --- the pieces ----------------------------------------------------------------------------------------------------
def test_parse_hub_id_and_cache_dir():
    assert parse_hub_id("Qwen/Qwen3-8B") == hub_mod.HubRef("Qwen/Qwen3-8B", None)
    assert parse_hub_id("org/name@v1.0") == hub_mod.HubRef("org/name", "v1.0")
    for not_hub in ("/abs/path", "./a/b", "a/b/c", "smollm2", "../x", "a/..", ""):
        assert parse_hub_id(not_hub) is None, not_hub
    assert hub_cache_dir({"HF_HUB_CACHE": "/c", "HF_HOME": "/h"}) == Path("/c")
    assert hub_cache_dir({"HF_HOME": "/h"}) == Path("/h/hub")
    assert hub_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/huggingface/hub")
