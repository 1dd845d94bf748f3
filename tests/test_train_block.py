"""Block drafters' training (DFlash, DSpark): anchors, the block-sparse attention, the loss, the trainer."""

from __future__ import annotations

import pytest
import torch

from draftsmith.stages.train.block import BlockSpec, block_attention, block_labels, sample_anchors


def _dense_block_attention(q, k_blk, v_blk, k_ctx, v_ctx, rows, anchors):
    """Each block on its own, written plainly: keys = the context before the anchor, then the block's own."""
    rep = q.shape[1] // k_ctx.shape[1]
    out = []
    for m in range(q.shape[0]):
        r, a = int(rows[m]), int(anchors[m])
        k = torch.cat([k_ctx[r, :, :a], k_blk[m]], dim=1).repeat_interleave(rep, 0)
        v = torch.cat([v_ctx[r, :, :a], v_blk[m]], dim=1).repeat_interleave(rep, 0)
        scores = q[m] @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        out.append(scores.softmax(-1) @ v)
    return torch.stack(out)


def test_block_attention_sees_the_context_before_its_anchor_and_its_own_block():
    """The flash-kernel layout equals a dense per-block attention, values and gradients, grouped K/V heads,
    several blocks per row (one of them anchored at 1: one context key)."""
    g = torch.Generator().manual_seed(0)
    b, t, kv, heads, bs, d = 2, 13, 2, 4, 3, 8
    rows, anchors = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([1, 5, 11, 3, 9])
    m = rows.numel()
    q = torch.randn(m, heads, bs, d, generator=g, requires_grad=True)
    k_blk, v_blk = (torch.randn(m, kv, bs, d, generator=g, requires_grad=True) for _ in range(2))
    k_ctx, v_ctx = (torch.randn(b, kv, t, d, generator=g, requires_grad=True) for _ in range(2))
    inputs = [q, k_blk, v_blk, k_ctx, v_ctx]
    fast = block_attention(*inputs, rows, anchors)
    ref = _dense_block_attention(*inputs, rows, anchors)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
    up = torch.randn(fast.shape, generator=g)
    for a, r in zip(torch.autograd.grad(fast, inputs, up), torch.autograd.grad(ref, inputs, up), strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)
    # A context key at or after the anchor changes nothing: only keys before it are seen.
    k2 = k_ctx.detach().clone()
    k2[0, :, 5:] += 100.0
    again = block_attention(q, k_blk, v_blk, k2, v_ctx, rows, anchors)
    torch.testing.assert_close(again[:2], fast[:2])  # the blocks anchored at 1 and 5 of row 0
    assert not torch.allclose(again[2], fast[2])  # the block anchored at 11 sees keys 5..10


def test_anchors_are_distinct_answer_positions_with_a_scored_first_label():
    answer = torch.zeros(3, 12, dtype=torch.bool)
    answer[0, 4:] = True  # answer tokens 4..11, length 12: candidates 4..10
    answer[1, 2:6] = True  # length 8: 2..6 answer tokens... candidates with a next answer: 2..4
    answer[2, 0:2] = True  # a 1-token context: candidate 1 needs answer[2] (False): none
    lengths = torch.tensor([12, 8, 12])
    rows, anchors = sample_anchors(answer, lengths, num_anchors=100)
    got = {(int(r), int(a)) for r, a in zip(rows, anchors, strict=True)}
    assert got == {(0, a) for a in range(4, 11)} | {(1, a) for a in range(2, 5)}
    assert rows.tolist() == sorted(rows.tolist())
    # A cap draws that many, at random, distinct, and the same from the same generator.
    r1, a1 = sample_anchors(answer, lengths, 3, torch.Generator().manual_seed(1))
    r2, a2 = sample_anchors(answer, lengths, 3, torch.Generator().manual_seed(1))
    assert torch.equal(a1, a2) and torch.equal(r1, r2)
    assert r1.tolist() == [0, 0, 0, 1, 1, 1] and len(set(zip(r1.tolist(), a1.tolist(), strict=True))) == 6
    draws = {tuple(sample_anchors(answer, lengths, 3, torch.Generator().manual_seed(s))[1][:3].tolist())
             for s in range(20)}
    assert len(draws) > 5


@pytest.mark.parametrize("next_token", [True, False])
def test_labels_are_the_slots_tokens_and_scoring_stops_at_the_first_unscored_label(next_token):
    spec = BlockSpec(block_size=4, next_token=next_token)
    answer = torch.ones(1, 10, dtype=torch.bool)
    answer[0, 7] = False  # a prompt token inside (a second user turn)
    labels, scored = block_labels(spec, answer, torch.tensor([9]), torch.tensor([0, 0]), torch.tensor([2, 5]))
    if next_token:  # slot k predicts x[a+k+1]: 4 drafts
        assert labels.tolist() == [[3, 4, 5, 6], [6, 7, 8, 9]]
        assert scored.tolist() == [[True] * 4, [True, False, False, False]]
    else:  # slot k predicts x[a+k], the anchor's slot nothing: 3 drafts
        assert labels.tolist() == [[3, 4, 5], [6, 7, 8]]
        assert scored.tolist() == [[True] * 3, [True, False, False]]
    assert spec.drafted == (4 if next_token else 3)
