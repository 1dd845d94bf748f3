"""Drafting at inference computes what training computes: positions pinned to explicit-position drafting, and the
draft-to-target id mapping (d2t) applied where the tree drafts.

An off-by-one draft position moves tau by under 0.1 on the tiny models, and greedy decoding stays lossless with any
drafter, so neither shows in tau floors or output equality: every drafter step is compared with a drafting written
out with explicit positions instead (the one ``test_ttt_unroll_equals_inference_drafting`` equates with the TTT
unroll of training: the drafted token i+1 after the target's token at position t is fed at position t+i).
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_target
from test_decode import LAYERS, fitted, references

from draftsmith.core import vocab as vocab_mod
from draftsmith.model.drafter import Eagle3Drafter, KVCache, new_drafter
from draftsmith.stages.decode import ChainSpec, SpeculativeDecoder, TreeSpec


def _record_calls(drafter: Eagle3Drafter) -> tuple[list, object]:
    calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def hook(module, args, output):
        g, input_ids, position_ids = args[:3]
        calls.append((g.detach().clone(), input_ids.clone(), position_ids.clone(), output.detach().clone()))

    return calls, drafter.register_forward_hook(hook)


def _explicit(drafter: Eagle3Drafter, feats, seq: list[int], length: int, path: list[int]) -> torch.Tensor:
    """The drafter's output after ``path``, drafted by hand: the target's features of positions 0..length-1 with
    the tokens that follow them at positions 0..length-1, then path[i] fed at position length + i."""
    cache = KVCache()
    g = drafter.fuse(tuple(a[:, :length] for a in feats))
    h = drafter(g, torch.tensor([seq[1: length + 1]]), torch.arange(length)[None], cache)[:, -1:]
    for i, tok in enumerate(path):
        h = drafter(h, torch.tensor([[tok]]), torch.tensor([[length + i]]), cache)
    return h[0, -1]


@pytest.mark.parametrize("spec", [ChainSpec(4), TreeSpec(depth=4, top_k=3, total_tokens=12)], ids=["chain", "tree"])
def test_draft_positions_match_explicit_position_drafting(spec):
    """Each drafter call of each round, node by node, equals explicit-position drafting of that node's path."""
    target = tiny_target("llama", num_hidden_layers=LAYERS)
    drafter = fitted("llama")  # accepts several tokens a round: rounds start at varied lengths
    prompts, _ = references("llama")
    calls_per_round = spec.k if isinstance(spec, ChainSpec) else spec.depth
    checked = 0
    for prompt in prompts[:3]:
        calls, handle = _record_calls(drafter)
        try:
            result = SpeculativeDecoder(target, drafter, spec).generate(prompt, 12)
        finally:
            handle.remove()
        seq = prompt + result.token_ids
        with torch.no_grad():
            feats = target(torch.tensor([seq])).aux_hidden_states
        length = len(prompt)
        assert len(calls) == calls_per_round * len(result.accepted_per_step)
        for r, accepted in enumerate(result.accepted_per_step):
            rnd = calls[r * calls_per_round: (r + 1) * calls_per_round]
            _, ids, pos, out = rnd[0]  # the round's first call: the target's features since the last round
            n = ids.shape[1]
            assert ids[0].tolist() == seq[length - n + 1: length + 1]
            assert pos[0].tolist() == list(range(length - n, length))
            paths = {0: []}  # row of the previous call's output -> the draft path it ends
            prev_out = out[:, -1:]
            with torch.no_grad():
                torch.testing.assert_close(out[0, -1], _explicit(drafter, feats, seq, length, []), atol=1e-7, rtol=0)
                for g, ids, _, out in rnd[1:]:
                    new_paths = {}
                    for i, tok in enumerate(ids[0].tolist()):
                        parent = next(j for j in paths if torch.equal(g[0, i], prev_out[0, j]))
                        path = [*paths[parent], tok]
                        torch.testing.assert_close(out[0, i], _explicit(drafter, feats, seq, length, path),
                                                   atol=1e-7, rtol=0, msg=f"round {r}, path {path}")
                        new_paths[i] = path
                        checked += 1
                    paths, prev_out = new_paths, out
            length += accepted + 1
    assert checked >= 20


def _cut_to(drafter: Eagle3Drafter, keep: torch.Tensor) -> Eagle3Drafter:
    """The same drafter with its head cut to the target ids ``keep`` (a reduced draft vocabulary, d2t != 0)."""
    target = tiny_target("llama", num_hidden_layers=LAYERS)
    dv = vocab_mod.from_target_ids(keep, target.vocab_size)
    cut = new_drafter(target, draft_vocab=dv)
    state = drafter.state_dict()
    state["lm_head.weight"], state["d2t"], state["t2d"] = state["lm_head.weight"][dv.t2d], dv.d2t, dv.t2d
    cut.load_state_dict(state)
    return cut


@pytest.mark.parametrize("spec", [ChainSpec(4), TreeSpec(depth=4, top_k=3, total_tokens=12)], ids=["chain", "tree"])
def test_reduced_draft_vocabulary_keeps_the_fitted_drafters_tau(spec):
    """A fitted drafter cut to 240 draft ids (d2t = 16 everywhere) drafts the same target tokens: tau stays near
    the full vocabulary's (about 3.7 on the tree) and output stays the plain greedy one. Drafted ids used as target
    ids, without d2t, accept next to nothing (tau about 1.0)."""
    target = tiny_target("llama", num_hidden_layers=LAYERS)
    prompts, refs = references("llama")
    cut = _cut_to(fitted("llama"), torch.arange(16, target.vocab_size))
    assert bool((cut.d2t == 16).all())
    decoder = SpeculativeDecoder(target, cut, spec)
    results = [decoder.generate(p, 16) for p in prompts[:20]]
    for r, ref in zip(results, refs[:20], strict=True):
        assert r.token_ids == ref
    tau = sum(r.acceptance_length for r in results) / len(results)
    assert tau > 2.5, tau
