"""The core promise: speculative output equals plain greedy decoding, and sampling keeps the target's law."""

from __future__ import annotations

import functools
import itertools

import pytest
from conftest import fit_drafter, load_json, random_prompts, save_json, shared_drafter, shared_result, tiny_target

from draftsmith.model.drafter import new_drafter
from draftsmith.stages.decode import (
    ChainSpec,
    NgramSpec,
    SamplingParams,
    SpeculativeDecoder,
    TreeSpec,
    ngram_propose,
)

LOSSLESS_ARCHS = ["llama", "qwen2", "deepseek_v3"]
LAYERS = 4  # the decoder logic does not depend on depth; 4 layers keep 50-prompt sweeps quick
N_PROMPTS = 50  # the references, and the fitted drafter's data
NEW_TOKENS = 16
# The greedy sweep: a fitted drafter decodes SWEEP prompts with each of SPECS, and REJECT_SWEEP with EXTRA_SPECS; a
# random one (the reject path: it accepts next to nothing, so more prompts repeat one path) REJECT_SWEEP with every
# spec. Planted faults (the target cache keeping nodes off the path or dropping the last, a causal tree mask, tree
# positions by index instead of depth) fail every fitted arch at 32 prompts; at 24 one arch passed the positions fault.
SWEEP = 32
REJECT_SWEEP = 5
SPECS = [ChainSpec(4), TreeSpec(depth=4, top_k=3, total_tokens=12)]
EXTRA_SPECS = [ChainSpec(1), TreeSpec(3, 2, 6)]


@functools.cache
def references(arch: str):
    """50 random prompts and the target's plain greedy continuations (test_hybrid and test_draft_positions use
    them too: built once for the run, conftest.shared_result)."""
    def build():
        target = tiny_target(arch, num_hidden_layers=LAYERS)
        prompts = random_prompts(N_PROMPTS, seed=99)
        plain = SpeculativeDecoder(target)
        return prompts, [plain.generate(p, NEW_TOKENS).token_ids for p in prompts]

    prompts, refs = shared_result(f"references-{arch}.json", build, save_json, load_json)
    return prompts, refs


@functools.cache
def fitted(arch: str):
    """A drafter fitted to ``references``, built once for the run (conftest.shared_drafter)."""
    target = tiny_target(arch, num_hidden_layers=LAYERS)
    prompts, refs = references(arch)
    return shared_drafter(f"fitted-{arch}.safetensors", target,
                          lambda: fit_drafter(target, [p + r for p, r in zip(prompts, refs, strict=True)], steps=60))


@pytest.mark.parametrize("arch", LOSSLESS_ARCHS)
@pytest.mark.parametrize("drafter_kind", ["random", "fitted"])
def test_greedy_speculative_equals_plain(arch, drafter_kind):
    target = tiny_target(arch, num_hidden_layers=LAYERS)
    prompts, refs = references(arch)
    drafter = new_drafter(target, seed=1) if drafter_kind == "random" else fitted(arch)
    taus = {}
    for spec in SPECS + EXTRA_SPECS:
        # An untrained drafter accepts next to nothing: more prompts repeat one path (draft, reject, bonus).
        n = SWEEP if spec in SPECS and drafter_kind == "fitted" else REJECT_SWEEP
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


# Sampling (the accept step, top-k/top-p, the end-to-end law): tests/test_sampling_law.py.


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
