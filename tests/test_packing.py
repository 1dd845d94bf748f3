"""oneDNN-prepacked linears (model/packing.py): same logits, same decoded tokens, same state, reversible."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import random_prompts
from torch import nn

from draftsmith.model import packing
from draftsmith.model.drafter import new_drafter
from draftsmith.model.packing import PackedLinear, pack_linears, unpack_linears
from draftsmith.model.target import Target, load_target
from draftsmith.stages.decode import ChainSpec, SpeculativeDecoder, TreeSpec
from draftsmith.testing.models import TINY_ARCHITECTURES, build_tiny_model, save_tiny_target, tiny_deepseek_kwargs

pytestmark = pytest.mark.skipif(not packing.packing_available(), reason="torch built without oneDNN")
# oneDNN's bf16 packing needs AVX-512 (or AVX-NE-CONVERT); on an AVX2-only CPU bf16 linears stay plain.
BF16 = pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.skipif(
    not packing.dtype_packable(torch.bfloat16), reason="this CPU cannot pack bf16 weights (AVX2 only)"))

LAYERS = 4
PREFIX = 30
# A tree of 6 nodes: node i's parent (root -1): root -> 1 -> 3 -> 5, root -> 2, 1 -> 4.
PARENTS = (-1, 0, 0, 1, 1, 3)
# Beyond the tiny sizes (where both paths happen to round identically) fp32 GEMMs differ by reduction order.
WIDE = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=2)
CASES = [(arch, {}) for arch in TINY_ARCHITECTURES] + [
    ("llama", WIDE),
    # the seed's DeepSeek-V3/Kimi-K2 shapes (YaRN rope, 512-wide MLA latent)
    ("deepseek_v3", {k: v for k, v in tiny_deepseek_kwargs(vllm_cpu=True).items() if k != "num_hidden_layers"}),
]
CASE_IDS = [arch + ("-wide" if kw is WIDE else "-seed" if kw else "") for arch, kw in CASES]


def tree_pass(target: Target, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill logits, and the logits of a 6-token tree-masked pass over that KV cache."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 250, (1, PREFIX + len(PARENTS)), generator=g)
    cache = target.new_cache()
    prefill = target(ids[:, :PREFIX], cache=cache).logits
    n = len(PARENTS)
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            allowed[i, j], j = True, PARENTS[j]
    mask = torch.cat([torch.ones(n, PREFIX, dtype=torch.bool), allowed], 1)
    additive = torch.zeros(mask.shape, dtype=target.dtype).masked_fill(~mask, torch.finfo(target.dtype).min)
    depth = allowed.sum(1) - 1
    out = target(ids[:, PREFIX:], cache=cache, attention_mask=additive[None, None], position_ids=PREFIX + depth[None])
    return prefill, out.logits


def assert_same_logits(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: reduction-order rounding only, 1e-5 of the largest logit (about 80 ulps of it, after a few layers of
    rounding; a dropped bias or a 0.1% weight error is off by 1e-3 and more). bf16: at most one bf16 ulp per
    element (oneDNN runs the same kernel either way, so in practice the logits are bit-identical)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.bfloat16:
        w = want.float()
        ulp = torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(2.0 ** -126))) - 7)
        bad = (got.float() - w).abs() > ulp
        assert not bad.any(), f"{int(bad.sum())} logits differ by more than one bf16 ulp"
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


def build(arch: str, dtype: torch.dtype = torch.float32, layers: int = LAYERS, **kw) -> nn.Module:
    """A tiny model whose linear biases are random (HF initialises them to zero, which hides a dropped bias)."""
    model = build_tiny_model(arch, dtype=dtype, num_hidden_layers=layers, **kw)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.copy_(torch.randn(m.bias.shape, generator=g))
    return model


def packed_and_plain(arch: str, dtype: torch.dtype, **kw) -> tuple[Target, Target]:
    plain = Target(build(arch, dtype, **kw))
    packed = Target(build(arch, dtype, **kw))
    assert packed.pack() > 0
    return packed, plain


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), BF16])
@pytest.mark.parametrize(("arch", "kw"), CASES, ids=CASE_IDS)
def test_tree_pass_over_a_cache_gives_the_plain_logits(arch, kw, dtype):
    packed, plain = packed_and_plain(arch, dtype, **kw)
    assert not any(type(m) is nn.Linear for m in packed.model.modules())  # subclasses (MHA's out_proj) stay
    for got, want in zip(tree_pass(packed), tree_pass(plain), strict=True):
        assert_same_logits(got, want)


def _drop_bias(self, x):
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self._packed, None, "none", [], "")
    return y.reshape(*x.shape[:-1], self.out_features)


def _stale_weight(self):
    self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach() * 1.001, self.batch_hint)
    self._key = packing._weight_key(self.weight)


@pytest.mark.parametrize(("attr", "mutant"), [("forward", _drop_bias), ("repack", _stale_weight)])
def test_the_comparison_catches_a_broken_packed_linear(monkeypatch, attr, mutant):
    """The logits test fails for a PackedLinear that drops the bias (qwen2 has q/k/v biases) or packs a weight
    off by 0.1%."""
    monkeypatch.setattr(PackedLinear, attr, mutant)
    packed, plain = packed_and_plain("qwen2", torch.float32)
    with pytest.raises(AssertionError):
        for got, want in zip(tree_pass(packed), tree_pass(plain), strict=True):
            assert_same_logits(got, want)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "deepseek_v3"])
def test_packed_target_decodes_like_plain_greedy_fp32(arch):
    """The losslessness promise holds on a packed target: chain and tree speculation give plain greedy's tokens."""
    plain_target, target = Target(build(arch)), Target(build(arch))
    assert target.pack() > 0
    drafter = new_drafter(target, seed=1)
    plain = SpeculativeDecoder(plain_target)
    decoders = [SpeculativeDecoder(target)] + [SpeculativeDecoder(target, drafter, spec)
                                               for spec in (ChainSpec(4), TreeSpec(depth=4, top_k=3, total_tokens=12))]
    for prompt in random_prompts(6, seed=7):
        want = plain.generate(prompt, 16).token_ids
        for dec in decoders:
            assert dec.generate(prompt, 16).token_ids == want, (arch, dec.spec)


def test_unpack_restores_the_original_modules_and_state_dict_keys_never_change():
    model = build("qwen2", layers=2)
    before = dict(model.named_modules())
    state = model.state_dict()
    n = pack_linears(model)
    assert n == sum(type(m) is nn.Linear for m in before.values())
    packed_state = model.state_dict()
    assert list(packed_state) == list(state)  # no ".lin." or packed-copy keys
    assert all(packed_state[k].data_ptr() == v.data_ptr() for k, v in state.items())  # same Parameters
    model.load_state_dict(state, strict=True)
    assert unpack_linears(model) == n
    after = dict(model.named_modules())
    assert list(after) == list(before) and all(after[k] is before[k] for k in before)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


def test_tied_embedding_keeps_reading_the_shared_weight():
    """SmolLM2 ties lm_head to embed_tokens: both keep the one Parameter, and updates reach both."""
    model = build("llama", layers=3)
    model.lm_head.weight = model.model.embed_tokens.weight
    target = Target(model)
    ids = torch.randint(3, 250, (1, 9), generator=torch.Generator().manual_seed(1))
    want = target(ids).logits
    assert target.pack() > 0
    assert isinstance(target.lm_head, PackedLinear) and target.lm_head.weight is target.embed_tokens.weight
    assert_same_logits(target(ids).logits, want)
    with torch.no_grad():
        target.embed_tokens.weight.mul_(0.5)  # in place: the packed head must follow
    got = target(ids).logits
    assert target.unpack() > 0
    assert type(target.lm_head) is nn.Linear and target.lm_head.weight is target.embed_tokens.weight
    ref = target(ids).logits
    assert_same_logits(got, ref)
    assert not torch.allclose(ref, want)


def test_weight_changes_repack_and_grad_falls_back_to_f_linear():
    lin = nn.Linear(64, 48)
    packed = PackedLinear(nn.Linear(64, 48))
    packed.load_state_dict(lin.state_dict())  # copied in place: the packed copy is rebuilt on the next call
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        assert_same_logits(packed(x), lin(x))
    y = packed(x.requires_grad_())  # autograd: plain F.linear, gradients flow
    y.sum().backward()
    assert packed.weight.grad is not None and x.grad is not None
    assert PackedLinear(nn.Linear(4, 4).double())._packed is None  # fp64: nothing packed, F.linear serves
    assert pack_linears(nn.Sequential(nn.Linear(4, 4).double())) == 0


def test_load_target_packs_by_default_with_an_opt_out(tmp_path, monkeypatch):
    path = save_tiny_target(tmp_path / "t", "llama", num_hidden_layers=3)

    def packed(t: Target) -> int:
        return sum(isinstance(m, PackedLinear) for m in t.model.modules())

    target = load_target(path)
    assert packed(target) == 3 * 7 + 1
    assert target.unpack() == 22 and packed(target) == 0
    assert packed(load_target(path, pack=False)) == 0
    monkeypatch.setenv("DRAFTSMITH_PACK", "0")
    assert packed(load_target(path)) == 0
    assert packed(load_target(path, pack=True)) == 22
    monkeypatch.delenv("DRAFTSMITH_PACK")
    monkeypatch.setattr(packing, "packing_available", lambda: False)
    assert packed(load_target(path)) == 0


def test_casting_a_packed_model_repacks_in_the_new_dtype():
    """What the dtype chooser does (``target.model.to(torch.bfloat16)``): the packed copies follow the cast."""
    target = Target(build("qwen2"))
    assert target.pack() > 0
    target.model.to(torch.bfloat16)
    got = tree_pass(target)
    if packing.dtype_packable(torch.bfloat16):
        assert target.lm_head._packed is not None and target.lm_head._packed.dtype == torch.bfloat16
    else:  # an AVX2-only CPU: the bf16 weight cannot be packed there, F.linear serves it
        assert target.lm_head._packed is None
    target.unpack()
    for a, b in zip(got, tree_pass(target), strict=True):
        assert_same_logits(a, b)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), BF16])
def test_a_drafter_loaded_for_a_packed_target_is_packed_and_drafts_the_same(tmp_path, dtype):
    from draftsmith.model.drafter import KVCache, load_drafter

    target = Target(build_tiny_model("llama", seed=0, dtype=dtype, num_hidden_layers=LAYERS))
    new_drafter(target).save(tmp_path / "d")
    plain = load_drafter(tmp_path / "d", target)
    assert not any(isinstance(m, PackedLinear) for m in plain.modules())
    target.pack()
    packed = load_drafter(tmp_path / "d", target)
    assert any(isinstance(m, PackedLinear) for m in packed.modules())
    ids = torch.randint(3, 250, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        feats = target(ids, cache=target.new_cache()).aux_hidden_states
        outs = [d.logits(d(d.fuse(feats)[:, :-1], ids[:, 1:], torch.arange(11)[None], KVCache()))
                for d in (plain, packed)]
    if dtype == torch.bfloat16:
        assert torch.equal(outs[0], outs[1])
    else:
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_a_cpu_that_cannot_pack_bf16_leaves_bf16_linears_plain_and_the_logits_unchanged(monkeypatch):
    """On an AVX2-only CPU oneDNN's bf16 reorder raises; packing must skip bf16 there, never crash the load."""
    real = torch.ops.mkldnn._reorder_linear_weight

    def avx2_reorder(w, hint):
        if w.dtype == torch.bfloat16:
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or "
                               "avx512bw, avx512vl and avx512dq")
        return real(w, hint)

    monkeypatch.setattr(packing, "_packs", functools.cache(packing._packs.__wrapped__))  # a fresh probe
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", avx2_reorder)
    assert packing.dtype_packable(torch.float32) and not packing.dtype_packable(torch.bfloat16)
    plain = Target(build("qwen2", torch.bfloat16))
    target = Target(build("qwen2", torch.bfloat16))
    assert target.pack() == 0
    cast = Target(build("qwen2"))  # what the dtype chooser does: packed in fp32, then cast to bf16
    assert cast.pack() > 0
    cast.model.to(torch.bfloat16)
    plain_cast = Target(build("qwen2"))
    plain_cast.model.to(torch.bfloat16)
    for t, ref in ((target, plain), (cast, plain_cast)):
        for got, want in zip(tree_pass(t), tree_pass(ref), strict=True):
            assert torch.equal(got, want)
    assert cast.lm_head._packed is None
