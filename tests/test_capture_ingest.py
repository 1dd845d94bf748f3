"""The ingest side of ``capture --backend vllm`` without vLLM: a fake engine fills the spool the way the worker does.

Exactly once (a crash after some commits, rerun: every sample once, spooled states reused without the engine),
spool files released only after their shard is committed, non-finite states refused (never stored, counted,
named), corrupt spool files refused with a clear error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from draftsmith.data.store import FeatureStore
from draftsmith.model.target import Target
from draftsmith.stages.capture import CaptureConfig, capture
from draftsmith.stages.capture.spool import Spool, SpoolCorrupt, spool_key
from draftsmith.stages.capture.vllm import capture_vllm
from draftsmith.testing.models import build_tiny_model, tiny_chat_corpus
from draftsmith.testing.tokenizer import make_tokenizer

N = 12


class FakeEngine:
    """Writes what the capture hooks write: the real target's features (float32) per prefill, named by spool_key."""

    def __init__(self, target: Target, spool: Path, poison: set[str] = frozenset()) -> None:
        self.target, self.spool, self.poison, self.prompts = target, spool, poison, 0
        self.committed_when_written: list[int] = []

    def prefill(self, by_rank: list[list[list[int]]]) -> None:
        for prompts in by_rank:
            for ids in prompts:
                out = self.target.forward(torch.tensor([ids]), logits_to_keep=1)
                aux = torch.stack(out.aux_hidden_states, dim=2)[0]
                if spool_key(ids) in self.poison:
                    aux[1, 0, 0] = float("nan")
                self.spool.mkdir(parents=True, exist_ok=True)
                save_file({"input_ids": torch.tensor(ids, dtype=torch.int32), "aux": aux.contiguous(),
                           "hidden": out.hidden_state[0].contiguous()}, self.spool / f"{spool_key(ids)}.safetensors")
                self.prompts += 1


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ingest")
    tok = make_tokenizer("chatml")
    target = Target(build_tiny_model("llama", vocab_size=len(tok), seed=0), tok)
    conv = root / "conv.jsonl"
    with open(conv, "w") as f:
        for i, c in enumerate(tiny_chat_corpus(N, seed=1)):
            f.write(json.dumps({"id": f"c{i}", "messages": c}) + "\n")
    return root, target, tok, conv


def _cfg(conv: Path, out: Path, **kw) -> CaptureConfig:
    return CaptureConfig(conversations=conv, out=out, draft_vocab_size=None, progress=False, sort_window=4,
                         shard_max_bytes=1, **kw)


def test_ingest_equals_hf_capture_and_releases_the_spool(setup, tmp_path):
    root, target, tok, conv = setup
    ref = capture(target, tok, _cfg(conv, tmp_path / "hf"))
    spool = tmp_path / "vllm.spool"
    rep = capture_vllm(target, tok, _cfg(conv, tmp_path / "vllm"), FakeEngine(target, spool), spool,
                       target_dtype="float32")
    assert ref.counts.captured == rep.counts.captured == N and rep.counts.accounted() == N
    a, b = FeatureStore(tmp_path / "hf"), FeatureStore(tmp_path / "vllm")
    assert a.meta == b.meta
    for sid in a.sample_ids:
        x, y = a.get_by_id(sid), b.get_by_id(sid)
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        for k in ("aux_hidden_states", "hidden_state"):  # HF batches (padding), the fake engine does not
            torch.testing.assert_close(x[k].float(), y[k].float(), rtol=1.6e-2, atol=1e-2)
    assert not spool.exists()


def test_spool_file_deleted_only_after_its_shard_commits(setup, tmp_path):
    root, target, tok, conv = setup
    spool_dir = tmp_path / "sp"
    from draftsmith.data.store import FeatureStoreWriter

    ids = [5, 6, 7]
    FakeEngine(target, spool_dir).prefill([[ids]])
    with FeatureStoreWriter(tmp_path / "s", meta={"kind": "t"}, shard_max_bytes=1 << 30) as writer:
        spool = Spool(spool_dir, writer)
        key = spool_key(ids)
        aux, hidden = spool.read(key, ids, 3, target.hidden_size)
        writer.add("a", torch.tensor(ids), torch.ones(3, dtype=torch.bool), aux, hidden)
        spool.added(key)
        assert spool.has(key)  # buffered, not committed: a crash now must find the file again
        writer.flush()
        spool.release()
        assert not spool.has(key)


def test_crash_then_rerun_exactly_once_reuses_spooled_states(setup, tmp_path, monkeypatch):
    root, target, tok, conv = setup
    spool, out = tmp_path / "s.spool", tmp_path / "s"
    engine = FakeEngine(target, spool)
    calls = {"n": 0}
    real_added = Spool.added

    def crash_after_some(self, key):
        real_added(self, key)
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt  # stands in for kill -9 between two commits (nothing runs after it)

    monkeypatch.setattr(Spool, "added", crash_after_some)
    with pytest.raises(KeyboardInterrupt):
        capture_vllm(target, tok, _cfg(conv, out), engine, spool, target_dtype="float32")
    monkeypatch.setattr(Spool, "added", real_added)
    committed = len(FeatureStore(out))
    pending = len(list(spool.glob("*.safetensors")))
    assert committed == 6 and pending == 8 - 6  # window 2 (4 samples) spooled, 2 of them committed
    before = engine.prompts
    rep = capture_vllm(target, tok, _cfg(conv, out), engine, spool, target_dtype="float32")
    assert rep.counts.already_stored == committed and rep.counts.captured == N - committed
    assert engine.prompts - before == N - 8  # the 2 spooled but uncommitted ones were not prefilled again
    store = FeatureStore(out)
    store.verify()
    assert sorted(store.sample_ids) == sorted(f"c{i}" for i in range(N))
    assert not spool.exists()


def test_nonfinite_states_are_refused_never_stored(setup, tmp_path):
    root, target, tok, conv = setup
    first = json.loads(conv.read_text().splitlines()[0])
    from draftsmith.data.chat import tokenize_conversation

    key = spool_key(tokenize_conversation(tok, first["messages"], 2048).input_ids)
    spool = tmp_path / "p.spool"
    rep = capture_vllm(target, tok, _cfg(conv, tmp_path / "p"), FakeEngine(target, spool, {key}), spool,
                       target_dtype="float32")
    assert rep.counts.nonfinite == 1 and rep.counts.captured == N - 1
    assert "c0" not in FeatureStore(tmp_path / "p").sample_ids
    rows = [json.loads(line) for line in rep.errors_file.read_text().splitlines()]
    assert rows[0]["id"] == "c0" and "NaN/Inf in the engine's states" in rows[0]["reason"]


def test_corrupt_spool_file_is_refused(setup, tmp_path):
    root, target, tok, conv = setup
    from draftsmith.data.store import FeatureStoreWriter

    spool_dir = tmp_path / "c"
    FakeEngine(target, spool_dir).prefill([[[5, 6, 7]]])
    key = spool_key([5, 6, 7])
    with FeatureStoreWriter(tmp_path / "s", meta={"kind": "t"}) as writer:
        spool = Spool(spool_dir, writer)
        with pytest.raises(SpoolCorrupt, match="holds other token ids"):
            spool.read(key, [5, 6, 8], 3, target.hidden_size)
        assert (spool_dir / f"{key}.corrupt").is_file() and not spool.has(key)
        (spool_dir / f"{key}.safetensors").write_bytes(b"garbage")
        with pytest.raises(SpoolCorrupt, match="unreadable"):
            spool.read(key, [5, 6, 7], 3, target.hidden_size)
