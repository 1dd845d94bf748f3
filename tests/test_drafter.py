"""The EAGLE-3 drafter: structure, checkpoint layout, save/load, and fit checks against a target."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_target
from safetensors.torch import load_file, save_file

from draftsmith.core import vocab as vocab_mod
from draftsmith.model.drafter import DrafterError, KVCache, load_drafter, new_drafter
from draftsmith.model.target import Target

EXPECTED_WEIGHTS = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    "layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight", "layers.0.post_attention_layernorm.weight",
    "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight", "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
}


def _drafter(arch="llama", **kw):
    target = tiny_target(arch)
    dv = vocab_mod.from_target_ids(torch.arange(10, 210, 2), target.vocab_size)
    return target, new_drafter(target, draft_vocab=dv, **kw)


def test_shapes_follow_field_notes():
    target, d = _drafter()
    h = target.hidden_size
    assert d.fc.weight.shape == (h, 3 * h)
    attn = d.layers[0].self_attn
    assert attn.q_proj.weight.shape[1] == 2 * h and attn.k_proj.weight.shape[1] == 2 * h
    assert d.lm_head.weight.shape == (100, h)
    assert "embed_tokens.weight" not in d.state_dict()  # shared with the target, never saved


def test_target_hidden_size_may_differ():
    target = tiny_target("llama")
    d = new_drafter(target, hidden_size=96, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128)
    assert d.fc.weight.shape == (96, 3 * target.hidden_size)
    ids = torch.randint(3, 250, (1, 6))
    out = target(ids)
    h = d(d.fuse(out.aux_hidden_states), ids, torch.arange(6)[None])
    assert h.shape == (1, 6, 96)
    # The embedding (target width 64) is not the drafter's width: the drafter needs its own input norm width.
    assert d.logits(h).shape == (1, 6, d.config.draft_vocab_size)


def test_incremental_drafting_with_cache_equals_full_pass():
    target, d = _drafter()
    ids = torch.randint(3, 250, (1, 10))
    g = d.fuse(target(ids).aux_hidden_states)
    pos = torch.arange(10)[None]
    full = d(g, ids, pos)
    cache = KVCache()
    a = d(g[:, :7], ids[:, :7], pos[:, :7], cache)
    b = d(g[:, 7:], ids[:, 7:], pos[:, 7:], cache)
    torch.testing.assert_close(torch.cat([a, b], 1), full)
    cache.crop(7)
    assert len(cache) == 7
    b2 = d(g[:, 7:], ids[:, 7:], pos[:, 7:], cache)
    torch.testing.assert_close(b2, b)


def test_save_load_round_trip_identical_logits(tmp_path):
    target, d = _drafter()
    d.save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 100 and cfg["vocab_size"] == target.vocab_size
    assert cfg["target_hidden_size"] == target.hidden_size
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert set(load_file(tmp_path / "model.safetensors")) == EXPECTED_WEIGHTS
    loaded = load_drafter(tmp_path, target)
    ids = torch.randint(3, 250, (1, 8))
    out = target(ids)
    pos = torch.arange(8)[None]
    torch.testing.assert_close(loaded.logits(loaded(loaded.fuse(out.aux_hidden_states), ids, pos)),
                               d.logits(d(d.fuse(out.aux_hidden_states), ids, pos)), atol=0, rtol=0)
    assert torch.equal(loaded.d2t, d.d2t) and torch.equal(loaded.t2d, d.t2d)


def test_loads_reference_midlayer_checkpoint(tmp_path):
    """EAGLE reference / SpecForge checkpoints name the layer ``midlayer`` and may carry embed_tokens."""
    target, d = _drafter()
    d.save(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state = {k.replace("layers.0.", "midlayer."): v for k, v in state.items()}
    state["embed_tokens.weight"] = torch.zeros(target.vocab_size, target.hidden_size, dtype=torch.float64)
    save_file(state, tmp_path / "model.safetensors")
    loaded = load_drafter(tmp_path, target)
    torch.testing.assert_close(loaded.fc.weight, d.fc.weight)


def test_mismatched_target_named_at_load(tmp_path):
    _, d = _drafter("llama")
    d.save(tmp_path)
    other = Target(tiny_target("llama").model, aux_layers=(1, 2, 3, 4))
    with pytest.raises(DrafterError, match=r"3 aux layers \[2, 4, 5\] != target.s 4"):
        load_drafter(tmp_path, other)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["target_hidden_size"] = 4096
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DrafterError, match="target_hidden_size 4096 != target hidden_size 64"):
        load_drafter(tmp_path, tiny_target("llama"))
    cfg["target_hidden_size"] = 64
    cfg["vocab_size"] = 1000
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DrafterError, match="vocab_size 1000 != target vocab_size 256"):
        load_drafter(tmp_path, tiny_target("llama"))


def test_unknown_weight_names_fail_loudly(tmp_path):
    """SGLang silently skips unknown keys; draftsmith refuses them instead."""
    target, d = _drafter()
    d.save(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["layers.0.self_attn.qkv_proj.weight"] = state.pop("layers.0.self_attn.q_proj.weight")
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(DrafterError, match="q_proj"):
        load_drafter(tmp_path, target)


def test_vocab_validation():
    dv = vocab_mod.from_target_ids(torch.tensor([5, 1, 9, 5]), 12)
    assert dv.target_ids().tolist() == [1, 5, 9]
    vocab_mod.validate(dv.d2t, dv.t2d, 12)
    with pytest.raises(vocab_mod.VocabError, match="outside the vocabulary"):
        vocab_mod.validate(dv.d2t, None, 8)
    bad_t2d = dv.t2d.clone()
    bad_t2d[2] = True
    with pytest.raises(vocab_mod.VocabError, match="disagree"):
        vocab_mod.validate(dv.d2t, bad_t2d, 12)
    with pytest.raises(vocab_mod.VocabError, match="strictly increasing"):
        vocab_mod.validate(torch.tensor([3, 0, 0]), None, 12)
    counts = torch.tensor([0, 10, 3, 7, 0, 1.0])
    dv, coverage = vocab_mod.from_counts(counts, 3)
    assert dv.target_ids().tolist() == [1, 2, 3] and coverage == pytest.approx(20 / 21)
