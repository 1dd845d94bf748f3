"""Block drafters (DFlash, DSpark) exported in each engine's layout and read back from the released layouts.

Everything here is on tiny synthetic state dicts: the layouts' keys, ids and slot conventions are what the engines'
loaders read (vLLM 0.32's source, speculators 0.9, DeepSpec, z-lab, llama.cpp's GGUF keys), and the readers turn
each released layout into the same canonical checkpoint.
"""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.core import block_facts as bf
from draftsmith.stages.export.block import ExportError, export_block
from draftsmith.stages.export.block_readers import is_block_drafter, read_block_checkpoint
from draftsmith.testing.blocks import random_block_checkpoint, tiny_spec, write_released


def _cfg(path):
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
@pytest.mark.parametrize("fmt", ["vllm", "speculators", "sglang"])
def test_export_then_read_is_identity(tmp_path, kind, fmt):
    ckpt = random_block_checkpoint(tiny_spec(kind))
    export_block(ckpt, tmp_path / "out", fmt, dtype="fp32", verifier="org/target")
    back = read_block_checkpoint(tmp_path / "out")
    for name in ("kind", "block_size", "aux_layer_ids", "mask_token_id", "slot", "markov_rank", "markov_head_type",
                 "confidence_head", "confidence_with_markov", "hidden_size", "head_dim", "draft_vocab_size"):
        assert getattr(back.spec, name) == getattr(ckpt.spec, name), name
    assert set(back.state) == set(ckpt.state)
    for name, t in ckpt.state.items():
        assert torch.equal(back.state[name], t), name


def test_vllm_layout_numbers_layers_by_output_and_states_the_slot(tmp_path):
    spark = random_block_checkpoint(tiny_spec("dspark", aux_layer_ids=(2, 4, 6)))
    export_block(spark, tmp_path / "dspark", "vllm")
    cfg = _cfg(tmp_path / "dspark")
    assert cfg["architectures"] == ["Qwen3DSparkModel"]
    # vLLM's get_eagle3_aux_layers_from_config adds one to target_layer_ids: the target's hidden_states[2, 4, 6].
    assert cfg["target_layer_ids"] == [1, 3, 5]
    assert cfg["sample_from_anchor"] is True and cfg["markov_head_type"] == "vanilla"
    flash = random_block_checkpoint(tiny_spec("dflash"))
    export_block(flash, tmp_path / "dflash", "vllm")
    cfg = _cfg(tmp_path / "dflash")
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["dflash_config"] == {"mask_token_id": 250, "target_layer_ids": [1, 3, 5], "causal": False}


def test_speculators_layout_keeps_draftsmith_ids_and_an_explicit_slot(tmp_path):
    ckpt = random_block_checkpoint(tiny_spec("dspark", draft_vocab_size=128))
    export_block(ckpt, tmp_path / "s", "speculators", verifier="org/target")
    cfg = _cfg(tmp_path / "s")
    assert cfg["speculators_model_type"] == "dspark"
    assert cfg["aux_hidden_state_layer_ids"] == [2, 4, 6]  # vLLM's update_dspark subtracts one
    assert cfg["sample_from_anchor"] is True  # vLLM's reader takes an absent one as false
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4  # anchor-first: B drafts
    from safetensors import safe_open

    with safe_open(str(tmp_path / "s" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"d2t", "t2d", "lm_head.weight"} <= names  # speculators slices the verifier's head with t2d


def test_vllm_refuses_an_anchor_first_dflash(tmp_path):
    """vLLM's v1 DFlash proposer (the CPU's) fills [bonus, mask...] and never reads sample_from_anchor."""
    ckpt = random_block_checkpoint(tiny_spec("dflash", slot="anchor_first"))
    with pytest.raises(ExportError, match="one position off"):
        export_block(ckpt, tmp_path / "o", "vllm")
    assert not (tmp_path / "o").exists()


def test_sglang_refuses_fill_in_dspark_and_reduced_vocab(tmp_path):
    fill = random_block_checkpoint(tiny_spec("dspark", slot="fill_in"))
    with pytest.raises(ExportError, match="one position off"):
        export_block(fill, tmp_path / "a", "sglang")
    small = random_block_checkpoint(tiny_spec("dspark", draft_vocab_size=128))
    with pytest.raises(ExportError, match="target's lm_head"):
        export_block(small, tmp_path / "b", "sglang")
    export_block(fill, tmp_path / "c", "vllm")  # vLLM's DSpark reads sample_from_anchor: false
    assert _cfg(tmp_path / "c")["sample_from_anchor"] is False


def test_gated_markov_head_refused_where_not_computed(tmp_path):
    gated = random_block_checkpoint(tiny_spec("dspark", markov_head_type="gated"))
    with pytest.raises(ExportError, match="vanilla"):
        export_block(gated, tmp_path / "v", "vllm")
    export_block(gated, tmp_path / "s", "sglang")  # SGLang computes gated and rnn heads
    assert "markov_head.gate_proj.weight" in read_block_checkpoint(tmp_path / "s").state


def test_layer_zero_cannot_be_said_in_output_numbering(tmp_path):
    ckpt = random_block_checkpoint(tiny_spec("dspark", aux_layer_ids=(0, 4, 6)))
    with pytest.raises(ExportError, match="embedding output"):
        export_block(ckpt, tmp_path / "v", "vllm")
    export_block(ckpt, tmp_path / "s", "speculators", verifier="t")  # draftsmith numbering: fine
    assert bf.to_output_layer_ids([0, 4], allow_embedding=True) == [-1, 3]  # DeepSpec's -1


def test_unordered_layers_are_refused(tmp_path):
    ckpt = random_block_checkpoint(tiny_spec("dflash", aux_layer_ids=(4, 2, 6)))
    with pytest.raises(ExportError, match="strictly increasing"):
        export_block(ckpt, tmp_path / "o", "vllm")


def test_shape_mismatch_is_one_clear_line(tmp_path):
    ckpt = random_block_checkpoint(tiny_spec("dspark"))
    ckpt.state["markov_head.markov_w2.weight"] = torch.zeros(3, 3)
    with pytest.raises(ExportError, match="markov_head.markov_w2.weight has shape"):
        export_block(ckpt, tmp_path / "o", "vllm")


# --- released layouts ----------------------------------------------------------------------------------------
def _qwen3(n_layers=2, vocab=256) -> dict:
    return {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": n_layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
            "rope_theta": 1e6, "max_position_embeddings": 512, "vocab_size": vocab}


def test_reads_zlab_release(tmp_path):
    """z-lab: DFlashDraftModel, dflash_config ids (output of layer i), no lm_head or embeddings, fill-in."""
    src = random_block_checkpoint(tiny_spec("dflash"), lm_head=False)
    cfg = {"architectures": ["DFlashDraftModel"], **_qwen3(), "block_size": 4, "num_target_layers": 8,
           "dflash_config": {"target_layer_ids": [1, 3, 5], "mask_token_id": 250}}
    write_released(tmp_path / "z", cfg, src.state)
    assert is_block_drafter(tmp_path / "z")
    got = read_block_checkpoint(tmp_path / "z")
    assert got.source_format == "zlab" and got.spec.kind == "dflash" and got.spec.slot == "fill_in"
    assert got.spec.aux_layer_ids == (2, 4, 6)
    assert "lm_head.weight" not in got.state


def test_zlab_release_without_ids_uses_zlab_default(tmp_path):
    src = random_block_checkpoint(tiny_spec("dflash", aux_layer_ids=(2, 6)), lm_head=False)
    cfg = {"architectures": ["DFlashDraftModel"], **_qwen3(), "block_size": 4, "num_target_layers": 8,
           "dflash_config": {"mask_token_id": 250}}
    write_released(tmp_path / "z", cfg, src.state)
    got = read_block_checkpoint(tmp_path / "z")
    assert got.spec.aux_layer_ids == (2, 6)  # z-lab build_target_layer_ids(8, 2) = [1, 5]
    assert any("z-lab's default" in w for w in got.warnings)


def test_reads_deepspec_release(tmp_path):
    """DeepSpec: Qwen3DSparkModel, top-level target_layer_ids, model.-prefixed names, no sample_from_anchor key."""
    src = random_block_checkpoint(tiny_spec("dspark", markov_head_type="rnn"))
    src.state["embed_tokens.weight"] = torch.randn(256, 64)
    cfg = {"architectures": ["Qwen3DSparkModel"], **_qwen3(), "num_target_layers": 8, "block_size": 4,
           "mask_token_id": 250, "target_layer_ids": [1, 3, 5], "num_anchors": 512, "markov_rank": 8,
           "markov_head_type": "rnn", "enable_confidence_head": True, "confidence_head_with_markov": True,
           "tie_word_embeddings": False}
    write_released(tmp_path / "d", cfg, {("model." + k if k != "lm_head.weight" else k): v
                                         for k, v in src.state.items()})
    got = read_block_checkpoint(tmp_path / "d")
    assert got.source_format == "deepspec" and got.spec.slot == "anchor_first"
    assert got.spec.aux_layer_ids == (2, 4, 6) and got.spec.markov_head_type == "rnn"
    assert got.spec.confidence_head and got.spec.confidence_with_markov
    assert torch.equal(got.state["markov_head.joint_proj.weight"], src.state["markov_head.joint_proj.weight"])


@pytest.mark.parametrize("flag,slot", [(None, "anchor_first"), (False, "fill_in"), (True, "anchor_first")])
def test_reads_speculators_dspark_with_its_class_default(tmp_path, flag, slot):
    src = random_block_checkpoint(tiny_spec("dspark", slot=slot, draft_vocab_size=128))
    cfg = {"architectures": ["DSparkSpeculator"], "speculators_model_type": "dspark",
           "transformer_layer_config": _qwen3(), "draft_vocab_size": 128, "block_size": 4, "target_hidden_size": 64,
           "aux_hidden_state_layer_ids": [2, 4, 6], "mask_token_id": 250, "markov_rank": 8,
           "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True,
           "speculators_config": {"algorithm": "dspark", "proposal_methods": [
               {"proposal_type": "greedy", "speculative_tokens": 4}], "verifier": {"name_or_path": "org/t"}}}
    if flag is not None:
        cfg["sample_from_anchor"] = flag
    write_released(tmp_path / "s", cfg, src.state)
    got = read_block_checkpoint(tmp_path / "s")
    assert got.spec.slot == slot and got.spec.aux_layer_ids == (2, 4, 6) and got.spec.draft_vocab_size == 128
    # vLLM reads an absent flag in a speculators config as false: the silent misread doctor reports.
    assert bf.engine_reads_slot("vllm", "dspark", "speculators", cfg) == ("fill_in" if not flag else "anchor_first")


def test_dflash2_is_refused_with_a_reason(tmp_path):
    src = random_block_checkpoint(tiny_spec("dflash"))
    cfg = {"architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash2",
           "transformer_layer_config": _qwen3(), "aux_hidden_state_layer_ids": [2, 4, 6], "mask_token_id": 250,
           "block_size": 4}
    write_released(tmp_path / "s", cfg, src.state)
    with pytest.raises(ExportError, match="DFlash2"):
        read_block_checkpoint(tmp_path / "s")


# --- draftsmith's own drafter, through the CLI ---------------------------------------------------------------
def _native(tmp_path, kind="dspark", **over):
    from draftsmith.model.block_drafter import BlockDrafter, BlockDrafterConfig

    extra = dict(sample_from_anchor=True, markov_rank=8, enable_confidence_head=True,
                 confidence_head_with_markov=True) if kind == "dspark" else {}
    cfg = BlockDrafterConfig(kind=kind, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                             draft_vocab_size=256, target_hidden_size=64, target_layer_ids=(1, 3, 5), block_size=4,
                             mask_token_id=3, **{**extra, **over})
    torch.manual_seed(0)
    d = BlockDrafter(cfg)
    return d, d.save(tmp_path / f"native-{kind}")


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
@pytest.mark.parametrize("fmt", ["vllm", "speculators", "sglang"])
def test_cli_export_then_import_gives_back_the_drafter(tmp_path, kind, fmt):
    from draftsmith.cli import main
    from draftsmith.model.block_drafter import load_block_drafter

    d, native = _native(tmp_path, kind)
    assert main(["export", "--drafter", str(native), "--format", fmt, "--out", str(tmp_path / "e"),
                 "--export-dtype", "float32", "--verifier", "org/target"]) == 0
    assert main(["import", "--from", str(tmp_path / "e"), "--out", str(tmp_path / "back")]) == 0
    back = load_block_drafter(tmp_path / "back")
    assert back.config.target_layer_ids == d.config.target_layer_ids == (1, 3, 5)
    assert back.config.sample_from_anchor == d.config.sample_from_anchor
    for name, t in d.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name


def test_import_zlab_needs_the_target_head():
    """A z-lab release has no lm_head; import refuses without a target and copies the target's rows with one."""
    from draftsmith.stages.export.block_kind import drafter_from_checkpoint

    src = random_block_checkpoint(tiny_spec("dflash"), lm_head=False)
    with pytest.raises(ExportError, match="no lm_head"):
        drafter_from_checkpoint(src)
    head = torch.randn(256, 64)
    d = drafter_from_checkpoint(src, lm_head_from=head)
    assert torch.equal(d.lm_head.weight, head)


# --- the model card (issue 52): block exports carry it like EAGLE-3 exports ------------------------------------
def _run_with_eval(tmp_path, acc):
    """A training run's folder (config.json) with best/eval.json: what the card's expectation is read from."""
    run = tmp_path / "run"
    (run / "best").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"target": "org/target", "store": "runs/store", "ttt_steps": 1,
                                                 "eval_fraction": 0.05, "lr": 3e-4}))
    (run / "best" / "eval.json").write_text(json.dumps({"step": 40, "acc": acc, "tokens": 1000}))
    return run / "best"


@pytest.mark.parametrize("kind,fmt", [("dflash", "vllm"), ("dspark", "sglang"), ("dspark", "speculators")])
def test_block_export_writes_a_card_the_hub_parses(tmp_path, kind, fmt):
    from huggingface_hub import ModelCard

    from draftsmith.stages.export.card import CARD_FILE, CARD_JSON, read_card

    ckpt = random_block_checkpoint(tiny_spec(kind, **({"slot": bf.FILL_IN} if kind == "dflash" else {})))
    ckpt.source = str(_run_with_eval(tmp_path, [0.9, 0.8, 0.5, 0.4, 0.3, 0.2, 0.1, 0.1]))
    out = tmp_path / "out"
    export_block(ckpt, out, fmt, dtype="fp32", verifier="org/target", card={"license": "apache-2.0"})
    card = ModelCard.load(out / CARD_FILE)
    assert card.data.base_model == "org/target" and card.data.license == "apache-2.0"
    assert kind in card.data.tags and "speculative-decoding" in card.data.tags
    facts = read_card(out)
    s = ckpt.spec
    assert facts["kind"] == kind and facts["block_size"] == s.block_size and facts["slot"] == s.slot
    assert facts["num_speculative_tokens"] == s.drafts and facts["aux_layer_ids"] == list(s.aux_layer_ids)
    exp = facts["expected_acceptance"]
    assert exp["per_position"][:3] == [0.9, 0.8, 0.5]
    assert exp["by_k"]["2"] == pytest.approx(1 + 0.9 + 0.9 * 0.8)
    engine = {"vllm": "vllm", "speculators": "vllm", "sglang": "sglang"}[fmt]
    assert engine in facts["usage"]
    if fmt == "vllm":
        assert f'"method": "{kind}"' in facts["usage"]["vllm"]
    if fmt == "sglang":
        assert f"--speculative-algorithm {kind.upper()}" in facts["usage"]["sglang"]
    assert facts["training"]["data"] == "runs/store"
    text = (out / CARD_FILE).read_text()
    assert f"block size {s.block_size}" in text and "accepted at this position" in text
    assert (out / CARD_JSON).is_file()


def test_block_export_keeps_a_users_readme_and_swaps_in_whole(tmp_path):
    from draftsmith.stages.export.card import CARD_FILE, read_card

    out = tmp_path / "out"
    out.mkdir()
    (out / CARD_FILE).write_text("# my notes\n")
    (out / "notes.txt").write_text("kept")
    ckpt = random_block_checkpoint(tiny_spec("dspark"))
    export_block(ckpt, out, "vllm", dtype="fp32")
    assert (out / CARD_FILE).read_text() == "# my notes\n"  # the user's: kept
    assert read_card(out)["kind"] == "dspark" and (out / "notes.txt").read_text() == "kept"
    assert not any(p.name.startswith(".out.") for p in tmp_path.iterdir())  # no staging left behind
    export_block(ckpt, out, "vllm", dtype="fp32", overwrite=True)
    assert read_card(out)["block_size"] == ckpt.spec.block_size
