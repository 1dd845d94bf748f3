"""The tiny LFM2 and Qwen3.5 targets as GGUFs (testing/target_gguf.py): the keys, tensors and tokenizer llama.cpp
reads, the weights unchanged or transformed as llama.cpp's converter does, and the drafter export's view of it.
Fast, no engine: llama.cpp itself serves them in test_llamacpp_hybrid.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from draftsmith.testing.models import save_tiny_target  # noqa: E402
from draftsmith.testing.target_gguf import TargetGgufError, gguf_tensor_name, write_target_gguf  # noqa: E402


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lfm2")
    model_dir = save_tiny_target(tmp / "hf", "lfm2", num_hidden_layers=4)
    return model_dir, write_target_gguf(model_dir, tmp / "lfm2.gguf")


def _fields(path):
    from draftsmith.core.gguf_file import open_gguf

    r = open_gguf(path)
    return r, {k: f.contents() for k, f in r.fields.items()}


def test_keys_say_which_layers_are_recurrent(lfm2):
    _, f = _fields(lfm2[1])
    assert f["general.architecture"] == "lfm2"
    assert f["lfm2.block_count"] == 4
    assert f["lfm2.attention.head_count_kv"] == [0, 0, 0, 2]  # 0: a convolution layer (llama.cpp's recurrent test)
    assert f["lfm2.shortconv.l_cache"] == 3
    assert f["lfm2.embedding_length"] == 64 and f["lfm2.feed_forward_length"] == 128
    assert f["lfm2.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)  # LFM2's norm_eps, not rms_norm_eps


def test_every_weight_arrives_unchanged_under_llama_cpp_names(lfm2):
    from safetensors.torch import load_file

    model_dir, path = lfm2
    reader, _ = _fields(path)
    got = {t.name: np.asarray(t.data) for t in reader.tensors}
    state = load_file(model_dir / "model.safetensors")
    assert len(got) == len(state)
    for name, t in state.items():
        want = t.float().squeeze(1) if name.endswith("conv.conv.weight") else t.float()
        assert np.array_equal(got[gguf_tensor_name(name)], want.numpy()), name
    assert got["blk.0.shortconv.conv.weight"].shape == (64, 3)  # the depthwise kernel, 2-D
    assert "blk.3.attn_q_norm.weight" in got and "blk.0.attn_q.weight" not in got
    assert "token_embd_norm.weight" in got  # LFM2's final norm (HF embedding_norm)


def test_tokenizer_is_the_targets(lfm2):
    from gguf import TokenType
    from transformers import AutoTokenizer

    model_dir, path = lfm2
    tok = AutoTokenizer.from_pretrained(model_dir)
    _, f = _fields(path)
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "gpt-2"
    assert f["tokenizer.ggml.tokens"] == tok.convert_ids_to_tokens(list(range(len(tok))))
    assert f["tokenizer.ggml.eos_token_id"] == tok.eos_token_id
    assert f["tokenizer.ggml.token_type"][tok.eos_token_id] == TokenType.CONTROL
    assert f["tokenizer.ggml.token_type"][0] == TokenType.NORMAL
    assert len(f["tokenizer.ggml.merges"]) > 0
    assert "<|im_start|>" in f["tokenizer.chat_template"]


def test_the_drafter_export_reads_it_as_an_eagle3_target(lfm2, tmp_path):
    from draftsmith.model.drafter import new_drafter
    from draftsmith.model.target import load_target
    from draftsmith.stages.export.gguf import export_gguf, read_target_gguf

    model_dir, path = lfm2
    t = read_target_gguf(path)
    assert (t.arch, t.num_layers, t.hidden_size, t.vocab_size) == ("lfm2", 4, 64, 515)
    drafter = new_drafter(load_target(str(model_dir), pack=False, dtype=torch.float32), seed=0)
    report = export_gguf(drafter, tmp_path / "drafter.gguf", target=path, dtype="fp32")
    assert report.target_arch == "lfm2" and report.aux_layer_ids == list(drafter.config.aux_layer_ids)


def test_refuses_what_it_does_not_write(tmp_path):
    llama = save_tiny_target(tmp_path / "llama", "llama", num_hidden_layers=2)
    with pytest.raises(TargetGgufError, match="writes lfm2 and qwen3_5_text only"):
        write_target_gguf(llama, tmp_path / "x.gguf")
    with pytest.raises(TargetGgufError, match="no place"):
        gguf_tensor_name("model.layers.0.mamba.in_proj.weight")


def test_llama_cpp_passes_not_short_when_drafts_past_a_stop_token_are_counted():
    """A measured LFM2 request: 28 tokens ending at the end-of-turn token, 8 rounds of 3 drafts, 20 drafts counted
    accepted of which one lay past the end-of-turn token. 28 - 1 - 20 = 7 passes would put tau at 3.86, not 3.38."""
    from draftsmith.integrations.llamacpp import EngineRun

    run = EngineRun(text="", completion_tokens=28, predicted_ms=1.0, prompt_ms=1.0, draft_n=24, draft_n_accepted=20,
                    k=3)
    assert run.verify_passes == 8 and run.accepted_emitted == 19 and run.acceptance_length == 1 + 19 / 8
    # a request cut by n_predict: its last round drafted fewer than k, the emitted count is exact
    assert EngineRun(text="", completion_tokens=32, predicted_ms=1.0, prompt_ms=1.0, draft_n=23, draft_n_accepted=23,
                     k=3).verify_passes == 8
    assert EngineRun(text="", completion_tokens=5, predicted_ms=1.0, prompt_ms=1.0).verify_passes == 4  # plain


def test_qwen35_keys_and_the_transforms_llama_cpp_expects(tmp_path):
    from safetensors.torch import load_file

    model_dir = save_tiny_target(tmp_path / "hf", "qwen3_5_text", num_hidden_layers=4)
    reader, f = _fields(write_target_gguf(model_dir, tmp_path / "q35.gguf"))
    assert f["general.architecture"] == "qwen35" and f["qwen35.full_attention_interval"] == 4
    assert (f["qwen35.ssm.conv_kernel"], f["qwen35.ssm.state_size"], f["qwen35.ssm.group_count"],
            f["qwen35.ssm.time_step_rank"], f["qwen35.ssm.inner_size"]) == (4, 16, 2, 4, 64)
    assert f["qwen35.rope.dimension_count"] == 4  # head 16 x partial_rotary_factor 0.25
    assert f["qwen35.rope.dimension_sections"] == [1, 1, 0, 0]  # both rotated pairs in a text section (t, h)
    got = {t.name: torch.from_numpy(np.asarray(t.data).copy()) for t in reader.tensors}
    hf = load_file(model_dir / "model.safetensors")
    lin = "model.layers.0.linear_attn."
    assert torch.equal(got["blk.0.ssm_a"], -torch.exp(hf[lin + "A_log"][[0, 2, 1, 3]]))
    assert torch.equal(got["blk.0.ssm_dt.bias"], hf[lin + "dt_bias"][[0, 2, 1, 3]])
    assert torch.equal(got["blk.0.attn_norm.weight"], hf["model.layers.0.input_layernorm.weight"] + 1)
    assert torch.equal(got["blk.0.ssm_norm.weight"], hf[lin + "norm.weight"])  # the gated norm keeps w
    z = hf[lin + "in_proj_z.weight"].reshape(2, 2, 16, 64)  # (key head, value head of it, dim, in)
    assert torch.equal(got["blk.0.attn_gate.weight"], z.transpose(0, 1).reshape(64, 64))  # value heads tiled
    assert got["blk.0.ssm_conv1d.weight"].shape == (128, 4)
    assert torch.equal(got["blk.3.attn_q.weight"], hf["model.layers.3.self_attn.q_proj.weight"])  # q and its gate
