"""Capture: features equal a direct target pass, padding never leaks, every record is counted, resume and
kill -9 give exactly-once, the draft vocabulary is valid, and a mismatched store is refused."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from draftsmith.cli import main
from draftsmith.core import io as io_mod
from draftsmith.core.fingerprint import tokenizer_fingerprint
from draftsmith.core.vocab import VOCAB_FILE, VocabError, load_vocab, load_vocab_file, save_vocab, validate
from draftsmith.data.chat import parse_record, tokenize_conversation
from draftsmith.data.store import MANIFEST_NAME, FeatureStore, StoreCorrupt, StoreMismatch
from draftsmith.model.target import Target, load_target
from draftsmith.stages.capture import (
    CaptureConfig,
    batched_features,
    build_vocab,
    capture,
    check_store_matches_target,
    count_store_tokens,
)
from draftsmith.testing.models import build_tiny_model
from draftsmith.testing.tokenizer import make_tokenizer

MAX_LEN = 200
WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "speculative", "decoding",
    "lets", "small", "draft", "models", "propose", "tokens", "that", "large", "target", "verify", "in", "one",
    "pass", "hello", "paris", "france", "python", "code", "answer", "question", "step", "think", "first",
    "second", "third", "thank", "you",
]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def make_records() -> tuple[list[str], dict[str, int]]:
    """JSONL lines covering every bucket, and the counts expected under --long truncate."""
    rng = random.Random(0)
    lines: list[str] = []
    for i in range(20):
        turns = [(words(rng, rng.randint(3, 10)), words(rng, rng.randint(3, 20)))
                 for _ in range(1 + (i % 3 == 0))]
        if i % 2:  # ShareGPT
            conv = [m for u, a in turns for m in ({"from": "human", "value": u}, {"from": "gpt", "value": a})]
            rec: dict[str, Any] = {"id": f"c{i:02d}", "conversations": conv}
        else:  # OpenAI messages, some with a system prompt
            msgs = [m for u, a in turns for m in ({"role": "user", "content": u}, {"role": "assistant", "content": a})]
            if i % 4 == 0:
                msgs.insert(0, {"role": "system", "content": "You are terse."})
            rec = {"id": f"c{i:02d}", "messages": msgs}
        lines.append(json.dumps(rec))
    lines.append(json.dumps({"id": "long", "messages": [{"role": "user", "content": words(rng, 10)},
                                                        {"role": "assistant", "content": words(rng, 400)}]}))
    lines.append(json.dumps({"id": "late", "messages": [{"role": "user", "content": words(rng, 400)},
                                                        {"role": "assistant", "content": words(rng, 5)}]}))
    lines.append(json.dumps({"id": "p0", "prompt": "Hello there"}))  # no assistant turn
    lines.append(lines[3])  # duplicate id c03
    lines.append("{not json")
    lines.append("")  # blank lines are not records
    lines.append(json.dumps({"id": "x", "text": "unknown shape"}))
    expected = dict(records=26, captured=21, truncated=1, no_loss_tokens=2, duplicate_id=1, invalid=2,
                    too_long=0, nonfinite=0, already_stored=0, template_error=0)
    return lines, expected


CAPTURABLE = [f"c{i:02d}" for i in range(20)] + ["long"]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """Tiny matmuls gain nothing from threads, and on a shared 2-core box intra-op threads contend badly."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny random Llama (vocab = len(tokenizer)) + chatml tokenizer on disk, and a conversations file."""
    tok = make_tokenizer("chatml")
    model = build_tiny_model("llama", vocab_size=len(tok), seed=0)
    root = tmp_path_factory.mktemp("capture")
    model_dir = root / "target"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    lines, expected = make_records()
    conv = root / "conversations.jsonl"
    conv.write_text("\n".join(lines) + "\n")
    target = load_target(model_dir)
    assert target.tokenizer is not None and len(target.tokenizer) == len(tok)
    lengths = {c: len(tokenize_conversation(tok, m).input_ids) for c, m in messages_by_id(conv).items()
               if c.startswith("c")}
    assert len(lengths) == 20 and max(lengths.values()) < MAX_LEN  # only "long" and "late" exceed it
    return {"dir": model_dir, "target": target, "tok": target.tokenizer, "conv": conv, "expected": expected}


def cfg(tiny: dict[str, Any], out: Path, **kw: Any) -> CaptureConfig:
    base: dict[str, Any] = dict(conversations=tiny["conv"], out=out, max_length=MAX_LEN, batch_size=4,
                                draft_vocab_size=64, progress=False)
    base.update(kw)
    return CaptureConfig(**base)


def messages_by_id(conv: Path) -> dict[str, list[dict[str, str]]]:
    out = {}
    for n, line in enumerate(conv.read_text().splitlines(), 1):
        try:
            conv = parse_record(json.loads(line), n)
        except ValueError:
            continue
        out.setdefault(conv.id, conv.messages)
    return out


def assert_features_close(a: torch.Tensor, b: torch.Tensor) -> None:
    """bf16 storage tolerance (one bf16 ulp is 2^-8 relative)."""
    torch.testing.assert_close(a.float(), b.float(), rtol=1.6e-2, atol=1e-2)


def assert_stores_equal(a: FeatureStore, b: FeatureStore) -> None:
    assert sorted(a.sample_ids) == sorted(b.sample_ids)
    for sid in a.sample_ids:
        x, y = a.get_by_id(sid), b.get_by_id(sid)
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        assert_features_close(x["aux_hidden_states"], y["aux_hidden_states"])
        assert_features_close(x["hidden_state"], y["hidden_state"])


# ------------------------------------------------------------------------------------------ features


def test_store_equals_direct_forward(tiny: dict[str, Any], tmp_path: Path) -> None:
    target, tok = tiny["target"], tiny["tok"]
    report = capture(target, tok, cfg(tiny, tmp_path / "s"))
    c = report.counts
    c.check()
    assert {k: getattr(c, k) for k in tiny["expected"]} == tiny["expected"]
    assert report.padded_tokens > report.tokens  # batches really were padded

    store = FeatureStore(tmp_path / "s", out_dtype=torch.float32)
    store.verify()
    assert sorted(store.sample_ids) == sorted(CAPTURABLE)
    msgs = messages_by_id(tiny["conv"])
    for sid in store.sample_ids:
        got = store.get_by_id(sid)
        want = tokenize_conversation(tok, msgs[sid], MAX_LEN, truncate=True)
        assert got["input_ids"].tolist() == want.input_ids
        assert got["loss_mask"].tolist() == [bool(m) for m in want.loss_mask]
        assert want.truncated == (sid == "long")
        direct = target.forward(torch.tensor([want.input_ids]))
        aux = torch.stack(direct.aux_hidden_states, dim=2)[0]
        assert got["aux_hidden_states"].shape == aux.shape == (len(want.input_ids), 3, target.hidden_size)
        assert_features_close(got["aux_hidden_states"], aux.to(torch.bfloat16))
        assert_features_close(got["hidden_state"], direct.hidden_state[0].to(torch.bfloat16))

    meta = store.meta
    assert meta["aux_layer_ids"] == list(target.aux_layers) == [2, 4, 5]
    assert store.manifest["aux_layer_ids"] == [2, 4, 5] and store.hidden_size == target.hidden_size
    assert meta["hidden_size"] == target.hidden_size
    assert meta["target_fingerprint"] == json.loads(json.dumps(target.fingerprint()))
    assert meta["tokenizer_fingerprint"] == tokenizer_fingerprint(tok)
    assert meta["draftsmith_version"] and meta["max_length"] == MAX_LEN and meta["long_policy"] == "truncate"
    assert (tmp_path / "s" / VOCAB_FILE).is_file() and report.vocab is not None


def test_batched_equals_unbatched(tiny: dict[str, Any], tmp_path: Path) -> None:
    # Exact check in float64, where any leak of padding would show far above rounding.
    tok = tiny["tok"]
    target = Target(build_tiny_model("llama", vocab_size=len(tok), seed=3, dtype=torch.float64))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, len(tok), (n,), generator=g).tolist() for n in (17, 3, 30, 1, 9)]
    batched = batched_features(target, seqs, pad_id=tok.pad_token_id)
    for s, f in zip(seqs, batched, strict=True):
        single = batched_features(target, [s])[0]
        assert f.aux.shape == (len(s), 3, target.hidden_size) and f.hidden.shape == (len(s), target.hidden_size)
        torch.testing.assert_close(f.aux, single.aux, rtol=0, atol=1e-10)
        torch.testing.assert_close(f.hidden, single.hidden, rtol=0, atol=1e-10)

    # And end to end through the store: batch 1 vs batch 8 (different padding), bf16 tolerance.
    r1 = capture(tiny["target"], tok, cfg(tiny, tmp_path / "b1", batch_size=1, draft_vocab_size=None))
    r8 = capture(tiny["target"], tok, cfg(tiny, tmp_path / "b8", batch_size=8, draft_vocab_size=None))
    assert r1.padded_tokens == r1.tokens and r8.padded_tokens > r8.tokens
    assert_stores_equal(FeatureStore(tmp_path / "b1"), FeatureStore(tmp_path / "b8"))


def test_max_tokens_per_batch_bounds_padding(tiny: dict[str, Any], tmp_path: Path) -> None:
    from draftsmith.stages.capture import _plan_batches

    lengths = [5, 50, 7, 48, 6, 49, 200]
    batches = _plan_batches(lengths, batch_size=3, max_tokens=120)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= 3 and (len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 120)
    assert batches[0] == [6]  # longest first, alone over the budget
    r = capture(tiny["target"], tiny["tok"], cfg(tiny, tmp_path / "s", batch_size=64, max_tokens_per_batch=256,
                                                 draft_vocab_size=None))
    assert r.counts.captured == len(CAPTURABLE)


def test_the_progress_bar_counts_tokens_so_its_eta_holds(tiny: dict[str, Any], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches run longest first, so a bar over records ran ahead of the work. Over tokens, the total is known
    before the first batch (one window here) and the count ends on it: the rate, and so the ETA, is the work's.
    With two windows, the first window's tokens per record estimate the total before the second is read."""
    from draftsmith.stages.capture import common

    seen: list[tuple[int, int | None, int]] = []

    class Recorded(common._Progress):
        def update(self, records: int, captured: int, tokens: int) -> None:
            super().update(records, captured, tokens)
            seen.append((self.bar.n, self.bar.total, self.records))

    monkeypatch.setattr(common, "_Progress", Recorded)
    r = capture(tiny["target"], tiny["tok"], cfg(tiny, tmp_path / "one", progress=True, draft_vocab_size=None))
    prefills = [(n, total) for n, total, _ in seen if n]
    assert prefills and all(total == r.tokens for _, total in prefills)  # known before the first batch ran
    assert seen[-1][0] == r.tokens and seen[-1][2] == r.counts.records  # ends on the total, every record counted
    assert prefills[0][0] > r.tokens / len(CAPTURABLE)  # the first batch is the longest: more than its share
    seen.clear()
    r2 = capture(tiny["target"], tiny["tok"], cfg(tiny, tmp_path / "two", progress=True, draft_vocab_size=None,
                                                  sort_window=10))
    first = next(total for n, total, _ in seen if n)
    assert 0.5 * r2.tokens < first < 2 * r2.tokens and seen[-1][:2] == (r2.tokens, r2.tokens)


# ------------------------------------------------------------------------------------------ counting


def test_long_policy_truncate_vs_skip(tiny: dict[str, Any], tmp_path: Path) -> None:
    t = capture(tiny["target"], tiny["tok"], cfg(tiny, tmp_path / "t", long="truncate")).counts
    s = capture(tiny["target"], tiny["tok"], cfg(tiny, tmp_path / "k", long="skip")).counts
    assert (t.captured, t.truncated, t.too_long, t.no_loss_tokens) == (21, 1, 0, 2)
    # "late" has its reply beyond MAX_LEN: truncating leaves no loss token; skipping counts it as too long.
    assert (s.captured, s.truncated, s.too_long, s.no_loss_tokens) == (20, 0, 2, 1)
    for c in (t, s):
        c.check()
        assert c.records == 26
    assert "long" not in FeatureStore(tmp_path / "k") and FeatureStore(tmp_path / "k").meta["long_policy"] == "skip"
    lim = capture(tiny["target"], tiny["tok"], cfg(tiny, tmp_path / "l", limit=7)).counts
    assert lim.records == 7 and lim.captured == 7


def test_nonfinite_features_rejected_and_counted(tiny: dict[str, Any], tmp_path: Path) -> None:
    target = tiny["target"]
    calls = {"n": 0}

    def inject_nan(module: Any, args: Any, output: Any) -> Any:
        calls["n"] += 1
        if calls["n"] != 3:
            return None
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = hidden.clone()
        hidden[0, -1, 0] = float("nan")  # layer 1's output = aux layer 2's input: poisons aux and final
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = target.layers[1].register_forward_hook(inject_nan)
    try:
        r = capture(target, tiny["tok"], cfg(tiny, tmp_path / "s", batch_size=1))
    finally:
        handle.remove()
    assert r.counts.nonfinite == 1 and r.counts.captured == len(CAPTURABLE) - 1
    r.counts.check()
    store = FeatureStore(tmp_path / "s")
    assert len(store) == len(CAPTURABLE) - 1
    assert all(torch.isfinite(s["aux_hidden_states"]).all() for s in store)


def test_resume_skips_stored(tiny: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "s"
    first = capture(tiny["target"], tiny["tok"], cfg(tiny, out, limit=6))
    assert first.counts.captured == 6
    second = capture(tiny["target"], tiny["tok"], cfg(tiny, out))
    assert second.counts.already_stored == 6 and second.counts.captured == len(CAPTURABLE) - 6
    second.counts.check()
    store = FeatureStore(out)
    assert sorted(store.sample_ids) == sorted(CAPTURABLE) and len(set(store.sample_ids)) == len(store)
    third = capture(tiny["target"], tiny["tok"], cfg(tiny, out))
    assert third.counts.already_stored == len(CAPTURABLE) and third.counts.captured == 0
    # Resuming under other settings would mix features: refused.
    with pytest.raises(StoreMismatch, match="max_length"):
        capture(tiny["target"], tiny["tok"], cfg(tiny, out, max_length=100))
    with pytest.raises(StoreMismatch, match="dtype"):
        capture(tiny["target"], tiny["tok"], cfg(tiny, out, dtype="fp8"))


def test_store_names_its_features_for_every_kind_and_old_stores_resume(tiny: dict[str, Any], tmp_path: Path) -> None:
    """A store says it holds the target's features (every drafter kind trains from them); a store written under
    the old name 'eagle3-features' resumes instead of being refused, keeps its name and reads; another name is
    another store."""
    out = tmp_path / "s"
    capture(tiny["target"], tiny["tok"], cfg(tiny, out, limit=6))
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["meta"]["kind"] == "target-features"
    manifest["meta"]["kind"] = "eagle3-features"  # as draftsmith wrote it before the block kinds
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    second = capture(tiny["target"], tiny["tok"], cfg(tiny, out))
    assert second.counts.already_stored == 6 and second.counts.captured == len(CAPTURABLE) - 6
    store = FeatureStore(out)
    assert store.meta["kind"] == "eagle3-features" and sorted(store.sample_ids) == sorted(CAPTURABLE)
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    manifest["meta"]["kind"] = "other-features"
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(StoreMismatch, match="kind"):
        capture(tiny["target"], tiny["tok"], cfg(tiny, out))


def test_sharegpt_array_as_written_first_turns_without_evaluation_prompts(tiny: dict[str, Any], tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A ShareGPT-shaped JSON array cut mid-object: every complete conversation is read, an evaluation
    prompt is counted and never stored, and --max-turns keeps the first turn and its answer as written."""
    import draftsmith.stages.capture.common as common

    monkeypatch.setattr(common, "evaluation_keys", lambda: frozenset({"what is an evaluation prompt?"}))

    def conv(cid: str, *turns: str) -> dict:
        return {"id": cid, "conversations": [{"from": "human" if i % 2 == 0 else "gpt", "value": t}
                                             for i, t in enumerate(turns)]}

    rows = [conv("a", "hello there", "general kenobi", "and then?", "you are a bold one"),
            conv("b", "What is an  EVALUATION prompt?", "a held-out question"),
            conv("c", "one more", "answer as written")]
    text = json.dumps(rows + [conv("cut", "never", "complete")])
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: text.rindex("complete") - 3])  # the file ends mid-object, as the package's does
    report = capture(tiny["target"], tiny["tok"], cfg(tiny, tmp_path / "s", conversations=path, max_turns=1))
    c = report.counts
    c.check()
    assert (c.records, c.captured, c.evaluation_prompt) == (3, 2, 1)  # the cut object is not a record
    store = FeatureStore(tmp_path / "s")
    assert sorted(store.sample_ids) == ["a", "c"]
    first = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "general kenobi"}]
    expected = tokenize_conversation(tiny["tok"], first, MAX_LEN).input_ids
    assert store.get_by_id("a")["input_ids"].tolist() == expected
    with pytest.raises(ValueError, match="--max-turns must be >= 1"):
        cfg(tiny, tmp_path / "t", conversations=path, max_turns=0).validate()


def stderr_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    """Non-empty stderr lines, without transformers' own weight-loading progress bar."""
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "Loading weights" not in ln]


def _console(*args: str) -> list[str]:
    exe = Path(sys.executable).with_name("draftsmith")
    return [str(exe), *args] if exe.is_file() else [sys.executable, "-m", "draftsmith.cli", *args]


# The capture stops itself once KILL_AFTER samples are committed: at its next batch's forward pass it writes READY
# and sleeps, so the test kills it at a known point, however slow the machine is, and never after it finished.
_STOPPING_CAPTURE = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    from draftsmith.model import target as t
    manifest, ready = Path(os.environ["KILL_MANIFEST"]), Path(os.environ["KILL_READY"])
    after = int(os.environ["KILL_AFTER"])
    forward = t.Target.forward
    def stopping(self, *a, **k):
        try:
            committed = json.loads(manifest.read_text())["num_samples"]
        except (FileNotFoundError, ValueError, KeyError):
            committed = 0
        if committed >= after:
            ready.with_suffix(".tmp").write_text(str(committed))
            ready.with_suffix(".tmp").rename(ready)  # whole, or not there
            while True:
                time.sleep(60)
        return forward(self, *a, **k)
    t.Target.forward = stopping
    from draftsmith.cli import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.slow  # two interpreters that import torch: the killed capture and its rerun
def test_kill9_then_rerun_exactly_once(tiny: dict[str, Any], tmp_path: Path) -> None:
    out, ready = tmp_path / "s", tmp_path / "ready"
    args = ["capture", "--target", str(tiny["dir"]), "--conversations", str(tiny["conv"]), "--out", str(out),
            "--max-length", str(MAX_LEN), "--batch-size", "2", "--shard-mb", "0.0001", "--draft-vocab-size", "64",
            "--no-progress", "--json"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _STOPPING_CAPTURE, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            env={**env, "KILL_MANIFEST": str(out / MANIFEST_NAME), "KILL_READY": str(ready),
                                 "KILL_AFTER": "4"})
    try:
        hang_guard = time.monotonic() + 1800  # not a deadline: only a capture that hangs reaches it
        while not ready.exists() and proc.poll() is None and time.monotonic() < hang_guard:
            time.sleep(0.05)
        assert ready.exists(), proc.communicate()[1].decode()[-2000:] if proc.poll() is not None else "hung"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL

    store = FeatureStore(out)
    store.verify()  # the manifest lists only complete shards
    done = len(store)
    assert done == int(ready.read_text()) and 4 <= done < len(CAPTURABLE)
    assert not (out / VOCAB_FILE).exists()

    rerun = subprocess.run(_console(*args), capture_output=True, text=True, env=env, timeout=1800)
    assert rerun.returncode == 0, rerun.stderr
    report = json.loads(rerun.stdout)
    assert report["counts"]["already_stored"] == done
    assert report["counts"]["captured"] == len(CAPTURABLE) - done
    store = FeatureStore(out)
    store.verify()
    assert sorted(store.sample_ids) == sorted(CAPTURABLE) and len(set(store.sample_ids)) == len(store)
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    load_vocab(out / VOCAB_FILE, tiny["target"].vocab_size)

    reference = tmp_path / "ref"
    capture(tiny["target"], tiny["tok"], cfg(tiny, reference, batch_size=2, draft_vocab_size=None))
    assert_stores_equal(FeatureStore(out), FeatureStore(reference))


def test_disk_full_is_one_line_and_store_stays_valid(tiny: dict[str, Any], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s"
    real = io_mod.write_file_durably
    calls = {"n": 0}

    def flaky(path: Path, data: bytes) -> None:
        calls["n"] += 1
        if calls["n"] >= 6:  # manifest, then two (shard, manifest) commits, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(io_mod, "write_file_durably", flaky)
    argv = ["capture", "--target", str(tiny["dir"]), "--conversations", str(tiny["conv"]), "--out", str(out),
            "--max-length", str(MAX_LEN), "--shard-mb", "0.0001", "--no-progress", "--draft-vocab-size", "64"]
    assert main(argv) == 1
    err = stderr_lines(capsys)
    assert len(err) == 1 and "No space left" in err[0] and err[0].startswith("draftsmith: error:"), err
    store = FeatureStore(out)
    store.verify()
    assert len(store) == 2

    monkeypatch.setattr(io_mod, "write_file_durably", real)
    assert main(argv) == 0
    assert "already stored 2" in capsys.readouterr().out
    assert sorted(FeatureStore(out).sample_ids) == sorted(CAPTURABLE)


def test_cli_bad_input_exits_2(tiny: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["capture", "--target", str(tiny["dir"]), "--no-progress"]
    a_file = tmp_path / "file"
    a_file.write_text("x")
    cases = [
        [*base, "--conversations", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o1")],
        [*base, "--conversations", str(tiny["conv"]), "--out", str(a_file)],
        [*base, "--conversations", str(tiny["conv"]), "--out", str(a_file / "sub")],  # unwritable location
        [*base, "--conversations", str(tiny["conv"]), "--out", str(tmp_path / "o2"), "--batch-size", "0"],
        [*base, "--conversations", str(tiny["conv"]), "--out", str(tmp_path / "o3"), "--aux-layers", "1,99,3"],
        ["vocab", "--store", str(tmp_path)],  # not a store
    ]
    for argv in cases:
        assert main(argv) == 2, argv
        err = stderr_lines(capsys)
        assert len(err) == 1 and err[0].startswith("draftsmith: error:"), (argv, err)
    # Resuming with another store dtype is refused in one line too.
    out = tmp_path / "o4"
    ok = [*base, "--conversations", str(tiny["conv"]), "--out", str(out), "--limit", "2", "--draft-vocab-size", "0"]
    assert main(ok) == 0
    assert main([*ok, "--store-dtype", "fp8"]) == 2
    assert "dtype" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ vocab


def test_draft_vocab(tiny: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s"
    report = capture(tiny["target"], tiny["tok"], cfg(tiny, out, dtype="fp8", draft_vocab_size=40))
    store = FeatureStore(out)
    vocab_size = tiny["target"].vocab_size

    # Counted: the target tokens at loss positions, nothing else.
    want = torch.zeros(vocab_size, dtype=torch.int64)
    for s in store:
        want += torch.bincount(s["input_ids"][s["loss_mask"]], minlength=vocab_size)
    counts = count_store_tokens(store, vocab_size)
    assert torch.equal(counts, want) and int(counts.sum()) == store.total_loss_tokens

    vocab, counts_file, meta = load_vocab_file(out / VOCAB_FILE, vocab_size)
    assert counts_file is not None and torch.equal(counts_file, want)
    validate(vocab.d2t, vocab.t2d, vocab_size)
    assert vocab.draft_vocab_size == 40 and vocab.vocab_size == vocab_size
    assert vocab.d2t.dtype == torch.int64 and vocab.t2d.dtype == torch.bool
    kept = vocab.target_ids()
    assert torch.equal(torch.nonzero(vocab.t2d).flatten(), kept)
    # The kept ids are the 40 most frequent, and the coverage is their share of the counted tokens.
    assert int(want[kept].min()) >= int(want[~vocab.t2d].max())
    coverage = float(want[kept].sum()) / float(want.sum())
    assert report.vocab is not None and report.vocab.coverage == pytest.approx(coverage)
    assert float(meta["coverage"]) == pytest.approx(coverage) and 0.5 < coverage < 1.0
    assert meta["draft_vocab_size"] == "40" and meta["vocab_size"] == str(vocab_size)
    assert json.loads(meta["tokenizer_fingerprint"]) == store.meta["tokenizer_fingerprint"]

    # Validated on load: a vocab for another target size or a tampered mapping is refused.
    with pytest.raises(VocabError, match="vocabulary"):
        load_vocab(out / VOCAB_FILE, vocab_size + 1)
    bad = vocab.d2t.clone()
    bad[[3, 4]] = bad[[4, 3]] + torch.tensor([1, -1])  # swaps two target ids: no longer increasing
    tampered = type(vocab)(d2t=bad, t2d=vocab.t2d)
    with pytest.raises(VocabError):
        save_vocab(tmp_path / "bad.safetensors", tampered, counts)

    # The CLI builds the same thing, to any path, and the whole vocabulary covers everything.
    path = tmp_path / "v.safetensors"
    assert main(["vocab", "--store", str(out), "--draft-vocab-size", "40", "--out", str(path)]) == 0
    assert "40 of" in capsys.readouterr().out
    assert torch.equal(load_vocab(path, vocab_size).d2t, vocab.d2t)
    full = build_vocab(store, 10**6, out=tmp_path / "full.safetensors")
    assert full.draft_vocab_size == vocab_size and full.coverage == pytest.approx(1.0)


# ------------------------------------------------------------------------------------------ trainer check


def test_store_fingerprint_mismatch_refused_unless_forced(tiny: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "s"
    capture(tiny["target"], tiny["tok"], cfg(tiny, out, limit=3, draft_vocab_size=None))
    target, tok = tiny["target"], tiny["tok"]
    assert check_store_matches_target(out, target, tok) == []
    assert check_store_matches_target(FeatureStore(out), target) == []  # the target's own tokenizer

    other_tok = make_tokenizer("llama3")
    with pytest.raises(StoreMismatch, match="tokenizer_fingerprint"):
        check_store_matches_target(out, target, other_tok)
    other_layers = Target(target.model, tok, aux_layers=(1, 3, 6))
    with pytest.raises(StoreMismatch, match="aux_layer_ids"):
        check_store_matches_target(out, other_layers, tok)
    other_model = Target(build_tiny_model("llama", vocab_size=len(tok), num_hidden_layers=6), tok)
    with pytest.raises(StoreMismatch, match="target_fingerprint"):
        check_store_matches_target(out, other_model, tok)
    # The trainer's heads-only view (config + hidden size, no model, no aux ids) is checked too.
    heads = SimpleNamespace(config=target.config, hidden_size=target.hidden_size)
    assert check_store_matches_target(out, heads) == []
    other_heads = SimpleNamespace(config=other_model.config, hidden_size=other_model.hidden_size)
    with pytest.raises(StoreMismatch, match="target_fingerprint"):
        check_store_matches_target(out, other_heads)
    with pytest.warns(UserWarning, match="force"):
        diffs = check_store_matches_target(out, other_model, other_tok, force=True)
    assert "target_fingerprint" in diffs and "tokenizer_fingerprint" in diffs


def test_vocab_refuses_a_corrupt_store(tiny: dict[str, Any], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Rewritten input_ids bytes or a cut shard: one line, exit 2, never silently wrong counts or a traceback."""
    import shutil

    out = tmp_path / "s"
    capture(tiny["target"], tiny["tok"], cfg(tiny, out, limit=4, draft_vocab_size=None))
    store = FeatureStore(out)
    shard = out / store.shards[0]["file"]
    vocab_size = tiny["target"].vocab_size

    flipped = tmp_path / "flipped"
    shutil.copytree(out, flipped)
    from safetensors import safe_open

    with safe_open(str(shard), framework="pt") as h:
        ids = h.get_tensor("0.input_ids")
    data = bytearray((flipped / shard.name).read_bytes())
    at = data.find(ids.numpy().tobytes())
    assert at > 0
    data[at: at + 4] = (int(ids[0]) ^ 1).to_bytes(4, "little")  # another valid token id
    (flipped / shard.name).write_bytes(bytes(data))

    cut = tmp_path / "cut"
    shutil.copytree(out, cut)
    (cut / shard.name).write_bytes(shard.read_bytes()[:-3])

    for bad in (flipped, cut):
        capsys.readouterr()
        assert main(["vocab", "--store", str(bad), "--draft-vocab-size", "8", "--out", str(tmp_path / "v")]) == 2
        err = stderr_lines(capsys)
        assert len(err) == 1 and err[0].startswith("draftsmith: error:") and shard.name in err[0], (bad, err)
        with pytest.raises(StoreCorrupt, match=shard.name):
            count_store_tokens(bad, vocab_size)
    assert not (tmp_path / "v").exists()
