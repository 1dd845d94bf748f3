"""DFlash/DSpark block drafters: the training pass and the decoding path compute the same thing, the context is
seen only before the anchor, save/load round-trips, and the kind registry finds each kind."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import block_target, tiny_target

from draftsmith.core import vocab as vocab_mod
from draftsmith.core.errors import UsageError
from draftsmith.model import kinds
from draftsmith.model.block_drafter import (
    BlockCache,
    BlockDrafterConfig,
    default_target_layer_ids,
    load_block_drafter,
    new_block_drafter,
)
from draftsmith.model.drafter import DrafterError, new_drafter

VARIANTS = {  # (kind, overrides): both slot conventions, every Markov head type, with and without confidence
    "dflash": ("dflash", {}),
    "dspark": ("dspark", {"markov_rank": 16}),
    "dspark-fill-in-gated": ("dspark", {"markov_rank": 8, "sample_from_anchor": False, "block_size": 5,
                                        "markov_head_type": "gated", "confidence_head_with_markov": False}),
    "dspark-rnn": ("dspark", {"markov_rank": 8, "markov_head_type": "rnn", "block_size": 4}),
}


def _drafter(name: str, target=None, **extra):
    """A random drafter, and its target pointed at the drafter's layers (making one leaves the target alone)."""
    kind, overrides = VARIANTS[name]
    target = target or block_target("llama")
    d = new_block_drafter(target, kind, **overrides, **extra)
    target.set_aux_hidden_state_layers(d.config.aux_layer_ids)
    return d


def test_making_a_drafter_leaves_the_target_alone():
    """new_block_drafter only reads the target; the decoder points the target at the drafter's layers itself."""
    from draftsmith.stages.decode import SpeculativeDecoder

    target = block_target("llama")
    before = tuple(target.aux_layers)
    d = new_block_drafter(target, "dspark", markov_rank=8, target_layer_ids=(0, 2))
    assert tuple(target.aux_layers) == before != d.config.aux_layer_ids
    SpeculativeDecoder(target, d)
    assert tuple(target.aux_layers) == d.config.aux_layer_ids


def _decode_hidden(d, aux, ids, anchor: int, split: int) -> torch.Tensor:
    """The decoder's path: context appended in two pieces, then one block at the anchor."""
    cache = BlockCache(d.config.num_hidden_layers)
    for lo, hi in ((0, split), (split, anchor)):
        d.extend_context(tuple(a[:, lo:hi] for a in aux), torch.arange(lo, hi)[None], cache)
    return d.draft_hidden(int(ids[0, anchor]), anchor, d.config.num_drafts, cache)[0]


@pytest.mark.parametrize("name", VARIANTS)
def test_training_pass_equals_decoding_path(name):
    target = block_target("llama")
    d = _drafter(name, target)
    ids = torch.randint(3, 256, (1, 21), generator=torch.Generator().manual_seed(1))
    aux = target(ids).aux_hidden_states
    anchors = torch.tensor([[4, 9, 13]])
    with torch.no_grad():
        out = d.forward_train(aux, ids, anchors)
    k = d.config.num_drafts
    assert out.logits.shape == (1, 3, k, d.config.draft_vocab_size)
    assert out.positions[0, 0].tolist() == list(range(5, 5 + k))  # draft j predicts anchor + 1 + j
    for i, a in enumerate(anchors[0].tolist()):
        hid = _decode_hidden(d, aux, ids, a, split=a // 2)
        torch.testing.assert_close(hid, out.hidden[0, i], rtol=0, atol=1e-10)
        # Markov bias teacher-forced on the tokens that precede each predicted position
        logits = d.logits(hid)
        if d.markov_head is not None:
            state, biases = None, []
            for j in range(k):
                bias, state = d.markov_bias(ids[0, a + j][None], hid[j][None], state)
                biases.append(bias[0])
            logits = logits + torch.stack(biases)
        valid = out.positions[0, i] >= 0
        torch.testing.assert_close(logits[valid], out.logits[0, i][valid], rtol=0, atol=1e-10)
    assert (out.confidence is None) == (not d.config.enable_confidence_head)


def test_block_sees_context_only_before_its_anchor():
    target = block_target("llama")
    d = _drafter("dspark", target)
    ids = torch.randint(3, 256, (1, 16), generator=torch.Generator().manual_seed(2))
    aux = target(ids).aux_hidden_states
    anchors = torch.tensor([[8]])
    with torch.no_grad():
        base = d.forward_train(aux, ids, anchors).hidden
        later = d.forward_train(tuple(torch.cat([a[:, :8], a[:, 8:] + 1.0], 1) for a in aux), ids, anchors).hidden
        earlier = d.forward_train(tuple(torch.cat([a[:, :7] + 1.0, a[:, 7:]], 1) for a in aux), ids, anchors).hidden
    torch.testing.assert_close(later, base, rtol=0, atol=0)
    assert (earlier - base).abs().max() > 1e-3
    # a dropped anchor's block ignores the context entirely
    with torch.no_grad():
        dropped = d.forward_train(aux, ids, anchors, anchor_keep=torch.tensor([[False]])).hidden
        dropped2 = d.forward_train(tuple(a + 1.0 for a in aux), ids, anchors, anchor_keep=torch.tensor([[False]]))
    torch.testing.assert_close(dropped, dropped2.hidden, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["dflash", "dspark-fill-in-gated", "dspark-rnn"])
def test_save_load_round_trip(tmp_path, name):
    target = block_target("qwen3")
    dv = vocab_mod.from_target_ids(torch.arange(0, 256, 2), 256)
    d = _drafter(name, target, draft_vocab=dv)
    d.save(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["draftsmith"]["kind"] == d.kind and cfg["target_layer_ids"] == list(d.config.target_layer_ids)
    assert kinds.kind_of_dir(tmp_path / "d") == d.kind
    target.set_aux_hidden_state_layers(target.get_eagle3_default_aux_hidden_state_layers())
    back = kinds.load_any(tmp_path / "d", target)
    assert back.config == d.config and back.kind == d.kind
    assert target.aux_layers == d.config.aux_layer_ids  # loading points the target at the drafter's layers
    for (name_a, a), (name_b, b) in zip(d.state_dict().items(), back.state_dict().items(), strict=True):
        assert name_a == name_b and torch.equal(a, b), name_a
    assert torch.equal(back.to_target_ids(torch.arange(128)), torch.arange(0, 256, 2))


def test_weight_names_are_the_engines(tmp_path):
    from safetensors import safe_open

    d = _drafter("dspark", num_hidden_layers=1)
    d.save(tmp_path / "d")
    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    layer = {f"layers.0.{n}.weight" for n in (
        "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
        "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj",
        "mlp.down_proj")}
    assert names == layer | {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight",
                             "markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                             "confidence_head.proj.weight", "confidence_head.proj.bias"}


def test_bad_configs_and_files_are_one_clear_error(tmp_path):
    with pytest.raises(DrafterError, match="DFlash has no Markov"):
        _drafter("dflash", markov_rank=4)
    with pytest.raises(DrafterError, match="mask_token_id"):
        _drafter("dflash", mask_token_id=256)
    with pytest.raises(DrafterError, match="drafts"):
        _drafter("dflash", block_size=1)
    with pytest.raises(DrafterError, match="markov_head_type"):
        _drafter("dspark", markov_head_type="lstm")
    with pytest.raises(DrafterError, match="strictly increasing"):  # vLLM would concatenate them as 1, 3
        _drafter("dflash", target_layer_ids=(3, 1))
    d = _drafter("dflash")
    d.save(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    cfg["hidden_size"] = 128
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DrafterError, match="disagree|more than"):
        load_block_drafter(tmp_path / "d")
    with pytest.raises(DrafterError, match="not dspark"):
        kinds.get_kind("dspark").load(_drafter("dflash").save(tmp_path / "e"))
    deep = tiny_target("llama", num_hidden_layers=4)
    with pytest.raises(DrafterError, match="does not fit"):
        load_block_drafter(_drafter("dflash").save(tmp_path / "f"), deep)


def test_kind_registry():
    assert kinds.KIND_NAMES == ("eagle3", "dflash", "dspark")
    target = block_target("llama")
    for name in kinds.KIND_NAMES:
        kind = kinds.get_kind(name)
        assert isinstance(kind, kinds.DrafterKind)
        overrides = {"markov_rank": 8} if name == "dspark" else {}
        assert kinds.kind_of(kind.new(target, **overrides)) == name
        assert kind.drafts_blocks == (name != "eagle3")
    target.set_aux_hidden_state_layers(target.get_eagle3_default_aux_hidden_state_layers())
    assert kinds.kind_of_config(new_drafter(target).config.to_hf_config()) == "eagle3"
    assert kinds.kind_of_config({"architectures": ["Qwen3DSparkModel"]}) == "dspark"
    assert kinds.kind_of_config({"dflash_config": {"mask_token_id": 5}}) == "dflash"
    with pytest.raises(UsageError, match="unknown drafter kind"):
        kinds.get_kind("medusa")


def test_default_target_layers():
    assert default_target_layer_ids(36) == (1, 9, 17, 25, 33)  # DeepSpec's Qwen3-4B config
    assert default_target_layer_ids(8) == (1, 2, 3, 4, 5)
    assert default_target_layer_ids(3, 5) == (1,)
    cfg = BlockDrafterConfig.from_target(block_target("llama"), "dspark", markov_rank=4)
    assert cfg.aux_layer_ids == tuple(i + 1 for i in cfg.target_layer_ids)
    assert cfg.num_drafts == cfg.block_size == 7 and cfg.sample_from_anchor


def test_default_mask_token_is_never_an_end_token():
    from types import SimpleNamespace

    from draftsmith.model.block_drafter import default_mask_token_id

    class Tok(SimpleNamespace):
        def __len__(self):
            return self.n

    def target(tok, vocab=100, **cfg):
        return SimpleNamespace(tokenizer=tok, vocab_size=vocab,
                               config=SimpleNamespace(**{"eos_token_id": 2, "pad_token_id": None, **cfg}))

    # Qwen3: the table is padded past the tokenizer, the first unused row (151669 there) is the mask
    assert default_mask_token_id(target(Tok(n=90, pad_token_id=5, eos_token_id=2, unk_token_id=None))) == 90
    # SmolLM2: pad is the end token; the unknown token is not
    assert default_mask_token_id(target(Tok(n=100, pad_token_id=2, eos_token_id=2, unk_token_id=0),
                                        pad_token_id=2)) == 0
    assert default_mask_token_id(target(None, pad_token_id=0)) == 0
    assert default_mask_token_id(target(None, eos_token_id=[2, 7], pad_token_id=7)) == 99


@pytest.mark.parametrize("edit, message", [
    ({"block_size": "eight"}, "not a DFlash/DSpark drafter config"),
    ({"target_layer_ids": 3}, "not a DFlash/DSpark drafter config"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be >= 1"),
    ({"markov_head_type": "lstm"}, "markov_head_type"),
    ({"draftsmith": None, "target_hidden_size": None}, "draftsmith import"),  # an engine's layout, not ours
])
def test_edited_configs_are_one_clear_error(tmp_path, edit, message):
    path = _drafter("dspark").save(tmp_path / "d")
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(edit)
    for key in [k for k, v in edit.items() if v is None]:
        cfg.pop(key)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DrafterError, match=message):
        load_block_drafter(path)
