"""Target adapter: aux capture for every supported architecture, layer discovery, KV cache rollback."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_target
from torch import nn

from draftsmith.model.target import (
    SupportsEagle3,
    Target,
    TargetError,
    default_aux_layers,
    find_decoder_layers,
    validate_aux_layers,
)
from draftsmith.testing.models import TINY_ARCHITECTURES, build_tiny_model


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_aux_hidden_states_equal_output_hidden_states(arch):
    """Aux state L is output_hidden_states[L]: the residual stream entering layer L (fp32, 1e-5)."""
    target = tiny_target(arch, torch.float32)
    ids = torch.randint(3, 250, (2, 11), generator=torch.Generator().manual_seed(0))
    out = target(ids)
    ref = target.model(input_ids=ids, output_hidden_states=True)
    assert len(ref.hidden_states) == target.num_layers + 1
    assert target.aux_layers == (2, 4, 5)
    for layer, aux in zip(target.aux_layers, out.aux_hidden_states, strict=True):
        torch.testing.assert_close(aux, ref.hidden_states[layer], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=0)
    # The final state is post-norm (the teacher), and recomputing logits from it matches the model's.
    torch.testing.assert_close(out.hidden_state, ref.hidden_states[-1], atol=1e-5, rtol=0)
    torch.testing.assert_close(target.compute_logits(out.hidden_state), ref.logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "gemma3_wrapper", "kimi_k25_wrapper"])
def test_custom_aux_layers_and_incremental_decode(arch):
    target = Target(build_tiny_model(arch, dtype=torch.float64), aux_layers=(0, 1, 7))
    ids = torch.randint(3, 250, (1, 9), generator=torch.Generator().manual_seed(1))
    full = target(ids)
    cache = target.new_cache()
    first = target(ids[:, :6], cache=cache)
    rest = target(ids[:, 6:], cache=cache)
    for a_full, a0, a1 in zip(full.aux_hidden_states, first.aux_hidden_states, rest.aux_hidden_states, strict=True):
        # fp64 model, but HF builds RoPE tables in float32: positions differ by chunking at ~1e-9.
        torch.testing.assert_close(torch.cat([a0, a1], 1), a_full, atol=1e-7, rtol=0)
    torch.testing.assert_close(rest.logits, full.logits[:, 6:], atol=1e-6, rtol=0)


def test_wrapper_layers_found_under_language_model():
    target = tiny_target("kimi_k25_wrapper")
    assert "language_model" in target.layers_path
    assert type(target.layers[0]).__name__.startswith("DeepseekV3")
    assert target.config.model_type == "deepseek_v3"


def test_protocol_mirrors_vllm():
    target = tiny_target("llama")
    assert isinstance(target, SupportsEagle3)
    assert target.supports_eagle3 is True
    assert target.get_eagle3_default_aux_hidden_state_layers() == (2, 4, 5)
    assert default_aux_layers(61) == (2, 30, 58)  # DeepSeek-V3 / Kimi-K2
    assert default_aux_layers(30) == (2, 15, 27)  # SmolLM2-135M


def test_set_aux_layers_replaces_hooks():
    target = Target(build_tiny_model("qwen2", dtype=torch.float64))
    target.set_aux_hidden_state_layers([1, 3, 6])
    ids = torch.randint(3, 250, (1, 5))
    out = target(ids)
    ref = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(out.aux_hidden_states) == 3
    for layer, aux in zip((1, 3, 6), out.aux_hidden_states, strict=True):
        torch.testing.assert_close(aux, ref[layer])


@pytest.mark.parametrize("layers, message", [
    ((2, 4, 8), "out of range"),
    ((-1, 2, 3), "out of range"),
    ((2, 2, 5), "duplicates"),
    ((), "empty"),
])
def test_bad_aux_layers_rejected(layers, message):
    with pytest.raises(TargetError, match=message):
        validate_aux_layers(layers, 8)


def test_bad_aux_layers_rejected_before_loading_weights(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from draftsmith.model.target import load_target

    build_tiny_model("llama").save_pretrained(tmp_path)

    def boom(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", boom)
    with pytest.raises(TargetError, match="out of range"):
        load_target(tmp_path, aux_layers=(2, 4, 99))


def test_unfindable_layers_error_names_class_and_search():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])

    with pytest.raises(TargetError, match=r"Odd.*ModuleList of 4 layers.*model\.layers"):
        find_decoder_layers(Odd(), 4)


def test_missing_and_non_model_paths(tmp_path):
    from draftsmith.model.target import load_target

    with pytest.raises(FileNotFoundError, match="no such file"):
        load_target(tmp_path / "nope")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        load_target(tmp_path)


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3", "gemma2"])
def test_cache_rollback_equals_cache_of_accepted_tokens(arch):
    """After a tree verify pass with rejections, the compacted cache equals one built from accepted tokens."""
    target = tiny_target(arch)
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 250, (1, 7), generator=g)
    # A tree: root(0) -> 1 -> 3 -> 5, root -> 2 -> 4; accept the path 0, 1, 3.
    parents = [0, 0, 1, 2, 3]
    tokens = torch.randint(3, 250, (1, 6), generator=g)
    n, length = 6, prefix.shape[1]
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while True:
            allowed[i, j] = True
            if j == 0:
                break
            j = parents[j - 1]
    depth = allowed.sum(1) - 1
    mask = torch.cat([torch.ones(n, length, dtype=torch.bool), allowed], 1)
    additive = torch.zeros(mask.shape, dtype=target.dtype).masked_fill(~mask, torch.finfo(target.dtype).min)
    cache = target.new_cache()
    target(prefix, cache=cache)
    tree_out = target(tokens, cache=cache, attention_mask=additive[None, None], position_ids=length + depth[None])
    path = torch.tensor([0, 1, 3])
    cache.keep(length, path.tolist())

    ref_cache = target.new_cache()
    ref = target(torch.cat([prefix, tokens[:, path]], 1), cache=ref_cache)
    assert cache.hf.get_seq_length() == ref_cache.hf.get_seq_length() == length + 3
    for layer, ref_layer in zip(cache.hf.layers, ref_cache.hf.layers, strict=True):
        # HF computes RoPE tables and the eager softmax in float32 even for fp64 models, hence 1e-6, not 1e-10.
        torch.testing.assert_close(layer.keys, ref_layer.keys, atol=1e-6, rtol=0)
        torch.testing.assert_close(layer.values, ref_layer.values, atol=1e-6, rtol=0)
    # Tree logits on the accepted path equal sequential logits. The float32 softmax sums a different number of
    # (masked) columns in the two passes, and the error grows through the layers, so the bound is relative.
    torch.testing.assert_close(tree_out.logits[:, path], ref.logits[:, length:], atol=1e-6, rtol=1e-5)
    # And decoding continues identically from the compacted cache.
    nxt = torch.tensor([[5]])
    a = target(nxt, cache=cache)
    b = target(nxt, cache=ref_cache)
    torch.testing.assert_close(a.logits, b.logits, atol=1e-6, rtol=1e-5)


def test_chain_crop_rollback():
    target = tiny_target("qwen2")
    ids = torch.randint(3, 250, (1, 12), generator=torch.Generator().manual_seed(5))
    cache = target.new_cache()
    target(ids, cache=cache)
    cache.keep(8)
    ref_cache = target.new_cache()
    target(ids[:, :8], cache=ref_cache)
    for layer, ref_layer in zip(cache.hf.layers, ref_cache.hf.layers, strict=True):
        torch.testing.assert_close(layer.keys, ref_layer.keys)


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_tree_pass_over_a_cache_matches_hf_sdpa(arch, monkeypatch):
    """The attention the adapter installs (grouped K/V read in place under a mask) gives HF's SDPA logits.

    Where the adapter hands the pass to HF's own attention (no grouped heads, MLA, soft-capping: gemma2, phi3,
    deepseek_v3, kimi_k25_wrapper), HF's SDPA against itself would compare a function with itself; there the
    tree pass is compared with causal passes over each node's root path on HF's eager attention instead.
    """
    from transformers.integrations import sdpa_attention

    fast = Target(build_tiny_model(arch, seed=0, dtype=torch.float64))
    if arch == "llama":
        assert fast.model.config._attn_implementation == "draftsmith_sdpa", "a Llama on SDPA runs in-place GQA"
    prompt = torch.randint(3, 250, (1, 7), generator=torch.Generator().manual_seed(0))
    tree = torch.tensor([[11, 12, 13, 14]])  # root, two children of the root, a grandchild under the first
    allowed = torch.ones(4, 11, dtype=torch.bool)
    allowed[:, 7:] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    mask = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    pos = torch.tensor([[7, 8, 8, 9]])

    def tree_logits(t: Target, spy: list | None = None) -> torch.Tensor:
        cache = t.new_cache()
        t(prompt, cache=cache)
        if spy is not None:  # did the tree pass (not the prefill) go to HF's own SDPA?
            own = sdpa_attention.sdpa_attention_forward
            monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", lambda *a, **k: spy.append(1) or own(*a, **k))
        out = t(tree, cache=cache, attention_mask=mask[None, None], position_ids=pos).logits
        monkeypatch.undo()
        return out

    handed_to_hf: list = []
    fast_logits = tree_logits(fast, handed_to_hf)
    hf = Target(build_tiny_model(arch, seed=0, dtype=torch.float64))
    if fast.model.config._attn_implementation == "draftsmith_sdpa" and not handed_to_hf:
        hf.model.set_attn_implementation("sdpa")
        torch.testing.assert_close(fast_logits, tree_logits(hf), atol=1e-12, rtol=0)
        return
    hf.model.set_attn_implementation("eager")
    for node, path in enumerate([[11], [11, 12], [11, 13], [11, 12, 14]]):
        ref = hf(torch.cat([prompt, torch.tensor([path])], 1)).logits[0, -1]
        # HF's eager softmax runs in float32 even for fp64 models: a relative bound, as in the cache test above.
        torch.testing.assert_close(fast_logits[0, node], ref, atol=1e-6, rtol=1e-5, msg=f"{arch} node {node}")


def test_recurrent_targets_decode_or_are_refused_in_one_line():
    """Where transformers keeps recurrent states per token, a hybrid target decodes (test_recurrent_decode.py);
    on older releases (5.17) speculative decoding is refused in one line that names the release to install."""
    import transformers

    from draftsmith.model import target_cache
    from draftsmith.stages.decode import NgramSpec, SpeculativeDecoder

    target = Target(build_tiny_model("lfm2", num_hidden_layers=4))
    assert target.is_recurrent and target.recurrent_layers == (0, 1, 2)
    decoder = SpeculativeDecoder(target, None, NgramSpec(3))
    if target_cache.recurrent_cache_class() is not None:
        assert decoder.generate([5, 6, 7], 4).token_ids == SpeculativeDecoder(target).generate([5, 6, 7], 4).token_ids
        return
    with pytest.raises(target_cache.RecurrentTargetError, match=f"transformers {transformers.__version__}") as e:
        decoder.generate([5, 6, 7], 4)
    assert "\n" not in str(e.value) and target_cache.MIN_TRANSFORMERS_FOR_RECURRENT in str(e.value)
