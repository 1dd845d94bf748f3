"""Block drafters (DFlash, DSpark) decode losslessly: greedy output equals plain on every tiny architecture, a
fitted drafter accepts several tokens a block, and sampled decoding keeps the target's law."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import block_target, fit_block_drafter, random_prompts
from test_sampling_law import ALPHA, DRAFT_IDS, DRAWS, MIN_CELLS, V, exact_joint, law_pvalues

from draftsmith.core import vocab as vocab_mod
from draftsmith.core.errors import UsageError
from draftsmith.model.block_drafter import new_block_drafter
from draftsmith.model.target import Target
from draftsmith.stages.block_decode import BlockSpec
from draftsmith.stages.decode import ChainSpec, SamplingParams, SpeculativeDecoder
from draftsmith.testing.models import TINY_ARCHITECTURES, build_tiny_model

NEW_TOKENS = 10
KINDS = {"dflash": {}, "dspark": {"markov_rank": 16}}


@functools.cache
def references(arch: str, n: int = 2):
    target = block_target(arch)
    prompts = random_prompts(n, seed=7)
    return prompts, [SpeculativeDecoder(target).generate(p, NEW_TOKENS).token_ids for p in prompts]


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_random_block_drafters_equal_plain_greedy(arch):
    target = block_target(arch)
    prompts, refs = references(arch)
    for kind, overrides in KINDS.items():
        drafter = new_block_drafter(target, kind, seed=1, **overrides)
        decoder = SpeculativeDecoder(target, drafter)
        assert decoder.spec == BlockSpec(drafter.config.num_drafts, kind)
        for i, (p, ref) in enumerate(zip(prompts, refs, strict=True)):
            r = decoder.generate(p, NEW_TOKENS)
            assert r.token_ids == ref, f"{arch} {kind}: prompt {i} diverged"
            assert r.target_forward_passes == 1 + len(r.accepted_per_step)
            assert all(d == drafter.config.num_drafts for d in r.drafted_per_step)


@functools.cache
def fitted(kind: str):
    target = block_target("llama")
    prompts = random_prompts(16, seed=11, max_len=12)
    plain = SpeculativeDecoder(target)
    seqs = [p + plain.generate(p, 24).token_ids for p in prompts]
    return fit_block_drafter(target, seqs, kind, steps=40, num_hidden_layers=1, **KINDS[kind]), prompts


@pytest.mark.parametrize("kind", KINDS)
def test_fitted_block_drafter_accepts_and_stays_exact(kind):
    target = block_target("llama")
    drafter, prompts = fitted(kind)
    refs = [SpeculativeDecoder(target).generate(p, 20).token_ids for p in prompts[:5]]
    taus = []
    for k in (None, 3):
        decoder = SpeculativeDecoder(target, drafter, BlockSpec(k))
        for p, ref in zip(prompts, refs, strict=False):
            r = decoder.generate(p, 20)
            assert r.token_ids == ref
            assert len(r.token_ids) <= 1 + sum(a + 1 for a in r.accepted_per_step)
            assert all(0 <= a <= decoder.spec.k for a in r.accepted_per_step)
            taus.append(r.acceptance_length)
    assert sum(taus) / len(taus) > 2.0, taus  # several tokens a block: the accept paths run


def test_block_spec_checks():
    target = block_target("llama")
    drafter = new_block_drafter(target, "dflash", block_size=4)
    with pytest.raises(UsageError, match="at most 3"):
        SpeculativeDecoder(target, drafter, BlockSpec(4))
    with pytest.raises(UsageError, match="cannot draft ChainSpec"):
        SpeculativeDecoder(target, drafter, ChainSpec(2))
    with pytest.raises(UsageError, match="1..64"):
        BlockSpec(0)


# --- sampling law -----------------------------------------------------------------------------------------------
@functools.cache
def flat_target() -> Target:
    """test_sampling_law's flat 12-token target, in a Target of its own (a block drafter moves its aux layers)."""
    return Target(build_tiny_model("llama", seed=4, dtype=torch.float64, vocab_size=V, num_hidden_layers=3,
                                   head_scale=4.0, bos_token_id=0, eos_token_id=V - 1, pad_token_id=0))


@functools.cache
def peaked_reduced_block_drafter(kind: str):
    """Fitted to sampled continuations (peaked: it accepts often), then cut to ``DRAFT_IDS`` (non-identity d2t)."""
    target = flat_target()
    g = torch.Generator().manual_seed(5)
    plain = SpeculativeDecoder(target)
    prompts = [[3, 7, 5, *torch.randint(1, V, (1,), generator=g).tolist()] for _ in range(16)]
    seqs = [p + plain.generate(p, 10, SamplingParams(1.0), generator=g).token_ids for p in prompts]
    overrides = {"block_size": 3, "num_hidden_layers": 1, **({"markov_rank": 8} if kind == "dspark" else {})}
    full = fit_block_drafter(target, seqs, kind, steps=25, **overrides)
    dv = vocab_mod.from_target_ids(DRAFT_IDS, V)
    drafter = new_block_drafter(target, kind, draft_vocab=dv, **overrides)
    state = full.state_dict()
    for name in ("lm_head.weight", "markov_head.markov_w2.weight"):
        if name in state:
            state[name] = state[name][DRAFT_IDS]
    state["d2t"], state["t2d"] = dv.d2t, dv.t2d
    drafter.load_state_dict(state)
    return drafter


@pytest.mark.parametrize(("kind", "params"), [
    pytest.param("dflash", SamplingParams(1.0), id="dflash-T1"),
    pytest.param("dspark", SamplingParams(0.7, top_p=0.9), id="dspark-T0.7-top-p0.9"),
])
def test_sampled_block_decoding_keeps_target_distribution(kind, params):
    """Two drafts a block, each sampled from the q it is judged by (DSpark's with the Markov bias of the draft
    before it): the law of 3 emitted tokens is the target's."""
    target = flat_target()
    prompt = [3, 7, 5]
    exact = exact_joint(target, prompt, 3, params)
    decoder = SpeculativeDecoder(target, peaked_reduced_block_drafter(kind), BlockSpec(2))
    g = torch.Generator().manual_seed(123)
    counts = torch.zeros_like(exact)
    accepted = 0
    for _ in range(DRAWS):
        r = decoder.generate(prompt, 3, params, generator=g)
        toks = r.token_ids
        counts[(toks[0] * V + toks[1]) * V + toks[2]] += 1
        accepted += sum(r.accepted_per_step)
    assert accepted > DRAWS // 4, accepted
    for pair, (pvalue, cells) in law_pvalues(counts, exact).items():
        assert cells >= MIN_CELLS, (pair, cells)
        assert pvalue > ALPHA, (pair, pvalue)


# --- --shape auto for blocks ------------------------------------------------------------------------------------
def test_block_shapes_are_weighed_as_chains_with_one_drafter_pass():
    from draftsmith.stages.shapes import Acceptance, choose_shape, expected_tau, shape_name, verified_tokens
    from draftsmith.stages.verify_cost import VerifyCost

    acc = Acceptance.from_chain([0.9, 0.8, 0.5, 0.1])
    blocks = [BlockSpec(k, "dspark") for k in range(1, 5)]
    assert expected_tau(acc, blocks[2]) == pytest.approx(1 + 0.9 + 0.72 + 0.36)
    assert verified_tokens(blocks[3]) == 5 and shape_name(blocks[1]) == "dspark block 2"
    # verify costs 1 step up to 4 tokens, 1.5 at 5; a block costs 0.1 step whatever its length
    cost = VerifyCost(1.0, {1: 1.0, 4: 1.0, 5: 1.5}, draft={1: 0.1, 4: 0.1})
    assert cost.t_draft(blocks[3]) == pytest.approx(0.1)
    choice = choose_shape(acc, cost, blocks)
    assert choice.shape == blocks[2] and choice.speedup == pytest.approx((1 + 0.9 + 0.72 + 0.36) / 1.1)


@pytest.mark.parametrize("kind", KINDS)
def test_block_calibration_and_measured_cost(kind, monkeypatch, tmp_path):
    from draftsmith.stages.shapes import auto_shape, calibrate_block_acceptance

    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path))
    target = block_target("llama")
    drafter, prompts = fitted(kind)
    acc = calibrate_block_acceptance(target, drafter, prompts[:3], max_new_tokens=16)
    rates = [r[0] for r in acc.ranks]
    assert len(rates) == drafter.config.num_drafts and rates[0] > 0.5, rates  # fitted: the first draft lands
    sampled = calibrate_block_acceptance(target, drafter, prompts[:2], max_new_tokens=8, temperature=1.0)
    assert len(sampled.chain) == drafter.config.num_drafts and 0 < sampled.chain[0] <= 1
    choice, cost, _ = auto_shape(target, drafter, None, prompts=prompts[:2], reps=1,
                                 calibrate={"max_new_tokens": 12})
    assert set(cost.draft) == set(range(1, drafter.config.num_drafts + 1))
    assert all(name.startswith(f"{kind} block ") for name in choice.table)
    assert choice.shape is None or choice.shape.kind == kind
