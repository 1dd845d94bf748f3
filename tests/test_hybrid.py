"""The hybrid proposer: prompt-lookup branches grafted onto the EAGLE-3 draft tree stay lossless."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from conftest import tiny_target
from test_decode import LAYERS, LOSSLESS_ARCHS, fitted, references
from test_sampling_law import ALPHA, DRAWS, MIN_CELLS, V, exact_joint, flat_target, law_pvalues

from draftsmith.core.errors import UsageError
from draftsmith.model.drafter import new_drafter
from draftsmith.stages import decode
from draftsmith.stages.decode import (
    HybridSpec,
    NgramSpec,
    SamplingParams,
    SpeculativeDecoder,
    TreeSpec,
    _graft,
    _Tree,
)

HYBRID = HybridSpec(TreeSpec(depth=4, top_k=3, total_tokens=12), NgramSpec(k=3))
#: The same tree grafting lookup only where two or more tokens recur.
HYBRID_MIN2 = HybridSpec(HYBRID.tree, NgramSpec(k=3, min_ngram=2))
NEW_TOKENS = 16
#: Prompts per set (test_decode's random ones, and the same repeating their own answer). The sweep catches the graft
#: faults it caught at 20 (a lookup node's position, a missed merge) within these 12; a wrong parent is caught node by
#: node in test_grafted_nodes_verify_like_a_plain_forward, at either count.
N_PROMPTS = 12


@functools.cache
def repetitive(arch: str):
    """Prompts that repeat their own greedy continuation (prompt, answer, prompt again): lookup hits often."""
    prompts, refs = references(arch)
    reps = [p + r + p for p, r in zip(prompts[:N_PROMPTS], refs[:N_PROMPTS], strict=True)]
    plain = SpeculativeDecoder(tiny_target(arch, num_hidden_layers=LAYERS))
    return reps, [plain.generate(p, NEW_TOKENS).token_ids for p in reps]


@pytest.fixture
def merges(monkeypatch):
    """Counts lookup tokens that landed on a node the drafter had already proposed."""
    count = [0]

    def spy(tree, chain):
        out = _graft(tree, chain)
        count[0] += len(chain) - len(out.lookup_only)
        return out

    monkeypatch.setattr(decode, "_graft", spy)
    return count


@pytest.mark.parametrize("arch", LOSSLESS_ARCHS)
@pytest.mark.parametrize("drafter_kind", ["random", "fitted", "fitted, lookup n>=2"])
def test_hybrid_greedy_equals_plain(arch, drafter_kind, merges):
    target = tiny_target(arch, num_hidden_layers=LAYERS)
    drafter = new_drafter(target, seed=1) if drafter_kind == "random" else fitted(arch)
    decoder = SpeculativeDecoder(target, drafter, HYBRID_MIN2 if "n>=2" in drafter_kind else HYBRID)
    lookup = {}
    for name, (prompts, refs) in {"random": references(arch), "repetitive": repetitive(arch)}.items():
        lookup[name] = 0
        for i, (p, ref) in enumerate(zip(prompts[:N_PROMPTS], refs[:N_PROMPTS], strict=True)):
            r = decoder.generate(p, NEW_TOKENS)
            assert r.token_ids == ref, f"{arch} {drafter_kind} {name} prompt {i} diverged"
            assert r.target_forward_passes == 1 + len(r.accepted_per_step)
            assert len(r.lookup_accepted_per_step) == len(r.accepted_per_step)
            assert all(0 <= lk <= a <= HYBRID.max_accepted
                       for lk, a in zip(r.lookup_accepted_per_step, r.accepted_per_step, strict=True))
            lookup[name] += sum(r.lookup_accepted_per_step)
    assert lookup["repetitive"] > 0, lookup  # tokens only lookup proposed were accepted
    if drafter_kind.startswith("fitted"):
        assert merges[0] > 0  # lookup chains shared a prefix with drafted nodes, and stayed exact


def test_graft_merges_a_shared_prefix_and_keeps_siblings_distinct():
    # root -> 5 (node 1) -> 7 (node 3); root -> 6 (node 2)
    tree = _Tree(tokens=[5, 6, 7], parents=[0, 0, 1], depths=[1, 1, 2], is_tree=True, scores=[-1.0, -2.0, -3.0])
    grafted = _graft(tree, [5, 8, 9])
    assert grafted.tokens == [5, 6, 7, 8, 9]
    assert grafted.parents == [0, 0, 1, 1, 4]
    assert grafted.depths == [1, 1, 2, 2, 3]
    assert grafted.lookup_only == {4, 5}
    assert _graft(tree, [5, 7]).tokens == tree.tokens  # wholly inside the tree: nothing new
    assert _graft(tree, []).tokens == tree.tokens
    siblings = [(p, t) for p, t in zip(grafted.parents, grafted.tokens, strict=True)]
    assert len(set(siblings)) == len(siblings)
    # Greedy acceptance follows the shared node into the lookup continuation: 5, 8, 9, then the bonus.
    logits = torch.full((6, 12), -1.0)
    for node, best in ((0, 5), (1, 8), (4, 9), (5, 11)):
        logits[node, best] = 1.0
    decoder = SpeculativeDecoder.__new__(SpeculativeDecoder)
    assert decoder._accept(grafted, logits, SamplingParams(), None) == ([1, 4, 5], 11)


@pytest.mark.parametrize("arch", LOSSLESS_ARCHS)
def test_grafted_nodes_verify_like_a_plain_forward(arch):
    """Positions and mask of grafted nodes: each node's logits equal a plain forward over its own path."""
    target = tiny_target(arch, num_hidden_layers=LAYERS)
    prompt, pending = [5, 9, 30, 41, 77, 12, 33, 90], 7
    tree = _Tree(tokens=[40, 50, 60], parents=[0, 0, 1], depths=[1, 1, 2], is_tree=True, scores=[-1.0, -2.0, -3.0])
    grafted = _graft(tree, [40, 41, 42, 43])  # shares node 1, then a lookup-only chain of three
    cache = target.new_cache()
    target(torch.tensor([prompt]), cache=cache)
    out = SpeculativeDecoder(target)._verify(grafted, pending, len(prompt), cache).logits[0]
    for node in range(1, len(grafted.tokens) + 1):
        path = []
        i = node
        while i:
            path.insert(0, grafted.tokens[i - 1])
            i = grafted.parents[i - 1]
        full = target(torch.tensor([prompt + [pending] + path])).logits[0, -1]
        torch.testing.assert_close(out[node], full, rtol=1e-6, atol=1e-6, msg=f"node {node} ({path})")


def test_hybrid_sampling_keeps_target_distribution():
    """End to end on a 12-token vocabulary, with prompt lookup hits on: the law of 3 tokens is the target's."""
    target = flat_target()
    params = SamplingParams(temperature=1.0)
    prompt = [3, 7, 5, 9, 2, 8, 4, 10, 6, 1, 11, 3, 7]  # every token recurs: lookup proposes after any pick
    exact = exact_joint(target, prompt, 3, params)
    decoder = SpeculativeDecoder(target, new_drafter(target, seed=2),
                                 HybridSpec(TreeSpec(depth=2, top_k=2, total_tokens=4), NgramSpec(k=2)))
    g = torch.Generator().manual_seed(123)
    counts = torch.zeros_like(exact)
    lookup = 0
    for _ in range(DRAWS):
        r = decoder.generate(prompt, 3, params, generator=g)
        toks = r.token_ids
        counts[(toks[0] * V + toks[1]) * V + toks[2]] += 1
        lookup += sum(r.lookup_accepted_per_step)
    assert lookup > DRAWS // 20  # the grafted nodes took part in the accept step
    for pair, (pvalue, cells) in law_pvalues(counts, exact).items():
        assert cells >= MIN_CELLS, (pair, cells)
        assert pvalue > ALPHA, (pair, pvalue)


def test_hybrid_spec_shape_and_errors():
    assert HYBRID.max_draft_tokens == 11 + 3 and HYBRID.max_accepted == 4
    assert HybridSpec(TreeSpec(2, 2, 4), NgramSpec(6)).max_accepted == 6
    assert HybridSpec.parse("4,3,12", 3) == HYBRID
    assert HybridSpec.parse("4,3,12", 3, 2) == HYBRID_MIN2 and HYBRID_MIN2.max_draft_tokens == HYBRID.max_draft_tokens
    with pytest.raises(UsageError, match="min_ngram"):
        HybridSpec.parse("4,3,12", 3, 0)
    with pytest.raises(UsageError, match="give --tree"):
        HybridSpec.parse(None, 3)
    target = tiny_target("llama", num_hidden_layers=LAYERS)
    with pytest.raises(UsageError, match="needs a drafter"):
        SpeculativeDecoder(target, None, HYBRID)
    drafter = new_drafter(target, seed=1, draft_vocab_size=40)
    with pytest.raises(UsageError, match="draft vocabulary"):
        SpeculativeDecoder(target, drafter, HybridSpec(TreeSpec(3, 41, 10)))


@pytest.fixture(scope="module")
def cli_dirs(tmp_path_factory):
    from draftsmith.model.target import load_target
    from draftsmith.testing.models import build_tiny_model
    from draftsmith.testing.tokenizer import make_tokenizer

    root = tmp_path_factory.mktemp("hybrid")
    tok = make_tokenizer("chatml")
    build_tiny_model("llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id, num_hidden_layers=4,
                     dtype=torch.float32).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    new_drafter(load_target(root / "model")).save(root / "drafter")
    (root / "one.jsonl").write_text(json.dumps({"prompt": "the cat sat on the mat, the cat sat on the"}) + "\n")
    return root


def test_cli_decode_and_bench_hybrid(cli_dirs, capsys, tmp_path):
    from draftsmith.cli import main

    args = ["decode", "--target", str(cli_dirs / "model"), "--prompt", "the cat sat on the mat, the cat sat on",
            "--max-new-tokens", "12", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, "--drafter", str(cli_dirs / "drafter"), "--tree", "3,2,6", "--hybrid", "4"]) == 0
    hybrid = json.loads(capsys.readouterr().out)
    assert hybrid["mode"] == "hybrid" and hybrid["token_ids"] == plain["token_ids"]
    assert len(hybrid["lookup_accepted_per_step"]) == len(hybrid["accepted_per_step"])
    assert main([*args, "--random-drafter", "--hybrid"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("draftsmith: error:") and "give --tree" in err

    out = tmp_path / "bench"
    assert main(["bench", "--target", str(cli_dirs / "model"), "--drafter", str(cli_dirs / "drafter"),
                 "--datasets", str(cli_dirs / "one.jsonl"), "--max-new-tokens", "8", "--tree", "3,2,6", "--hybrid",
                 "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    methods = json.loads((out / "bench.json").read_text())["results"][0]["methods"]
    assert "hybrid 3,2,6+lookup 3" in methods
    assert methods["hybrid 3,2,6+lookup 3"]["identical_to_plain"] == "1/1"
    # One hybrid per minimum n-gram asked for, named apart.
    assert main(["bench", "--target", str(cli_dirs / "model"), "--drafter", str(cli_dirs / "drafter"),
                 "--datasets", str(cli_dirs / "one.jsonl"), "--max-new-tokens", "8", "--tree", "3,2,6", "--hybrid",
                 "--hybrid-min-ngram", "1,2", "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    methods = json.loads((out / "bench.json").read_text())["results"][0]["methods"]
    assert {"hybrid 3,2,6+lookup 3", "hybrid 3,2,6+lookup 3 (n>=2)"} <= set(methods)
    assert methods["hybrid 3,2,6+lookup 3 (n>=2)"]["identical_to_plain"] == "1/1"
