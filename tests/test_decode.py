"""The core promise: speculative output equals plain greedy decoding, and sampling keeps the target's law."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from conftest import fit_drafter, random_prompts, tiny_target
from scipy.stats import chisquare

from draftsmith.model.drafter import new_drafter
from draftsmith.model.target import Target
from draftsmith.stages.decode import (
    ChainSpec,
    NgramSpec,
    SamplingParams,
    SpeculativeDecoder,
    TreeSpec,
    _Tree,
    logits_to_probs,
    ngram_propose,
)
from draftsmith.testing.models import build_tiny_model

LOSSLESS_ARCHS = ["llama", "qwen2", "deepseek_v3"]
LAYERS = 4  # the decoder logic does not depend on depth; 4 layers keep 50-prompt sweeps quick
N_PROMPTS = 50
NEW_TOKENS = 16
SPECS = [ChainSpec(4), TreeSpec(depth=4, top_k=3, total_tokens=12)]  # every prompt
EXTRA_SPECS = [ChainSpec(1), TreeSpec(3, 2, 6)]  # the first 10 prompts
ALPHA = 1e-3  # significance level of each distribution test (fixed seeds: the outcome is deterministic)


@functools.cache
def references(arch: str):
    """50 random prompts and the target's plain greedy continuations."""
    target = tiny_target(arch, num_hidden_layers=LAYERS)
    prompts = random_prompts(N_PROMPTS, seed=99)
    plain = SpeculativeDecoder(target)
    return prompts, [plain.generate(p, NEW_TOKENS).token_ids for p in prompts]


@functools.cache
def fitted(arch: str):
    prompts, refs = references(arch)
    return fit_drafter(tiny_target(arch, num_hidden_layers=LAYERS), [p + r for p, r in zip(prompts, refs, strict=True)],
                       steps=150)


@pytest.mark.parametrize("arch", LOSSLESS_ARCHS)
@pytest.mark.parametrize("drafter_kind", ["random", "fitted"])
def test_greedy_speculative_equals_plain(arch, drafter_kind):
    target = tiny_target(arch, num_hidden_layers=LAYERS)
    prompts, refs = references(arch)
    drafter = new_drafter(target, seed=1) if drafter_kind == "random" else fitted(arch)
    taus = {}
    for spec in SPECS + EXTRA_SPECS:
        n = N_PROMPTS if spec in SPECS else 10
        decoder = SpeculativeDecoder(target, drafter, spec)
        results = [decoder.generate(p, NEW_TOKENS) for p in prompts[:n]]
        for i, (r, ref) in enumerate(zip(results, refs[:n], strict=True)):
            assert r.token_ids == ref, f"{arch} {drafter_kind} {spec}: prompt {i} diverged"
            # Bookkeeping: every pass is a prefill or a verify; tokens add up.
            assert r.target_forward_passes == 1 + len(r.accepted_per_step)
            assert len(r.token_ids) <= 1 + sum(a + 1 for a in r.accepted_per_step)
            assert all(0 <= a <= spec.max_draft_tokens for a in r.accepted_per_step)
        taus[spec] = sum(r.acceptance_length for r in results) / len(results)
    if drafter_kind == "fitted":
        # The fitted drafter must actually exercise the accept paths (multi-token acceptance).
        assert taus[ChainSpec(4)] > 2.5, taus
        assert taus[TreeSpec(4, 3, 12)] > 2.5, taus


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_prompt_lookup_baseline_is_lossless(arch):
    target = tiny_target(arch, num_hidden_layers=LAYERS)
    prompts, refs = references(arch)
    decoder = SpeculativeDecoder(target, None, NgramSpec(k=3))
    accepted = 0
    for p, ref in zip(prompts, refs, strict=True):
        r = decoder.generate(p, NEW_TOKENS)
        assert r.token_ids == ref
        accepted += sum(r.accepted_per_step)
    assert accepted > 0  # greedy continuations of tiny models repeat themselves: lookup finds some


def test_ngram_propose():
    spec = NgramSpec(k=2, max_ngram=2)
    assert ngram_propose([1, 2, 3, 4, 1, 2], spec) == [3, 4]
    assert ngram_propose([5, 6, 7, 9, 7], spec) == [9, 7]  # falls back to a 1-gram
    assert ngram_propose([1, 2, 3], spec) == []


def test_stop_token_and_budget_respected():
    target = tiny_target("llama", num_hidden_layers=LAYERS)
    prompts, refs = references("llama")
    drafter = fitted("llama")
    p, ref = prompts[0], refs[0]
    stop = ref[5]
    expect = ref[: ref.index(stop) + 1]
    for spec in SPECS + EXTRA_SPECS:
        r = SpeculativeDecoder(target, drafter, spec).generate(p, NEW_TOKENS, eos_token_ids=[stop])
        assert r.token_ids == expect
        r = SpeculativeDecoder(target, drafter, spec).generate(p, 7)
        assert r.token_ids == ref[:7]


# --- sampling: distribution preservation ----------------------------------------------------------------
def test_logits_to_probs_filters():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert p[0] == 1.0  # the top token alone holds >= 0.5 of the mass
    p = logits_to_probs(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(p, (logits / 0.5).softmax(-1))


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of a chi-square goodness-of-fit test, merging cells with expected count < 5."""
    n = counts.sum().item()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
        assert counts[small].sum() == 0, "a token of probability 0 was sampled"
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


class _StubDrafter:
    """Just the vocabulary mapping the accept step needs."""

    def __init__(self, vocab: int):
        self.d2t = torch.zeros(vocab, dtype=torch.long)


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9), SamplingParams(1.3, top_k=5)])
def test_acceptance_rule_is_distribution_preserving(params):
    """The accept step alone, many draws: first emitted token ~ p for sampled chain drafts and tree children."""
    g = torch.Generator().manual_seed(0)
    vocab = 10
    target_logits = torch.randn(4, vocab, generator=g) * 1.5  # a row per tree node (root + 3 children)
    p = logits_to_probs(target_logits[0], params)
    q = torch.softmax(torch.randn(vocab, generator=g) * 2, -1)  # a poor drafter
    decoder = SpeculativeDecoder.__new__(SpeculativeDecoder)
    decoder.drafter = _StubDrafter(vocab)
    n = 20000
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
    assert _chi2(chain_counts, p) > ALPHA
    assert _chi2(tree_counts, p) > ALPHA


@functools.cache
def _small_vocab_target() -> Target:
    return Target(build_tiny_model("llama", seed=4, dtype=torch.float64, vocab_size=12, num_hidden_layers=4,
                                   bos_token_id=0, eos_token_id=11, pad_token_id=0))


def _exact_joint(target: Target, prompt: list[int], n: int, params: SamplingParams) -> torch.Tensor:
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


@pytest.mark.parametrize("spec", [ChainSpec(2), TreeSpec(depth=2, top_k=2, total_tokens=4)])
def test_sampled_speculative_decoding_keeps_target_distribution(spec):
    """End to end on a 12-token vocabulary: the law of 3 emitted tokens equals the target's (chi-square)."""
    target = _small_vocab_target()
    params = SamplingParams(temperature=1.0)
    prompt = [3, 7, 5]
    exact = _exact_joint(target, prompt, 3, params)
    drafter = new_drafter(target, seed=2)
    decoder = SpeculativeDecoder(target, drafter, spec)
    g = torch.Generator().manual_seed(123)
    counts = torch.zeros_like(exact)
    for _ in range(1500):
        toks = decoder.generate(prompt, 3, params, generator=g).token_ids
        counts[(toks[0] * 12 + toks[1]) * 12 + toks[2]] += 1
    assert _chi2(counts, exact) > ALPHA


def test_spec_parsing_and_validation():
    assert TreeSpec.parse("5,8,48") == TreeSpec(5, 8, 48)
    with pytest.raises(ValueError, match="DEPTH,TOPK,TOTAL"):
        TreeSpec.parse("5,8")
    with pytest.raises(ValueError):
        ChainSpec(0)
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    assert list(itertools.islice(EXTRA_SPECS, 1)) == [ChainSpec(1)]


def test_draft_shapes_are_bounded_with_usage_errors():
    """Issue 19.6: K and tree sizes have documented maxima; every bad shape is a UsageError."""
    from draftsmith.core.errors import UsageError
    from draftsmith.stages.decode import MAX_DRAFT_LENGTH, MAX_TREE_TOKENS

    ChainSpec(MAX_DRAFT_LENGTH)
    NgramSpec(MAX_DRAFT_LENGTH)
    TreeSpec(MAX_DRAFT_LENGTH, 2, MAX_TREE_TOKENS)
    for bad in (lambda: ChainSpec(100000), lambda: ChainSpec(0), lambda: NgramSpec(100000),
                lambda: NgramSpec(-1), lambda: NgramSpec(0), lambda: TreeSpec(MAX_DRAFT_LENGTH + 1, 2, 10),
                lambda: TreeSpec(3, 2, MAX_TREE_TOKENS + 1), lambda: TreeSpec(3, 0, 10),
                lambda: TreeSpec.parse("3,2"), lambda: NgramSpec(3, max_ngram=1, min_ngram=2)):
        with pytest.raises(UsageError):
            bad()
    with pytest.raises(UsageError, match=f"at most {MAX_DRAFT_LENGTH}"):
        ChainSpec(100000)


def test_tree_top_k_beyond_the_draft_vocabulary_refused():
    """Issue 19.6: top-k above the drafter's draft vocabulary was `selected index k out of range` mid-decode."""
    from draftsmith.core.errors import UsageError

    target = tiny_target("llama", num_hidden_layers=LAYERS)
    drafter = new_drafter(target, seed=1, draft_vocab_size=40)
    SpeculativeDecoder(target, drafter, TreeSpec(3, 40, 10)).generate([5, 6, 7], 3)  # the whole vocab is fine
    with pytest.raises(UsageError, match="draft vocabulary"):
        SpeculativeDecoder(target, drafter, TreeSpec(3, 41, 10))


def test_max_new_tokens_must_be_positive():
    from draftsmith.core.errors import UsageError

    target = tiny_target("llama", num_hidden_layers=LAYERS)
    for decoder in (SpeculativeDecoder(target), SpeculativeDecoder(target, None, NgramSpec(2))):
        with pytest.raises(UsageError, match="max_new_tokens must be >= 1"):
            decoder.generate([5, 6, 7], 0)
