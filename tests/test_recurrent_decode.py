"""Targets with recurrent layers (gated delta-net, Mamba-2, short convolutions): speculative decoding equals plain
greedy decoding in every mode, rejected drafts leave no trace in any state, and sampling keeps the target's law."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from conftest import fit_drafter, random_prompts
from test_sampling_law import ALPHA, MIN_CELLS, exact_joint, law_pvalues

from draftsmith.cli import main
from draftsmith.model import target_cache
from draftsmith.model.block_drafter import new_block_drafter
from draftsmith.model.drafter import new_drafter
from draftsmith.model.target import Target
from draftsmith.stages.decode import (
    ChainSpec,
    HybridSpec,
    NgramSpec,
    SamplingParams,
    SpeculativeDecoder,
    TreeSpec,
)
from draftsmith.testing.models import HYBRID_ARCHITECTURES, build_tiny_model, save_tiny_target

# Older transformers releases (the oldest supported, 5.17) have no recurrent cache that keeps a state per token:
# there decoding such a target is refused in one line (test_target.py), and everything here is skipped.
pytestmark = pytest.mark.skipif(target_cache.recurrent_cache_class() is None,
                                reason="transformers without per-token recurrent caches")


#: Gated delta-net + MoE, short convolutions, Mamba-2 (+ shared MLP), Mamba-2 with MLP-only blocks.
RECURRENT_ARCHS = ["qwen3_next", "lfm2", "granitemoehybrid", "nemotron_h"]
NEW_TOKENS = 10
#: Each family: chain, tree and prompt lookup, with one block drafter kind (they alternate over the families).
SPECS = [ChainSpec(3), TreeSpec(3, 3, 8), NgramSpec(4)]
BLOCK_KIND = {"qwen3_next": "dspark", "lfm2": "dflash", "granitemoehybrid": "dspark", "nemotron_h": "dflash"}


@functools.cache
def recurrent_target(arch: str) -> Target:
    return Target(build_tiny_model(arch, num_hidden_layers=4, dtype=torch.float64))


@functools.cache
def references(arch: str):
    """Prompts (random, and ones that repeat so prompt lookup accepts part of its drafts) and plain greedy output."""
    target = recurrent_target(arch)
    prompts = random_prompts(2, seed=21) + [[5, 6, 7, 8] * 4]
    plain = SpeculativeDecoder(target)
    return prompts, [plain.generate(p, NEW_TOKENS).token_ids for p in prompts]


@pytest.mark.parametrize("arch", RECURRENT_ARCHS)
def test_every_mode_equals_plain_greedy_on_recurrent_targets(arch):
    target = recurrent_target(arch)
    assert target.is_recurrent
    prompts, refs = references(arch)
    drafter = new_drafter(target, seed=1)
    cases = [(None if isinstance(s, NgramSpec) else drafter, s) for s in SPECS]
    if arch == "qwen3_next":  # the tree with prompt lookup grafted on
        cases.append((drafter, HybridSpec(TreeSpec(3, 2, 6), NgramSpec(3))))
    cases.append((BLOCK_KIND[arch], None))  # last: a block drafter points the target's aux layers at its own
    aux = target.aux_layers
    try:
        for drafter, spec in cases:
            if isinstance(drafter, str):
                drafter = new_block_drafter(target, drafter, seed=1, **({"markov_rank": 8} if drafter == "dspark"
                                                                         else {}))
            decoder = SpeculativeDecoder(target, drafter, spec)
            for i, (p, ref) in enumerate(zip(prompts, refs, strict=True)):
                r = decoder.generate(p, NEW_TOKENS)
                assert r.token_ids == ref, f"{arch} {decoder.spec}: prompt {i} diverged"
                assert r.target_forward_passes == 1 + len(r.accepted_per_step)
    finally:
        target.set_aux_hidden_state_layers(aux)


@pytest.mark.parametrize("arch", [a for a in HYBRID_ARCHITECTURES if a not in RECURRENT_ARCHS])
def test_other_hybrid_families_decode_exactly(arch):
    """Qwen3.5 (dense gated delta-net), Falcon-H1 (attention beside Mamba-2 in every layer), Jamba (Mamba-1),
    Bamba, Kimi-Linear (Kimi Delta Attention, MLA): the mixers are found by structure, not by name."""
    target = Target(build_tiny_model(arch, num_hidden_layers=4, dtype=torch.float64))
    assert target.is_recurrent
    prompts = random_prompts(2, seed=5)
    refs = [SpeculativeDecoder(target).generate(p, NEW_TOKENS).token_ids for p in prompts]
    drafter = new_drafter(target, seed=1)
    for spec in (ChainSpec(3), TreeSpec(3, 2, 5)):
        decoder = SpeculativeDecoder(target, drafter, spec)
        assert [decoder.generate(p, NEW_TOKENS).token_ids for p in prompts] == refs, spec


def test_partial_acceptance_is_exact_with_a_fitted_drafter():
    """A drafter fitted to the target accepts some drafts and rejects others: every cut point is exercised."""
    target = recurrent_target("qwen3_next")
    prompts, refs = references("qwen3_next")
    drafter = fit_drafter(target, [p + r for p, r in zip(prompts, refs, strict=True)], steps=120)
    accepted = []
    for spec in (ChainSpec(4), TreeSpec(3, 3, 8)):
        decoder = SpeculativeDecoder(target, drafter, spec)
        for p, ref in zip(prompts, refs, strict=True):
            r = decoder.generate(p, NEW_TOKENS)
            assert r.token_ids == ref, spec
            accepted += r.accepted_per_step
    assert any(0 < a < 3 for a in accepted), accepted  # cut inside a chain and inside a tree path


# --- the state itself ---------------------------------------------------------------------------------------------
def _states(cache) -> list[torch.Tensor]:
    """Every tensor that carries the target's state: keys/values, conv windows, recurrent states."""
    out = []
    for layer in cache.hf.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if t is not None and t.numel():
                out.append(t)
        for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
            out += [t for t in states.values() if t is not None]
    return out


def _reference_cache(target: Target, prefix: torch.Tensor, tokens: list[int]):
    cache = target.new_cache()
    target(prefix, cache=cache)
    for tok in tokens:  # one token at a time, as plain decoding feeds them
        target(torch.tensor([[tok]]), cache=cache)
    return cache


BLOCKS = [  # (block parents, kept nodes): a chain cut after its second node, a chain cut at the root, a tree path
    ([-1, 0, 1, 2, 3], [0, 1]),
    ([-1, 0, 1, 2], [0]),
    ([-1, 0, 0, 1, 2, 2], [0, 2, 5]),
]


def _block_then_keep(target: Target, prefix, block, parents, nodes):
    cache = target.new_cache()
    target(prefix, cache=cache)
    cache.begin_block(parents)
    n, length = block.shape[1], prefix.shape[1]
    depth = [0] * n
    allowed = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            depth[i] = depth[p] + 1
            allowed[i] |= allowed[p]
    mask = torch.cat([torch.ones(n, length, dtype=torch.bool), allowed], 1)
    additive = torch.zeros(mask.shape, dtype=target.dtype).masked_fill(~mask, torch.finfo(target.dtype).min)
    target(block, cache=cache, attention_mask=additive[None, None], position_ids=length + torch.tensor([depth]))
    cache.keep(length, nodes)
    return cache


@pytest.mark.parametrize("arch", RECURRENT_ARCHS)
@pytest.mark.parametrize(("parents", "nodes"), BLOCKS)
def test_rollback_leaves_no_trace_of_rejected_tokens(arch, parents, nodes):
    target = recurrent_target(arch)
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 250, (1, 9), generator=g)
    block = torch.randint(3, 250, (1, len(parents)), generator=g)
    cache = _block_then_keep(target, prefix, block, parents, nodes)
    ref = _reference_cache(target, prefix, block[0, nodes].tolist())
    got, want = _states(cache), _states(ref)
    assert len(got) == len(want) > 0
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-7)
    nxt = torch.tensor([[17]])
    torch.testing.assert_close(target(nxt, cache=cache).logits, target(nxt, cache=ref).logits, atol=1e-9, rtol=1e-7)


def test_the_rollback_check_catches_one_layer_that_keeps_a_rejected_update(monkeypatch):
    """The state comparison above has teeth: skip the restore of one recurrent layer and it differs."""
    target = recurrent_target("granitemoehybrid")
    skipped = target.recurrent_layers[1]
    real = target_cache._restore

    def restore_but_one(layer, state):
        if layer is not cache_layers[skipped]:
            real(layer, state)

    prefix, block = torch.tensor([[5, 9, 13, 21]]), torch.tensor([[30, 31, 32, 33]])
    parents, nodes = [-1, 0, 1, 2], [0]
    cache = target.new_cache()
    cache_layers = cache.hf.layers
    target(prefix, cache=cache)
    cache.begin_block(parents)
    target(block, cache=cache)
    monkeypatch.setattr(target_cache, "_restore", restore_but_one)
    cache.keep(prefix.shape[1], nodes)
    ref = _reference_cache(target, prefix, [30])
    layer, ref_layer = cache.hf.layers[skipped], ref.hf.layers[skipped]
    assert not torch.allclose(layer.recurrent_states[0], ref_layer.recurrent_states[0])
    for i in target.recurrent_layers:
        if i != skipped:
            torch.testing.assert_close(cache.hf.layers[i].recurrent_states[0], ref.hf.layers[i].recurrent_states[0])


def test_keep_without_a_block_pass_is_refused_on_recurrent_targets():
    target = recurrent_target("lfm2")
    cache = target.new_cache()
    target(torch.tensor([[4, 5, 6]]), cache=cache)
    with pytest.raises(RuntimeError, match="begin_block"):
        cache.keep(2)


def test_a_recurrent_layer_without_a_findable_mixer_is_refused_in_one_line():
    model = build_tiny_model("lfm2", num_hidden_layers=4)
    model.model.layers[1].conv.layer_idx = 7  # the mixer no longer says which cache layer it owns
    target = Target(model)
    with pytest.raises(target_cache.RecurrentTargetError, match="decoder layer 1 .* refused") as e:
        target.new_cache()
    assert "\n" not in str(e.value)


# --- sampling ---------------------------------------------------------------------------------------------------
V = 12


@functools.cache
def flat_recurrent_target(arch: str) -> Target:
    return Target(build_tiny_model(arch, seed=4, dtype=torch.float64, vocab_size=V, num_hidden_layers=4,
                                   head_scale=4.0, bos_token_id=0, eos_token_id=V - 1, pad_token_id=0))


#: Draws of each law test here: at test_sampling_law's count (560) the Granite target's less flat pair law keeps 29
#: cells, under MIN_CELLS.
DRAWS = 800


# DRAWS each, stepped through recurrent layers: 15-60 s apiece on one core, so in the slow run. The default run
# checks the rollback itself (above); the accept rule is the one test_sampling_law checks on attention targets.
@pytest.mark.slow
@pytest.mark.parametrize(("arch", "spec"), [
    pytest.param("lfm2", ChainSpec(2), id="lfm2-chain"),
    pytest.param("granitemoehybrid", ChainSpec(2), id="granite4-chain"),
    pytest.param("granitemoehybrid", TreeSpec(depth=2, top_k=2, total_tokens=4), id="granite4-tree"),
])
def test_sampled_decoding_keeps_the_law_of_a_recurrent_target(arch, spec):
    target = flat_recurrent_target(arch)
    params = SamplingParams(1.0)
    prompt = [3, 7, 5]
    g = torch.Generator().manual_seed(5)
    plain = SpeculativeDecoder(target)
    seqs = [prompt + plain.generate(prompt, 8, params, generator=g).token_ids for _ in range(16)]
    decoder = SpeculativeDecoder(target, fit_drafter(target, seqs, steps=60), spec)
    exact = exact_joint(target, prompt, 3, params)
    counts = torch.zeros_like(exact)
    accepted = 0
    g = torch.Generator().manual_seed(123)
    for _ in range(DRAWS):
        r = decoder.generate(prompt, 3, params, generator=g)
        toks = r.token_ids
        counts[(toks[0] * V + toks[1]) * V + toks[2]] += 1
        accepted += sum(r.accepted_per_step)
    assert accepted > DRAWS // 4
    for pair, (pvalue, cells) in law_pvalues(counts, exact, V).items():
        assert cells >= MIN_CELLS, (pair, cells)
        assert pvalue > ALPHA, (pair, pvalue)


# --- the command line -----------------------------------------------------------------------------------------
def test_decode_command_on_saved_recurrent_targets(tmp_path, capsys):
    """The issue's reproduction: `decode --random-drafter` in chain, tree and lookup modes, equal to plain."""
    for arch in ("qwen3_next", "lfm2", "granitemoehybrid"):
        path = save_tiny_target(tmp_path / arch, arch, num_hidden_layers=4)
        base = ["decode", "--target", str(path), "--prompt", "hello there, hello there", "--max-new-tokens", "8",
                "--json"]
        assert main(base) == 0
        plain = json.loads(capsys.readouterr().out)["token_ids"]
        for mode in (["--random-drafter", "--chain", "3"], ["--random-drafter", "--tree", "3,4,12"],
                     ["--prompt-lookup", "4"]):
            code = main(base + mode)
            out, err = capsys.readouterr()
            assert code == 0, err
            assert json.loads(out)["token_ids"] == plain, (arch, mode)


# --- the other stages that run the target -------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen3_next", "granitemoehybrid"])
def test_batched_generation_on_recurrent_targets_matches_one_by_one(arch, tmp_path):
    """generate's local backend: left padding must not leak into a recurrent state, and finished rows leave the
    batch (every kind of cache layer drops them) without disturbing the others."""
    from draftsmith.model.target import load_target
    from draftsmith.stages.generate.backends import LocalBackend, _Sampling

    target = load_target(save_tiny_target(tmp_path / arch, arch, num_hidden_layers=4))
    tok = target.tokenizer
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("hello", "the river and the city grew",
                                                                        "a small fishing village")]
    backend = LocalBackend(target, batch_size=8)
    sampling = _Sampling(NEW_TOKENS, 0.0, 1.0)
    alone = [backend.generate_ids([p], sampling, [0])[0][0] for p in prompts]
    assert alone == [SpeculativeDecoder(target).generate(p, NEW_TOKENS).token_ids for p in prompts]
    backend.stop_ids = {alone[0][2]}  # the first row stops early: the batch shrinks mid-generation
    batched = [ids for ids, _ in backend.generate_ids(prompts, sampling, [0] * len(prompts))]
    assert batched[0] == alone[0][:alone[0].index(alone[0][2]) + 1]
    for row, ref in zip(batched[1:], alone[1:], strict=True):
        cut = next((i for i, t in enumerate(ref) if t in backend.stop_ids), len(ref) - 1)
        assert row == ref[:cut + 1]


@pytest.mark.slow
def test_tiny_demo_pipeline_on_a_recurrent_target(tmp_path):
    """generate -> capture -> vocab -> train -> export -> bench on a tiny LFM2 target: bench's speculative methods
    equal plain greedy decoding on every prompt (several minutes on two busy cores, so in the slow run)."""
    from draftsmith.app.demo import PRESETS, run_demo

    work = tmp_path / "demo"
    save_tiny_target(work / "target", "lfm2", num_hidden_layers=4)
    run_demo("tiny", work, target=str(work / "target"), progress=False)
    exported = json.loads((work / "export" / "vllm" / "config.json").read_text())
    assert exported["eagle_aux_hidden_state_layer_ids"]
    report = json.loads((work / "bench" / "bench.json").read_text())
    limit = PRESETS["tiny"].bench_limit
    methods = report["results"][0]["methods"]
    assert len(methods) > 1
    for name, m in methods.items():
        if name != "plain":
            assert m["identical_to_plain"] == f"{limit}/{limit}", name



def test_verify_cost_measures_chains_and_branching_trees_on_a_recurrent_target(monkeypatch):
    """verify_cost's tree passes branch, so a recurrent target steps them node by node as decoding does (a chain goes
    through each mixer in one call), and every pass is cut back to the prefix."""
    from draftsmith.stages import verify_cost

    target = recurrent_target("lfm2")
    seen = []
    begin = target_cache.TargetCache.begin_block

    def spy(self, parents):
        seen.append(list(parents))
        return begin(self, parents)

    monkeypatch.setattr(target_cache.TargetCache, "begin_block", spy)
    cost = verify_cost.measure_verify_cost(target, ks=(1, 4), reps=1, prefix=16)
    assert [-1, 0, 1, 2] in seen and [-1, 0, 0, 1] in seen
    assert all(t > 0 for t in (*cost.verify.values(), *cost.tree_verify.values()))


@pytest.mark.parametrize(("model_type", "fields"), [
    ("mamba2", dict(num_heads=4, head_dim=32, state_size=16, n_groups=1, chunk_size=16, expand=2)),
    ("falcon_mamba", dict(state_size=8, expand=2, conv_kernel=4, intermediate_size=128)),
    ("zamba2", dict(mamba_d_state=16, mamba_headdim=16, n_mamba_heads=8, mamba_ngroups=1, num_attention_heads=4,
                    num_key_value_heads=4, intermediate_size=128, attention_head_dim=32, hybrid_layer_ids=[1],
                    layers_block_type=["mamba", "hybrid", "mamba", "mamba"], use_mem_rope=False)),
])
def test_state_space_targets_without_attention_decode_exactly(model_type, fields):
    """Targets with no attention at all (Mamba-2, Falcon-Mamba) or a shared attention block (Zamba2): the drafter
    takes its heads from the hidden size, and every mode stays exact."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=256, hidden_size=64, num_hidden_layers=4, pad_token_id=0,
                                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    model.get_output_embeddings().weight.data.mul_(24)
    target = Target(model)
    assert target.is_recurrent
    drafter = new_drafter(target, seed=1)
    prompt = [5, 9, 13, 21, 40, 7, 7, 8]
    ref = SpeculativeDecoder(target).generate(prompt, NEW_TOKENS).token_ids
    for drafter_, spec in ((drafter, ChainSpec(3)), (drafter, TreeSpec(3, 3, 8)), (None, NgramSpec(3))):
        assert SpeculativeDecoder(target, drafter_, spec).generate(prompt, NEW_TOKENS).token_ids == ref, spec
