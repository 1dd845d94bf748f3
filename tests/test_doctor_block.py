"""doctor on block drafters (DFlash, DSpark): each engine's reading of the layout, ids, mask and slot convention.

The target is the llama config fixture (8 layers, width 128, 256 tokens); drafters are draftsmith exports of tiny
random checkpoints, edited into the broken shapes the engines misread or refuse.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from draftsmith.core import vllm_facts
from draftsmith.core.pysource import VllmSource
from draftsmith.stages.doctor import diagnose
from draftsmith.stages.export.block import ExportError, export_block
from draftsmith.testing.blocks import random_block_checkpoint, tiny_spec

FIXTURES = Path(__file__).parent / "fixtures" / "configs"


@pytest.fixture(autouse=True)
def vllm_cpu(monkeypatch):
    """The vLLM checked against is the CPU build (as here), stated rather than read from this environment."""
    monkeypatch.setattr(VllmSource, "installed", classmethod(lambda cls: None))
    monkeypatch.setattr(vllm_facts, "installed_vllm_version", lambda: None)
    monkeypatch.setattr(vllm_facts, "installed_vllm_distribution", lambda python=None: "vllm-cpu")


@pytest.fixture
def target(tmp_path) -> Path:
    return Path(shutil.copytree(FIXTURES / "llama", tmp_path / "target"))


def _drafter(tmp_path, kind, fmt, **over) -> Path:
    spec = tiny_spec(kind, hidden_size=128, target_hidden_size=128, head_dim=32, **over)
    out = tmp_path / f"{kind}-{fmt}"
    export_block(random_block_checkpoint(spec), out, fmt, verifier="org/target")
    return out


def _edit(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def _errors(report) -> list[str]:
    return report.ids("error")


def test_dflash_vllm_export_is_clean_on_vllm_cpu(tmp_path, target):
    r = diagnose(target, _drafter(tmp_path, "dflash", "vllm"), engine="vllm", engine_version="0.32")
    assert _errors(r) == [], r.summary()
    assert r.facts["block_kind"] == "dflash" and r.facts["block_layer_ids"] == [2, 4, 6]
    assert r.facts["block_slot"] == "fill_in"


def test_dspark_on_vllm_cpu_quotes_the_engine(tmp_path, target):
    r = diagnose(target, _drafter(tmp_path, "dspark", "vllm"), engine="vllm", engine_version="0.32")
    cpu = [f for f in r.findings if f.id == "block.cpu"]
    assert cpu and cpu[0].severity == "error"
    assert "Model Runner V1 does not support: dspark speculative decoding" in cpu[0].message
    assert "block.slot" not in _errors(r)  # the slot convention itself is read right


def test_speculators_dspark_in_sglang_is_refused(tmp_path, target):
    d = _drafter(tmp_path, "dspark", "speculators")
    r = diagnose(target, d, engine="sglang")
    assert "block.slot" in _errors(r), r.summary()


def test_fill_in_dspark_read_anchor_first_is_the_silent_case(tmp_path, target):
    """A fill-in DSpark in DeepSpec's layout (no speculators keys): SGLang loads it and reads every slot
    anchor-first: ~1.1 accepted tokens a round, no error from the engine. doctor says so."""
    d = _drafter(tmp_path, "dspark", "vllm", slot="fill_in")
    _edit(d, sample_from_anchor=False)
    r = diagnose(target, d, engine="sglang")
    slot = [f for f in r.findings if f.id == "block.slot"]
    assert slot and "1.1" in slot[0].message
    assert "block.slot" not in _errors(diagnose(target, d, engine="vllm", engine_version="0.32"))


def test_speculators_dspark_without_the_flag_is_misread_by_vllm(tmp_path, target):
    d = _drafter(tmp_path, "dspark", "speculators")
    _edit(d, sample_from_anchor=None)  # speculators' class default: anchor-first; vLLM's reader: false
    r = diagnose(target, d, engine="vllm", engine_version="0.32")
    assert r.facts["block_slot"] == "anchor_first"
    assert "block.slot" in _errors(r)


def test_anchor_first_dflash_is_misread_by_vllm(tmp_path, target):
    d = _drafter(tmp_path, "dflash", "vllm")
    _edit(d, sample_from_anchor=True)
    assert "block.slot" in _errors(diagnose(target, d, engine="vllm", engine_version="0.32"))


def test_mask_token_outside_the_embedding(tmp_path, target):
    d = _drafter(tmp_path, "dflash", "vllm")
    _edit(d, dflash_config={"mask_token_id": 300, "target_layer_ids": [1, 3, 5]})
    r = diagnose(target, d, engine="vllm", engine_version="0.32")
    assert "block.mask" in _errors(r)


def test_target_layers_out_of_range(tmp_path, target):
    d = _drafter(tmp_path, "dflash", "vllm")
    _edit(d, dflash_config={"mask_token_id": 250, "target_layer_ids": [1, 3, 8]})  # output of layer 8: no such layer
    assert "block.layers" in _errors(diagnose(target, d, engine="vllm", engine_version="0.32"))


def test_gated_markov_head_not_computed_by_vllm_or_llamacpp(tmp_path, target):
    d = _drafter(tmp_path, "dspark", "sglang", markov_head_type="gated")
    assert "block.markov" in _errors(diagnose(target, d, engine="vllm", engine_version="0.32"))
    assert "block.markov" not in _errors(diagnose(target, d, engine="sglang"))


def test_block_size_against_speculative_tokens(tmp_path, target):
    d = _drafter(tmp_path, "dflash", "speculators")
    cfg = json.loads((d / "config.json").read_text())
    cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 6  # block 4 fill-in: 3 drafts
    (d / "config.json").write_text(json.dumps(cfg))
    r = diagnose(target, d, engine="vllm", engine_version="0.32")
    assert any(f.id == "block.size" and f.severity == "warning" for f in r.findings)


# --- llama.cpp: a dflash GGUF or a block directory against the target it serves ---------------------------------
def _tiny_target_gguf(path: Path, layers: int = 8, width: int = 128, vocab: int = 256) -> Path:
    """A llama GGUF with its keys and a small token embedding: what the export and doctor read of a target (a
    target with no tensors at all is a finding of its own)."""
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(path, "llama")
    w.add_block_count(layers)
    w.add_embedding_length(width)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_llamacpp_block_gguf_is_clean_and_layers_out_of_range_are_not(tmp_path, kind):
    from draftsmith.stages.doctor.llamacpp_checks import diagnose_llamacpp
    from draftsmith.stages.export.block_gguf import export_block_gguf

    tg = _tiny_target_gguf(tmp_path / "t.gguf")
    spec = tiny_spec(kind, hidden_size=128, target_hidden_size=128, head_dim=32)
    gguf = export_block_gguf(random_block_checkpoint(spec), tmp_path / "d.gguf", target=tg, dtype="fp32").path
    r = diagnose_llamacpp(tg, gguf)
    assert r.ids("error") == [], r.summary()
    assert r.facts["block_kind"] == kind and r.facts["block_layer_ids"] == [2, 4, 6]
    shallow = _tiny_target_gguf(tmp_path / "shallow.gguf", layers=5)
    assert "block.layers" in diagnose_llamacpp(shallow, gguf).ids("error")


def test_llamacpp_block_export_refuses_what_it_would_misread(tmp_path):
    from draftsmith.stages.export.block_gguf import export_block_gguf

    tg = _tiny_target_gguf(tmp_path / "t.gguf")
    narrow = tiny_spec("dflash", hidden_size=64, target_hidden_size=128, head_dim=16)
    with pytest.raises(ExportError, match="as wide as the target"):
        export_block_gguf(random_block_checkpoint(narrow), tmp_path / "a.gguf", target=tg)
    gated = tiny_spec("dspark", hidden_size=128, target_hidden_size=128, head_dim=32, markov_head_type="gated")
    with pytest.raises(ExportError, match="vanilla"):
        export_block_gguf(random_block_checkpoint(gated), tmp_path / "b.gguf", target=tg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.gguf"]  # nothing half-written
