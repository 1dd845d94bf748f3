"""Feature store: round trips, rejection of non-finite features, resume, integrity, shuffling, crashes."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import draftsmith
from draftsmith.core import io as io_mod
from draftsmith.data.store import (
    MANIFEST_NAME,
    FeatureStore,
    FeatureStoreWriter,
    StoreCorrupt,
    StoreError,
    StoreMismatch,
    StoreWriteError,
    estimate_bytes_per_token,
)
from draftsmith.data.store import reader as reader_mod

H = 8
N_AUX = 3
META = {"aux_layer_ids": [2, 5, 8], "hidden_size": H, "target_fingerprint": "abc", "tokenizer": "tok-1"}

_PROC_PATH = Path(__file__).with_name("_store_writer_proc.py")
_spec = importlib.util.spec_from_file_location("_store_writer_proc", _PROC_PATH)
assert _spec is not None and _spec.loader is not None
proc_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(proc_mod)


def make_sample(i: int, t: int | None = None) -> dict[str, Any]:
    g = torch.Generator().manual_seed(i)
    t = t if t is not None else 2 + (i * 5) % 13
    return {
        "input_ids": torch.randint(0, 32_000, (t,), generator=g),
        "loss_mask": torch.rand(t, generator=g) > 0.5,
        "aux": [torch.randn(t, H, generator=g) * (i + 1) for _ in range(N_AUX)],
        "hidden": torch.randn(t, H, generator=g),
    }


def add(w: FeatureStoreWriter, sid: str, s: dict[str, Any]) -> bool:
    return w.add(sid, s["input_ids"], s["loss_mask"], s["aux"], s["hidden"])


def write_store(root: Path, n: int, **kw: Any) -> list[dict[str, Any]]:
    samples = [make_sample(i) for i in range(n)]
    with FeatureStoreWriter(root, meta=META, **kw) as w:
        for i, s in enumerate(samples):
            assert add(w, f"s{i}", s)
    assert w.written == n
    return samples


def read_manifest(root: Path) -> dict[str, Any]:
    return json.loads((root / MANIFEST_NAME).read_text())


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - 10] ^= 0x40  # inside tensor payload, so the file still parses
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------------------------------------- round trips


def test_roundtrip_bf16(tmp_path: Path) -> None:
    samples = [make_sample(i) for i in range(7)]
    with FeatureStoreWriter(tmp_path, meta=META, flush_every=3) as w:
        for i, s in enumerate(samples):
            aux: Any = s["aux"]
            if i % 3 == 1:
                aux = torch.stack(aux, dim=1)  # [T, n, H]
            elif i % 3 == 2:
                aux = torch.cat(aux, dim=-1)  # SpecForge's concatenated [T, n*H]
            assert w.add(f"s{i}", s["input_ids"], s["loss_mask"], aux, s["hidden"])
    assert (w.written, w.rejected_nonfinite, w.skipped_existing) == (7, 0, 0)

    m = read_manifest(tmp_path)
    assert m["dtype"] == "bf16" and m["meta"] == META
    assert m["aux_layer_ids"] == [2, 5, 8] and m["hidden_size"] == H and m["num_aux"] == N_AUX
    assert [len(sh["samples"]) for sh in m["shards"]] == [3, 3, 1]
    assert all(len(sh["sha256"]) == 64 and sh["bytes"] > 0 for sh in m["shards"])
    assert m["total_tokens"] == sum(s["input_ids"].numel() for s in samples)
    assert m["total_loss_tokens"] == sum(int(s["loss_mask"].sum()) for s in samples)
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == [sh["file"] for sh in m["shards"]]

    for out_dtype in (torch.bfloat16, torch.float32):
        fs = FeatureStore(tmp_path, out_dtype=out_dtype)
        fs.verify()
        assert len(fs) == 7 and fs.sample_ids == [f"s{i}" for i in range(7)]
        assert fs.meta == META and fs.total_tokens == m["total_tokens"]
        for i, s in enumerate(samples):
            got = fs.get(i)
            assert got["sample_id"] == f"s{i}"
            assert got["input_ids"].dtype == torch.int64 and torch.equal(got["input_ids"], s["input_ids"])
            assert got["loss_mask"].dtype == torch.bool and torch.equal(got["loss_mask"], s["loss_mask"])
            want_aux = torch.stack(s["aux"], dim=1).to(torch.bfloat16).to(out_dtype)
            assert got["aux_hidden_states"].dtype == out_dtype
            assert torch.equal(got["aux_hidden_states"], want_aux)
            assert torch.equal(got["hidden_state"], s["hidden"].to(torch.bfloat16).to(out_dtype))
        assert torch.equal(fs.get_by_id("s4")["hidden_state"], fs[4]["hidden_state"])

    # Plain safetensors, readable without draftsmith (and without pickle).
    with safe_open(str(tmp_path / m["shards"][0]["file"]), framework="pt") as f:
        assert json.loads(f.metadata()["sample_ids"]) == ["s0", "s1", "s2"]
        assert f.get_tensor("0.aux").shape == (samples[0]["input_ids"].numel(), N_AUX, H)


def test_roundtrip_fp8(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    t = 40
    aux = torch.randn(t, N_AUX, H, generator=g) * torch.logspace(-3, 3, t).view(t, 1, 1)
    aux[5] = 0.0  # an all-zero row must survive the amax/448 scale
    hidden = torch.randn(t, H, generator=g) * 7
    ids = torch.arange(t)
    mask = torch.ones(t, dtype=torch.bool)
    with FeatureStoreWriter(tmp_path, meta=META, dtype="fp8") as w:
        assert w.add("a", ids, mask, aux, hidden)

    fs = FeatureStore(tmp_path, out_dtype=torch.float32)
    fs.verify()
    got = fs.get(0)
    assert got["aux_hidden_states"].dtype == torch.float32
    for want, have in ((aux, got["aux_hidden_states"]), (hidden, got["hidden_state"])):
        amax = want.abs().amax(dim=-1)
        err = (have - want).abs().amax(dim=-1)
        # e4m3 keeps 3 mantissa bits: rounding error <= 2^-4 of |x| <= 6.25% of the row amax.
        assert bool((err <= 0.07 * amax + 1e-30).all()), (err / amax.clamp_min(1e-30)).max()
    assert torch.equal(got["aux_hidden_states"][5], torch.zeros(N_AUX, H))
    assert fs.get(0)["hidden_state"].dtype == torch.float32
    assert FeatureStore(tmp_path).get(0)["hidden_state"].dtype == torch.bfloat16

    # fp8 halves the payload: compare a realistic-width sample stored both ways.
    wide_aux, wide_hidden = torch.randn(t, N_AUX, 512, generator=g), torch.randn(t, 512, generator=g)
    sizes = {}
    for dtype in ("bf16", "fp8"):
        with FeatureStoreWriter(tmp_path / dtype, meta={"run": 1}, dtype=dtype) as w:
            assert w.add("a", ids, mask, wide_aux, wide_hidden)
        sizes[dtype] = FeatureStore(tmp_path / dtype).bytes_per_token
        assert sizes[dtype] < 1.05 * estimate_bytes_per_token(512, N_AUX, dtype)
    assert sizes["fp8"] < 0.55 * sizes["bf16"]
    assert estimate_bytes_per_token(4096, 3, "bf16") == 32_773
    assert estimate_bytes_per_token(4096, 3, "fp8") == 16_397  # fp8 payload + one bf16 scale per row


# ---------------------------------------------------------------------------------------------- rejection


def test_nonfinite_rejected_and_counted(tmp_path: Path) -> None:
    good = make_sample(0)
    with FeatureStoreWriter(tmp_path, meta=META, dtype="bf16") as w:
        bad_aux = [a.clone() for a in good["aux"]]
        bad_aux[1][0, 3] = float("nan")
        assert not w.add("nan-aux", good["input_ids"], good["loss_mask"], bad_aux, good["hidden"])
        bad_hidden = good["hidden"].clone()
        bad_hidden[-1, 0] = float("-inf")
        assert not w.add("inf-hidden", good["input_ids"], good["loss_mask"], good["aux"], bad_hidden)
        huge = good["hidden"].double()
        huge[0, 0] = 1e39  # finite in float64, inf once stored as bf16
        assert not w.add("overflow", good["input_ids"], good["loss_mask"], good["aux"], huge)
        assert add(w, "ok", good)
        assert not w.has("nan-aux")
    assert (w.rejected_nonfinite, w.written) == (3, 1)
    assert FeatureStore(tmp_path).sample_ids == ["ok"]

    with FeatureStoreWriter(tmp_path / "fp8", meta=META, dtype="fp8") as w:
        assert not w.add("nan", good["input_ids"], good["loss_mask"], bad_aux, good["hidden"])
    assert w.rejected_nonfinite == 1 and len(FeatureStore(tmp_path / "fp8")) == 0


def test_shape_validation(tmp_path: Path) -> None:
    s = make_sample(0, t=5)
    with FeatureStoreWriter(tmp_path, meta=META) as w:
        with pytest.raises(ValueError, match="loss_mask"):
            w.add("x", s["input_ids"], s["loss_mask"][:4], s["aux"], s["hidden"])
        with pytest.raises(ValueError, match="aux"):
            w.add("x", s["input_ids"], s["loss_mask"], [a[:, :4] for a in s["aux"]], s["hidden"])
        with pytest.raises(ValueError, match="hidden size"):
            w.add(
                "x",
                s["input_ids"],
                s["loss_mask"],
                [a.repeat(1, 2) for a in s["aux"]],
                s["hidden"].repeat(1, 2),
            )
        with pytest.raises(ValueError, match="aux hidden states"):
            w.add("x", s["input_ids"], s["loss_mask"], s["aux"][:2], s["hidden"])
        with pytest.raises(TypeError, match="integer"):
            w.add("x", s["input_ids"].float(), s["loss_mask"], s["aux"], s["hidden"])
        # A leading batch dim of 1 (HF-style capture output) is accepted.
        batched = [a[None] for a in s["aux"]]
        assert w.add("x", s["input_ids"][None], s["loss_mask"][None], batched, s["hidden"][None])
    assert FeatureStore(tmp_path).get(0)["aux_hidden_states"].shape == (5, N_AUX, H)


# ---------------------------------------------------------------------------------------------- resume / meta


def test_resume_skips_existing(tmp_path: Path) -> None:
    write_store(tmp_path, 5, flush_every=2)
    extra = [make_sample(i) for i in range(8)]
    with FeatureStoreWriter(tmp_path, meta=dict(META), flush_every=2) as w:
        assert w.has("s0") and w.has("s4") and not w.has("s5")
        for i, s in enumerate(extra):
            add(w, f"s{i}", s)
        assert not add(w, "s7", extra[7])  # already buffered in this session: still exactly once
    assert (w.skipped_existing, w.written) == (6, 3)
    fs = FeatureStore(tmp_path)
    assert fs.sample_ids == [f"s{i}" for i in range(8)]
    fs.verify()
    assert torch.equal(fs.get_by_id("s6")["input_ids"], extra[6]["input_ids"])


def test_meta_or_dtype_mismatch_on_reopen(tmp_path: Path) -> None:
    write_store(tmp_path, 2)
    before = (tmp_path / MANIFEST_NAME).read_bytes()
    with pytest.raises(StoreMismatch, match="target_fingerprint.*abc.*zzz"):
        FeatureStoreWriter(tmp_path, meta={**META, "target_fingerprint": "zzz"})
    with pytest.raises(StoreMismatch, match="dtype"):
        FeatureStoreWriter(tmp_path, meta=META, dtype="fp8")
    assert (tmp_path / MANIFEST_NAME).read_bytes() == before
    # Equivalent JSON (tuple vs list, key order) is the same meta.
    same = {k: META[k] for k in reversed(META)} | {"aux_layer_ids": (2, 5, 8)}
    with FeatureStoreWriter(tmp_path, meta=same) as w:
        assert w.has("s1")


def test_check_meta(tmp_path: Path) -> None:
    write_store(tmp_path, 1)
    fs = FeatureStore(tmp_path)
    assert fs.check_meta({**META, "aux_layer_ids": (2, 5, 8)}, ["aux_layer_ids", "tokenizer"]) == []
    with pytest.raises(StoreMismatch, match=r"'tokenizer' is 'tok-1' but expected 'tok-2'"):
        fs.check_meta({**META, "tokenizer": "tok-2"}, ["aux_layer_ids", "tokenizer"])
    with pytest.raises(StoreMismatch, match="missing"):
        fs.check_meta({**META, "chat_template": "x"}, ["chat_template"])
    with pytest.warns(UserWarning, match="force"):
        assert fs.check_meta({**META, "tokenizer": "tok-2"}, ["tokenizer"], force=True) == ["tokenizer"]


def test_single_writer_lock(tmp_path: Path) -> None:
    with FeatureStoreWriter(tmp_path, meta=META), pytest.raises(StoreError, match="another"):
        FeatureStoreWriter(tmp_path, meta=META)
    FeatureStoreWriter(tmp_path, meta=META).close()  # released on close


# ---------------------------------------------------------------------------------------------- integrity


def test_flipped_byte_detected(tmp_path: Path) -> None:
    write_store(tmp_path, 9, flush_every=3)
    shard = read_manifest(tmp_path)["shards"][1]["file"]
    flip_byte(tmp_path / shard)

    with pytest.raises(StoreCorrupt, match=shard):
        FeatureStore(tmp_path).verify()
    with pytest.raises(StoreCorrupt, match=shard):
        list(FeatureStore(tmp_path).iter_shuffled(seed=0))
    with pytest.raises(StoreCorrupt, match=shard):
        FeatureStore(tmp_path).get(4)
    FeatureStore(tmp_path).get(0)  # other shards stay readable
    assert len(list(FeatureStore(tmp_path).iter_shuffled(seed=0, verify=False))) == 9

    (tmp_path / shard).write_bytes((tmp_path / shard).read_bytes()[:-100])  # truncated copy
    with pytest.raises(StoreCorrupt, match=f"{shard} has .* bytes"):
        FeatureStore(tmp_path).verify()
    (tmp_path / shard).unlink()
    with pytest.raises(StoreCorrupt, match=f"{shard} is missing"):
        FeatureStore(tmp_path).verify()


class _CountingSafeOpen:
    """Wraps safetensors.safe_open to record how many shard handles are open at once."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.open = 0
        self.peak = 0
        self.total = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        outer = self
        inner = self.real(*args, **kwargs)

        class Handle:
            def __enter__(self) -> Any:
                outer.open += 1
                outer.total += 1
                outer.peak = max(outer.peak, outer.open)
                return inner.__enter__()

            def __exit__(self, *exc: Any) -> Any:
                outer.open -= 1
                return inner.__exit__(*exc)

        return Handle()


def test_iter_shuffled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 25
    write_store(tmp_path, n, flush_every=3)
    fs = FeatureStore(tmp_path)
    n_shards = len(fs.shards)
    assert n_shards == 9
    shard_of = {sid: fs.shard_of(i) for i, sid in enumerate(fs.sample_ids)}

    for buffer_shards in (1, 2, 3):
        counter = _CountingSafeOpen(safe_open)
        monkeypatch.setattr(reader_mod, "safe_open", counter)
        items = list(FeatureStore(tmp_path).iter_shuffled(seed=7, buffer_shards=buffer_shards))
        ids = [x["sample_id"] for x in items]
        assert sorted(ids) == sorted(fs.sample_ids) and len(set(ids)) == n
        assert counter.peak == buffer_shards and counter.open == 0 and counter.total == n_shards
        switches = sum(shard_of[a] != shard_of[b] for a, b in zip(ids, ids[1:], strict=False))
        if buffer_shards == 1:
            assert switches == n_shards - 1  # one shard at a time
        else:
            assert switches > n_shards  # samples from open shards are interleaved
        for x in items[:3]:
            assert torch.equal(x["input_ids"], fs.get_by_id(x["sample_id"])["input_ids"])
    monkeypatch.undo()

    order = lambda seed: [x["sample_id"] for x in fs.iter_shuffled(seed=seed)]
    assert order(1) == order(1)
    assert order(1) != order(2)
    assert order(1) != fs.sample_ids

    # Abandoning the iterator early closes its handles.
    counter = _CountingSafeOpen(safe_open)
    monkeypatch.setattr(reader_mod, "safe_open", counter)
    it = fs.iter_shuffled(seed=3)
    next(it)
    it.close()
    assert counter.open == 0


# ---------------------------------------------------------------------------------------------- crashes


def _store_is_consistent(root: Path) -> dict[str, Any]:
    """The manifest lists only complete shards whose checksums match."""
    m = read_manifest(root)
    FeatureStore(root).verify()
    return m


@pytest.mark.slow  # writer interpreters that import torch, killed mid-write
def test_kill9_then_resume(tmp_path: Path) -> None:
    n = 60
    root = tmp_path / "store"
    src = Path(draftsmith.__file__).resolve().parents[1]  # the directory holding the package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    cmd = [
        sys.executable,
        str(_PROC_PATH),
        str(root),
        str(n),
        "--shard-max-bytes",
        "3000",
        "--flush-every",
        "3",
    ]
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)

    committed = 0
    for _ in range(2):  # two crashes at random moments, then a clean finish
        p = subprocess.Popen([*cmd, "--sleep", "0.01"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        target = committed + rng.randint(2, 8)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and p.poll() is None:
            try:
                if read_manifest(root)["num_samples"] >= target:
                    break
            except (FileNotFoundError, json.JSONDecodeError):
                pass
            time.sleep(0.005)
        assert p.poll() is None, f"writer exited early: {p.communicate()}"
        time.sleep(rng.uniform(0, 0.04))
        os.kill(p.pid, signal.SIGKILL)
        p.communicate()
        assert p.returncode == -signal.SIGKILL
        m = _store_is_consistent(root)
        assert m["num_samples"] >= committed, f"seed={seed}"
        committed = m["num_samples"]

    assert 0 < committed < n, f"seed={seed}"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    counters = json.loads(done.stdout.strip().splitlines()[-1])
    assert counters == {"written": n - committed, "skipped": committed, "rejected": 0}, f"seed={seed}"

    m = _store_is_consistent(root)
    listed = {sh["file"] for sh in m["shards"]}
    assert {p.name for p in root.glob("shard-*")} == listed, "unlisted shard left behind"
    assert not list(root.glob(".*.tmp")), "temp file left behind"
    fs = FeatureStore(root, out_dtype=torch.float32)
    ids = fs.sample_ids
    assert len(ids) == len(set(ids)) == n and set(ids) == {proc_mod.sample_id(i) for i in range(n)}
    for i in range(n):
        want = proc_mod.synth_sample(i)
        got = fs.get_by_id(proc_mod.sample_id(i))
        assert torch.equal(got["input_ids"], want["input_ids"])
        assert torch.equal(got["loss_mask"], want["loss_mask"])
        assert torch.equal(got["aux_hidden_states"], want["aux_hidden_states"].bfloat16().float())
        assert torch.equal(got["hidden_state"], want["hidden_state"].bfloat16().float())


def _failing_writes(monkeypatch: pytest.MonkeyPatch, match: str) -> None:
    """Simulate ENOSPC on files whose name contains `match`: half the bytes land, then the error."""
    real = io_mod.write_file_durably

    def fake(path: Path, data: bytes) -> None:
        if match in path.name:
            path.write_bytes(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(io_mod, "write_file_durably", fake)


def test_disk_full_during_shard_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    samples = [make_sample(i) for i in range(6)]
    w = FeatureStoreWriter(tmp_path, meta=META, flush_every=2)
    for i in range(2):
        add(w, f"s{i}", samples[i])
    before = (tmp_path / MANIFEST_NAME).read_bytes()

    _failing_writes(monkeypatch, "shard-")
    add(w, "s2", samples[2])
    with pytest.raises(StoreWriteError, match="No space left.*still lists 1 shards / 2 samples"):
        add(w, "s3", samples[3])
    assert (tmp_path / MANIFEST_NAME).read_bytes() == before
    assert not list(tmp_path.glob(".*.tmp")) and len(list(tmp_path.glob("shard-*"))) == 1
    assert FeatureStore(tmp_path).sample_ids == ["s0", "s1"]

    monkeypatch.undo()  # space freed: the buffered samples were kept, so a retry commits them
    w.flush()
    for i in range(4, 6):
        add(w, f"s{i}", samples[i])
    w.close()
    fs = FeatureStore(tmp_path)
    fs.verify()
    assert fs.sample_ids == [f"s{i}" for i in range(6)]


def test_disk_full_during_manifest_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _failing_writes(monkeypatch, MANIFEST_NAME)
    with pytest.raises(StoreWriteError, match="No space left"):
        FeatureStoreWriter(tmp_path / "new", meta=META)  # creating a store writes its manifest first
    assert not (tmp_path / "new" / MANIFEST_NAME).exists() and not list((tmp_path / "new").glob(".*.tmp"))
    monkeypatch.undo()

    write_store(tmp_path, 2)
    before = (tmp_path / MANIFEST_NAME).read_bytes()
    with pytest.raises(StoreWriteError), FeatureStoreWriter(tmp_path, meta=META, flush_every=100) as w:
        add(w, "s2", make_sample(2))
        _failing_writes(monkeypatch, MANIFEST_NAME)
        w.flush()  # the shard is renamed into place, but the manifest cannot be updated
    monkeypatch.undo()
    assert (tmp_path / MANIFEST_NAME).read_bytes() == before
    assert len(list(tmp_path.glob("shard-*"))) == 2  # one unlisted shard
    assert FeatureStore(tmp_path).sample_ids == ["s0", "s1"]

    with FeatureStoreWriter(tmp_path, meta=META) as w:  # reopen cleans up, then resumes
        assert not w.has("s2")
        assert len(list(tmp_path.glob("shard-*"))) == 1
        add(w, "s2", make_sample(2))
    fs = FeatureStore(tmp_path)
    fs.verify()
    assert fs.sample_ids == ["s0", "s1", "s2"]
