"""Sampling keeps the target's law: the accept step alone, plain top-k/top-p decoding, and end-to-end speculative
decoding with a reduced draft vocabulary (non-identity d2t) and a peaked drafter, against the exact joint law.

The end-to-end target has a 12-token vocabulary and a flattened head, so that the law of a token pair spreads over
34-60 cells holding 5 or more expected draws out of 560 (the old 3-token law on a peaked target had about 13).
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import fit_drafter
from scipy.special import chdtrc

from draftsmith.core import vocab as vocab_mod
from draftsmith.model.drafter import Eagle3Drafter, new_drafter
from draftsmith.model.target import Target
from draftsmith.stages.block_decode import scatter_q
from draftsmith.stages.decode import (
    ChainSpec,
    SamplingParams,
    SpeculativeDecoder,
    TreeSpec,
    _Tree,
    logits_to_probs,
)
from draftsmith.testing.models import build_tiny_model

ALPHA = 1e-3  # significance level of each distribution test (fixed seeds: the outcome is deterministic)
V = 12  # the end-to-end target's vocabulary
#: Draws of each end-to-end law test (here, test_hybrid's and test_block_decode's). Faults planted
#: in the accept step and in the sampled drafts' q (seven that these tests catch) fail the same tests at 560 draws as
#: at 800; an unrenormalised tree residual is left to the accept-only tests below at either count.
DRAWS = 560
MIN_CELLS = 30  # a law test with fewer cells of expected count >= 5 says little
#: Draws of the accept step alone (a 10-token law). Seven planted faults (the residual or the accept ratio ignoring
#: q, a rejected tree child kept or not renormalised, |p - q| as the residual, the first draft's q for the second, the
#: unfiltered softmax as p) fail the same tests at 6,000 draws as at 20,000; at 3,000 one case slips.
ACCEPT_DRAWS = 6000
#: The reduced draft vocabulary: every id not divisible by 3, so d2t is 1, 1, 2, 2, ... (never the identity).
DRAFT_IDS = torch.tensor([i for i in range(V) if i % 3])


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """(p-value, cells) of a chi-square goodness-of-fit test, merging cells with expected count < 5.

    A draw in a cell of probability 0 is impossible under the law: that fails outright (it is how an ignored
    top-k/top-p shows).
    """
    impossible = counts[probs <= 0].sum()
    assert impossible == 0, f"{int(impossible)} draws of probability-0 outcomes"
    n = counts.sum().item()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()
    # Pearson's statistic and its chi-square tail (scipy.stats.chisquare's p-value; scipy.special imports in a
    # third of scipy.stats' time, and every worker imports this module).
    pvalue = float(chdtrc(len(obs) - 1, float(((obs - exp) ** 2 / exp).sum())))
    return pvalue, int((~small).sum())


def law_pvalues(counts: torch.Tensor, exact: torch.Tensor, vocab: int = V) -> dict[str, tuple[float, int]]:
    """Three emitted tokens, tested as the pairs (t1, t2) and (t2, t3): each pair law has enough cells to mean
    something at 560 draws, where the 3-token law (vocab^3 cells) would merge into a dozen. The first pair sees the
    prefill pick and the first draft's accept step, the second the second draft's. A draw of an impossible
    triple fails outright."""
    impossible = counts[exact <= 0].sum()
    assert impossible == 0, f"{int(impossible)} draws of probability-0 token triples"
    c, e = counts.view(vocab, vocab, vocab), exact.view(vocab, vocab, vocab)
    return {"t1,t2": chi2(c.sum(2).flatten(), e.sum(2).flatten()),
            "t2,t3": chi2(c.sum(0).flatten(), e.sum(0).flatten())}


def exact_joint(target: Target, prompt: list[int], n: int, params: SamplingParams) -> torch.Tensor:
    """Exact law of the next ``n`` tokens under the target's sampling distribution (vocab^n cells)."""
    v = target.vocab_size
    seqs = [()]
    probs = torch.ones(1, dtype=torch.float64)
    for _ in range(n):
        ids = torch.tensor([prompt + list(s) for s in seqs])
        nxt = logits_to_probs(target(ids).logits[:, -1], params).double()  # [S, V]
        probs = (probs[:, None] * nxt).flatten()
        seqs = [s + (t,) for s in seqs for t in range(v)]
    return probs


@functools.cache
def flat_target() -> Target:
    """12 tokens, a head scaled to spread the law (max pair probability ~0.04) instead of the default peak."""
    return Target(build_tiny_model("llama", seed=4, dtype=torch.float64, vocab_size=V, num_hidden_layers=3,
                                   head_scale=4.0, bos_token_id=0, eos_token_id=V - 1, pad_token_id=0))


@functools.cache
def peaked_reduced_drafter() -> Eagle3Drafter:
    """A drafter fitted to the target's greedy choices (peaked: it accepts often, so the q bookkeeping of every
    chain position matters), cut to ``DRAFT_IDS``: its head keeps those rows, and d2t maps them back."""
    target = flat_target()
    g = torch.Generator().manual_seed(5)
    plain = SpeculativeDecoder(target)
    prompts = [[3, 7, 5, *torch.randint(1, V, (1,), generator=g).tolist()] for _ in range(16)]
    seqs = [p + plain.generate(p, 10, SamplingParams(1.0), generator=g).token_ids for p in prompts]
    full = fit_drafter(target, seqs, steps=60)
    dv = vocab_mod.from_target_ids(DRAFT_IDS, V)
    drafter = new_drafter(target, draft_vocab=dv, seed=0)
    state = full.state_dict()
    state["lm_head.weight"], state["d2t"], state["t2d"] = state["lm_head.weight"][DRAFT_IDS], dv.d2t, dv.t2d
    drafter.load_state_dict(state)
    return drafter


# --- pieces -------------------------------------------------------------------------------------------------------
def test_logits_to_probs_filters():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert p[0] == 1.0  # the top token alone holds >= 0.5 of the mass
    p = logits_to_probs(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(p, (logits / 0.5).softmax(-1))


def test_top_k_keeps_exactly_the_k_largest_and_ties_at_the_kth():
    """Top-k keeps the k largest logits, the k-th included, renormalized among themselves. A tie at the k-th
    value keeps every tied token (Hugging Face's TopKLogitsWarper and vLLM drop only ``logits < kth``): which of
    equal logits survives must not hang on its token id."""
    logits = torch.tensor([0.5, 3.0, -1.0, 2.0, 1.0])
    for k in range(1, 5):
        p = logits_to_probs(logits, SamplingParams(temperature=0.7, top_k=k))
        keep = logits.argsort(descending=True)[:k]
        want = torch.zeros(5)
        want[keep] = (logits[keep] / 0.7).softmax(-1)
        torch.testing.assert_close(p, want)
        assert (p > 0).sum() == k and p[keep[-1]] > 0  # the k-th largest keeps its mass
    ties = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    p = logits_to_probs(ties, SamplingParams(temperature=1.0, top_k=2))
    kept = torch.tensor([3.0, 2.0, 2.0]).exp()  # the top one and both tokens tied for second
    torch.testing.assert_close(p[0], torch.cat([torch.zeros(1), kept / kept.sum(), torch.zeros(1)]))
    torch.testing.assert_close(p[1], torch.full((5,), 0.2))  # all equal: nothing is cut


def test_draft_q_sits_at_the_target_ids():
    """A sampled draft's q lives over the draft vocabulary; the accept step reads it at target ids (via d2t)."""
    drafter = new_drafter(flat_target(), draft_vocab=vocab_mod.from_target_ids(DRAFT_IDS, V), seed=0)
    q = torch.softmax(torch.randn(len(DRAFT_IDS), generator=torch.Generator().manual_seed(0)), -1)
    full = scatter_q(drafter, q)
    torch.testing.assert_close(full[DRAFT_IDS], q, atol=0, rtol=0)
    assert full[[i for i in range(V) if i % 3 == 0]].eq(0).all()


@pytest.mark.parametrize("params", [SamplingParams(1.0, top_k=3), SamplingParams(0.8, top_p=0.6)])
def test_plain_sampling_applies_top_k_and_top_p(params):
    """Every token of a plain sampled decode lies in the filtered support of its row (the prefill pick and the
    speculative decoder's first token come from the same ``_pick``)."""
    target = flat_target()
    prompt = [3, 7, 5]
    g = torch.Generator().manual_seed(0)
    for decoder in (SpeculativeDecoder(target), SpeculativeDecoder(target, peaked_reduced_drafter(), ChainSpec(2))):
        for _ in range(4):
            toks = decoder.generate(prompt, 12, params, generator=g).token_ids
            rows = logits_to_probs(target(torch.tensor([prompt + toks])).logits[0, len(prompt) - 1: -1], params)
            assert bool((rows[torch.arange(len(toks)), torch.tensor(toks)] > 0).all()), toks


class _StubDrafter:
    """Just the vocabulary mapping the accept step needs."""

    def __init__(self, vocab: int):
        self.d2t = torch.zeros(vocab, dtype=torch.long)


def _accept_only_decoder(vocab: int) -> SpeculativeDecoder:
    decoder = SpeculativeDecoder.__new__(SpeculativeDecoder)
    decoder.drafter = _StubDrafter(vocab)
    return decoder


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9), SamplingParams(1.3, top_k=5)])
def test_acceptance_rule_is_distribution_preserving(params):
    """The accept step alone, many draws: first emitted token ~ p for sampled chain drafts and tree children."""
    g = torch.Generator().manual_seed(0)
    vocab = 10
    target_logits = torch.randn(4, vocab, generator=g) * 1.5  # a row per tree node (root + 3 children)
    p = logits_to_probs(target_logits[0], params)
    q = torch.softmax(torch.randn(vocab, generator=g) * 2, -1)  # a poor drafter
    decoder = _accept_only_decoder(vocab)
    n = ACCEPT_DRAWS
    chain_counts = torch.zeros(vocab)
    tree_counts = torch.zeros(vocab)
    children = torch.topk(q, 3).indices.tolist()
    tree = _Tree(tokens=children, parents=[0, 0, 0], depths=[1, 1, 1], is_tree=True, scores=[-1.0, -2.0, -3.0])
    for _ in range(n):
        x = int(torch.multinomial(q, 1, generator=g))
        chain = _Tree(tokens=[x], parents=[0], depths=[1], is_tree=False, q_probs=[q])
        path, bonus = decoder._accept(chain, target_logits, params, g)
        chain_counts[x if path else bonus] += 1
        path, bonus = decoder._accept(tree, target_logits, params, g)
        tree_counts[children[path[0] - 1] if path else bonus] += 1
    assert chi2(chain_counts, p)[0] > ALPHA
    assert chi2(tree_counts, p)[0] > ALPHA


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9)])
def test_second_chain_draft_is_judged_by_its_own_q(params):
    """A two-draft chain, each draft drawn from its own q (q1 overlaps the target's row 0, so the first draft is
    often accepted; q2 is far from q1): after an accepted first draft, the next token follows row 1's law."""
    g = torch.Generator().manual_seed(1)
    vocab = 10
    target_logits = torch.randn(3, vocab, generator=g) * 1.5
    p0, p1 = (logits_to_probs(row, params) for row in target_logits[:2])
    q1 = 0.7 * p0 + 0.3 * torch.softmax(torch.randn(vocab, generator=g) * 2, -1)
    q2 = torch.softmax(torch.randn(vocab, generator=g) * 3, -1)
    decoder = _accept_only_decoder(vocab)
    counts, first = torch.zeros(vocab), 0
    for _ in range(ACCEPT_DRAWS):
        x1, x2 = (int(torch.multinomial(q, 1, generator=g)) for q in (q1, q2))
        chain = _Tree(tokens=[x1, x2], parents=[0, 1], depths=[1, 2], is_tree=False, q_probs=[q1, q2])
        path, bonus = decoder._accept(chain, target_logits, params, g)
        if path:
            first += 1
            counts[x2 if len(path) == 2 else bonus] += 1
    assert first > ACCEPT_DRAWS // 2  # the second draft's accept step ran often
    assert chi2(counts, p1)[0] > ALPHA


# --- end to end ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("spec", "params"), [
    pytest.param(ChainSpec(2), SamplingParams(1.0), id="chain-T1"),
    pytest.param(ChainSpec(2), SamplingParams(0.7, top_p=0.9), id="chain-T0.7-top-p0.9"),
    pytest.param(TreeSpec(depth=2, top_k=2, total_tokens=4), SamplingParams(1.0), id="tree-T1"),
])
def test_sampled_speculative_decoding_keeps_target_distribution(spec, params):
    """A peaked drafter over a reduced draft vocabulary: the law of 3 emitted tokens is the target's. (Tree
    children under top-p are covered by the accept step alone, in test_acceptance_rule_is_distribution_preserving.)"""
    target = flat_target()
    prompt = [3, 7, 5]
    exact = exact_joint(target, prompt, 3, params)
    decoder = SpeculativeDecoder(target, peaked_reduced_drafter(), spec)
    g = torch.Generator().manual_seed(123)
    counts = torch.zeros_like(exact)
    accepted = 0
    for _ in range(DRAWS):
        r = decoder.generate(prompt, 3, params, generator=g)
        toks = r.token_ids
        counts[(toks[0] * V + toks[1]) * V + toks[2]] += 1
        accepted += sum(r.accepted_per_step)
    assert accepted > DRAWS // 4  # the peaked drafter exercises the accept paths, not just the residuals
    for pair, (pvalue, cells) in law_pvalues(counts, exact).items():
        assert cells >= MIN_CELLS, (pair, cells)
        assert pvalue > ALPHA, (pair, pvalue)
