"""Issue 44 (hardening, round two): inputs that parse but cannot work end in one line, exit 2, nothing left behind."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from test_hardening import _err, _one_line

from draftsmith.cli import main
from draftsmith.testing.models import save_tiny_target, tiny_chat_corpus


def _write_convs(path: Path, n: int, extra: list[str] = ()) -> Path:
    lines = [json.dumps({"id": f"c{i:03d}", "messages": m}) for i, m in enumerate(tiny_chat_corpus(n))]
    path.write_text("\n".join([*lines, *extra]) + "\n")
    return path


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny target, a few conversations and a small store captured from them."""
    root = tmp_path_factory.mktemp("hardening2")
    target = save_tiny_target(root / "target")
    convs = _write_convs(root / "convs.jsonl", 16)
    store = root / "store"
    assert main(["capture", "--target", str(target), "--conversations", str(convs), "--out", str(store),
                 "--max-length", "128", "--shard-mb", "0.02", "--draft-vocab-size", "64", "--no-progress"]) == 0
    return {"root": root, "target": target, "convs": convs, "store": store}


def _capture(ws, conv: Path, out: Path, *extra: str) -> int:
    return main(["capture", "--target", str(ws["target"]), "--conversations", str(conv), "--out", str(out),
                 "--no-progress", "--draft-vocab-size", "0", *extra])


def _train_args(ws, out: Path, *extra: str) -> list[str]:
    return ["train", "--target", str(ws["target"]), "--store", str(ws["store"]), "--out", str(out),
            "--max-steps", "4", "--batch-tokens", "256", "--ttt-steps", "2", "--save-every", "2",
            "--eval-every", "100", "--no-progress", "--no-plot", *extra]


# --- 1: a line the tokenizer cannot encode is an invalid line ------------------------------------------------
def test_capture_lone_surrogate_is_an_invalid_line(ws, tmp_path, capsys):
    bad = '{"id": "sur", "messages": [{"role": "user", "content": "half \\ud800 an emoji"}, ' \
          '{"role": "assistant", "content": "ok"}]}'
    conv = _write_convs(tmp_path / "c.jsonl", 3, [bad])
    out = tmp_path / "s"
    assert _capture(ws, conv, out) == 0
    assert "records 4 = captured 3 + invalid 1" in capsys.readouterr().out
    rows = [json.loads(ln) for ln in (tmp_path / "s.errors.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["line"] == 4 and "U+D800" in rows[0]["reason"], rows


def test_generate_lone_surrogate_reason_is_ours(ws, tmp_path, capsys):
    bad = '{"id": "sur", "messages": [{"role": "user", "content": "half \\ud800 an emoji"}]}'
    conv = _write_convs(tmp_path / "c.jsonl", 1, [bad])
    out = tmp_path / "g.jsonl"
    main(["generate", "--input", str(conv), "--target", str(ws["target"]), "--out", str(out),
          "--max-new-tokens", "2", "--no-progress"])
    rows = [json.loads(ln) for ln in Path(str(out) + ".errors.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and "U+D800" in rows[0]["reason"] and "TextEncodeInput" not in rows[0]["reason"], rows


# --- 10: nesting too deep for the JSON parser is an invalid line --------------------------------------------
def test_capture_deeply_nested_line_is_invalid(ws, tmp_path, capsys):
    deep = '{"id": "deep", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    conv = _write_convs(tmp_path / "c.jsonl", 2, [deep])
    assert _capture(ws, conv, tmp_path / "s") == 0
    rows = [json.loads(ln) for ln in (tmp_path / "s.errors.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["line"] == 3 and "nested too deeply" in rows[0]["reason"], rows


# --- 2: a kill during the first checkpoint save -------------------------------------------------------------
def test_resume_without_latest_uses_the_newest_complete_step(ws, tmp_path, capsys):
    assert main(_train_args(ws, tmp_path / "a")) == 0
    out = tmp_path / "b"
    assert main(_train_args(ws, out, "--stop-at-step", "2")) == 0
    (out / "checkpoints" / "latest").unlink()  # killed after renaming step-2 into place, before `latest`
    capsys.readouterr()
    assert main(_train_args(ws, out)) == 2  # a complete checkpoint is a run: the fresh start is refused ...
    _one_line(capsys, "--resume")
    assert main(_train_args(ws, out, "--resume")) == 0  # ... and --resume continues it
    a, b = load_file(tmp_path / "a" / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_kill_before_the_first_checkpoint_starts_fresh(ws, tmp_path, capsys):
    out = tmp_path / "b"
    assert main(_train_args(ws, out, "--stop-at-step", "2", "--log-every", "1")) == 0
    ckpts = out / "checkpoints"
    (ckpts / "latest").unlink()
    os.replace(ckpts / "step-0000002", ckpts / ".tmp-step-0000002")  # killed mid-save: only the temp dir
    assert main(_train_args(ws, out, "--log-every", "1")) == 0
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r and not r.get("eval")]
    assert steps == sorted(set(steps)) and steps[-1] == 4, steps  # the killed run's rows went with it


# --- 13: checkpoints/latest stays inside the run directory --------------------------------------------------
def test_latest_pointing_outside_the_run_is_refused(ws, tmp_path, capsys):
    out = tmp_path / "b"
    assert main(_train_args(ws, out, "--stop-at-step", "2")) == 0
    outside = tmp_path / "elsewhere"
    shutil.copytree(out / "checkpoints" / "step-0000002", outside)
    (out / "checkpoints" / "latest").write_text("../../elsewhere")
    capsys.readouterr()
    assert main(_train_args(ws, out, "--resume")) == 2
    _one_line(capsys, "latest", "not a step-NNNNNNN directory")


# --- 10/15: a run config.json that parses but is not a run config -------------------------------------------
@pytest.mark.parametrize("text, needle", [("[1, 2]", "JSON list"), ('{"ttt_steps": 2, "bogus": 1}', "bogus"),
                                          ('{"ttt_steps": ', "not valid JSON"), (b"\xff\xfe{", "not valid JSON")])
def test_resume_with_a_bad_run_config(ws, tmp_path, capsys, text, needle):
    out = tmp_path / "b"
    assert main(_train_args(ws, out, "--stop-at-step", "2")) == 0
    cfg = out / "config.json"
    cfg.write_bytes(text if isinstance(text, bytes) else text.encode())
    capsys.readouterr()
    assert main(_train_args(ws, out, "--resume")) == 2
    _one_line(capsys, str(cfg), needle)


# --- 3 / 7 / 14: train input paths are checked before --out is created or locked ----------------------------
@pytest.mark.parametrize("kind", ["missing", "dir"])
def test_train_vocab_missing_or_a_directory(ws, tmp_path, capsys, kind):
    vocab = tmp_path / "v.safetensors"
    if kind == "dir":
        vocab.mkdir()
    out = tmp_path / "run"
    assert main(_train_args(ws, out, "--vocab", str(vocab))) == 2
    _one_line(capsys, "--vocab", str(vocab))
    assert not out.exists()


def test_train_conversations_fifo_refused(ws, tmp_path, capsys):
    fifo = tmp_path / "convs.fifo"
    os.mkfifo(fifo)
    out = tmp_path / "run"
    args = ["train", "--target", str(ws["target"]), "--conversations", str(fifo), "--out", str(out),
            "--no-progress", "--no-plot"]
    assert main(args) == 2
    _one_line(capsys, str(fifo), "not a regular file")
    assert not out.exists()


def test_failed_train_leaves_no_lock_behind(ws, tmp_path, capsys):
    store = tmp_path / "store"
    shutil.copytree(ws["store"], store)
    shard = next(store.glob("shard-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-7])  # fails the sha256 check after the lock was taken
    out = tmp_path / "run"
    args = _train_args(ws, out)
    args[args.index("--store") + 1] = str(store)
    assert main(args) == 2
    assert len(_err(capsys)) == 1
    assert not out.exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    args[args.index("--out") + 1] = str(existing)
    assert main(args) == 2
    assert list(existing.iterdir()) == []


# --- 4 / 15: generate locks --out; a held lock's message has no raw errno text --------------------------------
def test_generate_refuses_an_out_another_run_is_writing(ws, tmp_path, capsys):
    from draftsmith.core.io import ExclusiveLock

    out = tmp_path / "g.jsonl"
    holder = ExclusiveLock(tmp_path / ".g.jsonl.lock", "held by the test")
    try:
        code = main(["generate", "--input", str(ws["convs"]), "--target", str(ws["target"]), "--out", str(out),
                     "--max-new-tokens", "2", "--limit", "1", "--no-progress"])
    finally:
        holder.release()
    assert code == 2
    line = _one_line(capsys, str(out), "another generate run")
    assert "Errno" not in line and not out.exists()


def test_capture_into_a_locked_store_exits_2_without_errno(ws, tmp_path, capsys):
    from draftsmith.data.store import FeatureStoreWriter

    out = tmp_path / "s"
    holder = FeatureStoreWriter(out, meta={"kind": "other"})
    try:
        code = _capture(ws, ws["convs"], out)
    finally:
        holder.close()
    assert code == 2
    line = _one_line(capsys, "another FeatureStoreWriter", str(out))
    assert "Errno" not in line and "Resource temporarily unavailable" not in line


# --- 8: vocab --out never overwrites the store's own files ---------------------------------------------------
@pytest.mark.parametrize("name", ["manifest.json", "shard-00000.safetensors"])
def test_vocab_out_cannot_name_the_stores_own_file(ws, tmp_path, capsys, name):
    store = tmp_path / "store"
    shutil.copytree(ws["store"], store)
    before = (store / name).read_bytes()
    assert main(["vocab", "--store", str(store), "--draft-vocab-size", "32", "--out", str(store / name)]) == 2
    _one_line(capsys, str(store / name))
    assert (store / name).read_bytes() == before


# --- 10 / 13 / 15: manifests that parse but are not what the readers rely on ---------------------------------
def _edit_manifest(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    edit(m)
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def _set(path: tuple, value):
    def edit(m):
        node = m
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
    return edit


def _dup_id(m):
    m["shards"][1]["samples"][0]["sample_id"] = m["shards"][0]["samples"][0]["sample_id"]


@pytest.mark.parametrize("edit, needle", [
    (_set(("shards",), 5), "shards is a int"),
    (_set(("shards", 0, "samples", 0, "length"), "abc"), "length is 'abc'"),
    (_set(("shards", 0, "file"), "../../target/model.safetensors"), "not a shard-N.safetensors name"),
    (_dup_id, "repeats sample_id"),
], ids=["shards-int", "length-str", "file-outside", "duplicate-id"])
@pytest.mark.parametrize("command", ["train", "vocab", "capture"])
def test_edited_manifest_is_one_line_naming_it(ws, tmp_path, capsys, edit, needle, command):
    store = _edit_manifest(ws["store"], tmp_path / "store", edit)
    manifest_before = (store / "manifest.json").read_bytes()
    if command == "train":
        args = _train_args(ws, tmp_path / "run")
        args[args.index("--store") + 1] = str(store)
        code = main(args)
    elif command == "vocab":
        code = main(["vocab", "--store", str(store), "--draft-vocab-size", "32"])
    else:
        code = _capture(ws, ws["convs"], store, "--max-length", "128")
    assert code == 2
    line = _one_line(capsys, str(store / "manifest.json"), needle)
    assert "delete" not in line  # no advice to remove anything, least of all a file outside the store
    assert (store / "manifest.json").read_bytes() == manifest_before
    assert (ws["target"] / "model.safetensors").is_file()


# --- 14: a failed capture leaves no empty store behind ------------------------------------------------------
def test_failed_capture_leaves_no_empty_store(ws, tmp_path, capsys):
    conv = tmp_path / "bad.jsonl"
    conv.write_text('{not json\n')
    out = tmp_path / "s"
    assert _capture(ws, conv, out) == 2
    _one_line(capsys, "no usable conversation")
    assert not out.exists()


# --- 5: work is bounded by the target's context (max_position_embeddings 512) --------------------------------
def test_decode_huge_budget_is_clamped_to_the_context(ws, capsys):
    argv = ["decode", "--target", str(ws["target"]), "--prompt", "the cat sat", "--max-new-tokens", "1000000000",
            "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert len(report["token_ids"]) + report["prompt_length"] <= 512
    assert "clamped to" in captured.err


def test_decode_prompt_past_the_context_is_refused(ws, capsys):
    argv = ["decode", "--target", str(ws["target"]), "--prompt", "the cat sat on a mat " * 400,
            "--max-new-tokens", "4"]
    assert main(argv) == 2
    _one_line(capsys, "context is 512 positions")


@pytest.mark.parametrize("policy, bucket", [("truncate", "truncated 1"), ("skip", "too long 1")])
def test_capture_bounds_samples_by_the_context(ws, tmp_path, capsys, policy, bucket):
    answer = "the cat sat on a mat " * 150
    long_conv = json.dumps({"id": "long", "messages": [{"role": "user", "content": "tell me"},
                                                       {"role": "assistant", "content": answer}]})
    conv = _write_convs(tmp_path / "c.jsonl", 2, [long_conv])
    out = tmp_path / "s"
    assert _capture(ws, conv, out, "--long", policy) == 0  # --max-length defaults to 2048
    text = capsys.readouterr().out
    assert bucket in text and "context of 512 positions" in text, text
    manifest = json.loads((out / "manifest.json").read_text())
    assert max(r["length"] for sh in manifest["shards"] for r in sh["samples"]) <= 512


# --- 9: the tree is bounded by what it costs ----------------------------------------------------------------
@pytest.mark.parametrize("tree", ["64,256,1024", "3,128,64"])
def test_tree_topk_bounded_by_cost(ws, capsys, tree):
    argv = ["decode", "--target", str(ws["target"]), "--random-drafter", "--tree", tree, "--prompt", "hi",
            "--max-new-tokens", "2"]
    assert main(argv) == 2
    _one_line(capsys, "candidate nodes", "16384")


def test_tree_within_the_cost_bound_still_runs():
    from draftsmith.stages.decode import MAX_TREE_CANDIDATES, TreeSpec

    assert TreeSpec(3, 64, 64).candidates <= MAX_TREE_CANDIDATES
    assert TreeSpec(64, 8, 1024).candidates <= MAX_TREE_CANDIDATES


# --- 10 / 15: model files that parse but have the wrong structure -----------------------------------------
def _edited_copy(src: Path, dst: Path, name: str, edit) -> Path:
    shutil.copytree(src, dst)
    f = dst / name
    if callable(edit):
        cfg = json.loads(f.read_text())
        edit(cfg)
        f.write_text(json.dumps(cfg))
    else:
        f.write_bytes(edit)
    return dst


def _decode_args(target: Path, *extra: str) -> list[str]:
    return ["decode", "--target", str(target), "--prompt", "hi", "--max-new-tokens", "2", *extra]


@pytest.mark.parametrize("edit, needle", [
    (lambda c: c.update(num_hidden_layers="eight"), "num_hidden_layers"),
    (lambda c: c.update(vocab_size=600), "disagree with its config.json"),
    (b"[1, 2]", "not a JSON object"),
    (b'{"model_type": "\xff"}', "not valid JSON"),
], ids=["layers-str", "vocab-size", "list", "non-utf8"])
def test_target_config_with_the_wrong_structure(ws, tmp_path, capsys, edit, needle):
    t = _edited_copy(ws["target"], tmp_path / "t", "config.json", edit)
    assert main(_decode_args(t)) == 2
    _one_line(capsys, str(t), needle)


def test_target_config_with_the_wrong_structure_in_train(ws, tmp_path, capsys):
    t = _edited_copy(ws["target"], tmp_path / "t", "config.json", lambda c: c.update(num_hidden_layers="eight"))
    args = _train_args(ws, tmp_path / "run")
    args[args.index("--target") + 1] = str(t)
    assert main(args) == 2
    _one_line(capsys, str(t / "config.json"), "num_hidden_layers")


def test_corrupt_tokenizer_is_named(ws, tmp_path, capsys):
    t = _edited_copy(ws["target"], tmp_path / "t", "tokenizer.json", b'{"version": ')
    assert main(_decode_args(t)) == 2
    line = _one_line(capsys, str(t / "tokenizer.json"), "cannot load the tokenizer")
    assert "no tokenizer" not in line


@pytest.mark.parametrize("command", ["decode", "capture", "generate"])
def test_pickle_only_target_is_refused(ws, tmp_path, capsys, command):
    t = tmp_path / "t"
    shutil.copytree(ws["target"], t)
    (t / "model.safetensors").unlink()
    torch.save({"w": torch.zeros(1)}, t / "pytorch_model.bin")
    if command == "decode":
        code = main(_decode_args(t))
    elif command == "capture":
        code = main(["capture", "--target", str(t), "--conversations", str(ws["convs"]), "--out",
                     str(tmp_path / "s"), "--no-progress"])
    else:
        code = main(["generate", "--input", str(ws["convs"]), "--target", str(t), "--out", str(tmp_path / "g.jsonl"),
                     "--no-progress"])
    assert code == 2
    _one_line(capsys, str(t), "only pickle weights", "pytorch_model.bin")


@pytest.fixture(scope="module")
def drafter_dir(ws) -> Path:
    from draftsmith.model.drafter import new_drafter
    from draftsmith.model.target import load_target

    return new_drafter(load_target(ws["target"])).save(ws["root"] / "drafter")


@pytest.mark.parametrize("edit, needle", [
    (lambda c: c.update(hidden_size=96), "disagree with"),
    (lambda c: c.update(intermediate_size=-5), "intermediate_size must be >= 1"),
    (lambda c: c.update(intermediate_size=10**12), "disagrees with the weights"),
    (b"[1]", "not an object"),
    (lambda c: c.update(num_attention_heads="four"), "'four'"),
    (b'{"hidden_size": "\xff"}', "not valid JSON"),
], ids=["hidden", "negative", "huge", "list", "heads-str", "non-utf8"])
@pytest.mark.parametrize("command", ["decode", "export"])
def test_drafter_config_with_the_wrong_structure(ws, drafter_dir, tmp_path, capsys, edit, needle, command):
    d = _edited_copy(drafter_dir, tmp_path / "d", "config.json", edit)
    if command == "decode":
        code = main(_decode_args(ws["target"], "--drafter", str(d)))
    else:
        code = main(["export", "--drafter", str(d), "--format", "vllm", "--out", str(tmp_path / "x")])
    assert code == 2
    _one_line(capsys, str(d / "config.json"), needle)


def test_export_num_speculative_tokens_is_bounded(drafter_dir, tmp_path, capsys):
    out = tmp_path / "x"
    argv = ["export", "--drafter", str(drafter_dir), "--format", "vllm", "--out", str(out),
            "--num-speculative-tokens", "1000000000"]
    assert main(argv) == 2
    _one_line(capsys, "--num-speculative-tokens", "64")
    assert not (out / "config.json").exists()


@pytest.mark.parametrize("name, text", [("broken.yaml", "a: [1,\n"), ("list.yaml", "- 1\n- 2\n"),
                                        ("tag.yaml", 'x: !!python/object/apply:os.system ["true"]\n'),
                                        ("bad.toml", "x = [\n")])
def test_train_config_file_that_is_not_a_table(ws, tmp_path, capsys, name, text):
    f = tmp_path / name
    f.write_text(text)
    assert main(["train", "--config", str(f), "--store", str(ws["store"]), "--target", str(ws["target"]),
                 "--out", str(tmp_path / "run")]) == 2
    _one_line(capsys, str(f))
