"""The block drafters' training objective (DFlash, DSpark): many random anchors per sample in one pass.

A block anchored at position ``a`` holds the anchor token ``x[a]`` and ``block_size - 1`` mask tokens at positions
``a .. a+B-1``. Its queries see the target's features of the context strictly before the anchor (at inference
the anchor is the bonus token, which has not been through the target yet) and every slot of their own block,
non-causally; nothing of other blocks. Slot ``k`` predicts ``x[a+k+1]`` (next-token slots, DSpark) or ``x[a+k]``
(mask-fill slots, DFlash; the anchor's slot predicts nothing), and its teacher is the target's distribution at
the position before its label. Facts and sources: notes/block-training.md.

Attention is computed on the blocks' own query rows only: one masked pass of the CPU flash kernel per sequence
over its context (each block's ``B`` query rows see the keys before its anchor), and each block's ``B x B``
scores over its own keys, merged with it by log-sum-exp as the EAGLE-3 objective merges its diagonal keys
(model/ttt.py). No ``[N*B, T + N*B]`` mask is ever built, and no row without a query is computed.

Loss (DeepSpec's): ``ce_weight * CE(target's choice) + l1_weight * ||p_draft - p_target||_1
+ confidence_weight * BCE(confidence, 1 - TV)``, each a mean weighted by ``exp(-j / gamma)`` for the ``j``-th
drafted slot, over the slots whose label and every earlier label are answer tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draftsmith.model.drafter import rotate_half
from draftsmith.model.ttt import _CPU_FLASH, TTTBatch, TTTStats


@dataclass(frozen=True)
class BlockSpec:
    """What the objective needs to know of the kind and the run."""

    block_size: int
    next_token: bool  # slot k predicts x[a+k+1] (DSpark); else x[a+k] and the anchor's slot predicts nothing
    num_anchors: int = 512
    gamma: float = 4.0
    ce_weight: float = 1.0
    l1_weight: float = 0.0
    confidence_weight: float = 0.0

    @property
    def first_slot(self) -> int:
        """The first slot that predicts a token."""
        return 0 if self.next_token else 1

    @property
    def drafted(self) -> int:
        """Tokens a block drafts: its per-position statistics have this length."""
        return self.block_size - self.first_slot


# --- anchors and labels ------------------------------------------------------------------------------------
def sample_anchors(answer: torch.Tensor, lengths: torch.Tensor, num_anchors: int,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``num_anchors`` distinct random anchors per row, as flat CPU ``(rows, anchors)`` sorted by row, anchor.

    A candidate ``a`` is an answer token followed by an answer token (the block's first label trains), with
    ``1 <= a <= length - 2``: a block needs context before it. Drawn on the CPU from ``generator`` (None: the
    global RNG, which a checkpoint restores, so a resumed run draws what the straight run drew).
    """
    answer = answer.cpu()
    b, t = answer.shape
    pos = torch.arange(t)[None]
    nxt = torch.zeros_like(answer)
    nxt[:, :-1] = answer[:, 1:]
    cand = answer & nxt & (pos >= 1) & (pos <= lengths.cpu()[:, None] - 2)
    scores = torch.rand(b, t, generator=generator)
    scores = scores.masked_fill(~cand, 2.0)
    order = scores.argsort(dim=1, stable=True)
    rank = order.argsort(dim=1)  # the rank of each position among its row's random scores
    chosen = cand & (rank < num_anchors)
    return chosen.nonzero(as_tuple=True)  # row-major: sorted by row, then position (on the CPU)


def block_labels(spec: BlockSpec, answer: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor,
                 anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Label positions ``[M, D]`` of the drafted slots and which of them are scored.

    A slot is scored when its label and every earlier label of the block lie inside the sample and are answer
    tokens (acceptance is a prefix: a slot after an unscored one could never be accepted in its place).
    """
    offsets = torch.arange(spec.first_slot, spec.block_size, device=anchors.device) + (1 if spec.next_token else 0)
    labels = anchors[:, None] + offsets[None]
    inside = labels < lengths[rows][:, None]
    safe = labels.clamp_max(answer.shape[1] - 1)
    scored = inside & answer[rows[:, None], safe]
    return safe, scored.int().cumprod(dim=1).bool()


# --- the drafter on many blocks ------------------------------------------------------------------------------
def block_attention(q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor, k_ctx: torch.Tensor,
                    v_ctx: torch.Tensor, rows: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Each block's queries over the context before its anchor and over its own block, non-causally.

    ``q`` ``[M, H, S, D]``, ``k_blk``/``v_blk`` ``[M, KV, S, D]``, ``k_ctx``/``v_ctx`` ``[b, KV, T, D]``;
    returns ``[M, H, S, D]``. The blocks of a row are laid side by side as that row's ``n*S`` query rows (``n``:
    the most blocks of any row; a row's unused places are padding anchored at 1, whose outputs are dropped):
    one flash pass per row over its context with the mask "key before this block's anchor", and each block's
    ``S x S`` scores over its own keys, merged by log-sum-exp (``_BlockFlashAttention``).
    """
    m, n_heads, s, d = q.shape
    b, kv = k_ctx.shape[:2]
    order = torch.argsort(rows, stable=True)
    counts = torch.bincount(rows, minlength=b)
    first = torch.cumsum(counts, 0) - counts
    col = torch.empty_like(rows)
    col[order] = torch.arange(m, device=rows.device) - first[rows[order]]  # each block's place in its row
    n = int(counts.max())
    at = (rows, col)

    def pad(x: torch.Tensor) -> torch.Tensor:  # [M, heads, S, D] -> [b, heads, n, S, D]
        return x.new_zeros(b, n, *x.shape[1:]).index_put(at, x).transpose(1, 2)

    starts = torch.ones(b, n, dtype=anchors.dtype, device=anchors.device).index_put(at, anchors)
    mask = torch.arange(k_ctx.shape[2], device=q.device)[None, None, :] < starts[..., None]  # [b, n, T]
    mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    mask = mask[:, None, :, None].expand(b, 1, n, s, mask.shape[-1]).reshape(b, 1, n * s, -1)
    if q.device.type == "cpu" and _CPU_FLASH is not None:
        out = _BlockFlashAttention.apply(pad(q), k_ctx, v_ctx, pad(k_blk), pad(v_blk), mask)
    else:
        out = _block_attention_plain(pad(q), k_ctx, v_ctx, pad(k_blk), pad(v_blk), mask)
    return out.transpose(1, 2)[at]


def _block_attention_plain(q, k_ctx, v_ctx, k_blk, v_blk, mask):
    """``_BlockFlashAttention`` in plain ops (devices without the CPU flash kernel)."""
    b, h, n, s, d = q.shape
    rep = h // k_ctx.shape[1]
    kc, vc = k_ctx.repeat_interleave(rep, 1), v_ctx.repeat_interleave(rep, 1)
    kb, vb = k_blk.repeat_interleave(rep, 1), v_blk.repeat_interleave(rep, 1)
    scale = d ** -0.5
    ctx = (q.reshape(b, h, n * s, d) @ kc.transpose(-1, -2)) * scale + mask  # [b, h, n*S, T]
    own = (q @ kb.transpose(-1, -2)) * scale  # [b, h, n, S, S]
    acc = torch.promote_types(q.dtype, torch.float32)
    probs = torch.cat([ctx.view(b, h, n, s, -1), own], dim=-1).to(acc).softmax(-1).to(q.dtype)
    t = kc.shape[2]
    out = (probs[..., :t].reshape(b, h, n * s, t) @ vc).view(b, h, n, s, d)
    return out + probs[..., t:] @ vb


class _BlockFlashAttention(torch.autograd.Function):
    """The context part in the CPU flash kernel (masked), each block's own keys merged through its log-sum-exp.

    As ``model/ttt.py``'s ``_FlashTTTAttention``: backward hands the kernel the merged output and log-sum-exp,
    so its context gradients are normalised over all keys; the in-block gradients are ``S x S`` per block.
    Shapes: ``q`` ``[b, H, n, S, D]``, ``k_ctx``/``v_ctx`` ``[b, KV, T, D]``, ``k_blk``/``v_blk``
    ``[b, KV, n, S, D]``, ``mask`` ``[b, 1, n*S, T]`` additive (0 or -inf) in ``q``'s dtype.
    """

    @staticmethod
    def forward(ctx, q, k_ctx, v_ctx, k_blk, v_blk, mask):
        b, h, n, s, d = q.shape
        rep = h // k_ctx.shape[1]
        scale = d ** -0.5
        with torch.autocast("cpu", enabled=False):
            kc, vc, kb, vb = (x.to(q.dtype).repeat_interleave(rep, 1) for x in (k_ctx, v_ctx, k_blk, v_blk))
            out, lse = _CPU_FLASH[0](q.reshape(b, h, n * s, d), kc, vc, 0.0, False, attn_mask=mask, scale=scale)
            acc = lse.dtype  # float32 (float64 for float64 inputs)
            own = (q.to(acc) @ kb.to(acc).transpose(-1, -2)) * scale  # [b, h, n, S, S]
            lse = lse.view(b, h, n, s)
            merged = torch.logaddexp(lse, own.logsumexp(-1))
            o = out.view(b, h, n, s, d).to(acc) * (lse - merged).exp()[..., None]
            o = o + (own - merged[..., None]).exp() @ vb.to(acc)
            out = o.to(q.dtype)
        ctx.save_for_backward(q, out, merged, kc, vc, kb, vb, mask)
        ctx.rep, ctx.scale = rep, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, out, lse, kc, vc, kb, vb, mask = ctx.saved_tensors
        b, h, n, s, d = q.shape
        rep, scale = ctx.rep, ctx.scale
        with torch.autocast("cpu", enabled=False):
            grad = grad.to(q.dtype).contiguous()
            dq, dkc, dvc = _CPU_FLASH[1](grad.view(b, h, n * s, d), q.reshape(b, h, n * s, d), kc, vc,
                                         out.view(b, h, n * s, d), lse.reshape(b, h, n * s), 0.0, False,
                                         attn_mask=mask, scale=scale)
            acc = lse.dtype
            g, qa, ka, va = grad.to(acc), q.to(acc), kb.to(acc), vb.to(acc)
            delta = (g * out.to(acc)).sum(-1)  # [b, h, n, S]
            p = ((qa @ ka.transpose(-1, -2)) * scale - lse[..., None]).exp()  # [b, h, n, S, S]
            ds = p * (g @ va.transpose(-1, -2) - delta[..., None])
            dq = dq.view(b, h, n, s, d).to(acc) + scale * (ds @ ka)
            dkb = scale * (ds.transpose(-1, -2) @ qa)
            dvb = p.transpose(-1, -2) @ g

        def fold(x: torch.Tensor) -> torch.Tensor:  # repeated heads' gradients summed onto their kv head
            return x.to(acc).view(x.shape[0], h // rep, rep, *x.shape[2:]).sum(2).to(q.dtype)

        return dq.to(q.dtype), fold(dkc), fold(dvc), fold(dkb), fold(dvb), None


def _queries(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The block's rotated queries ``[M, H, S, D]``, as the drafter's attention computes them."""
    m, s, _ = x.shape
    q = attn.q_norm(attn.q_proj(x).view(m, s, attn.n_heads, attn.head_dim)).transpose(1, 2)
    return q * cos + rotate_half(q) * sin


def block_hidden(drafter, batch: TTTBatch, rows: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """The drafter's final (normed) states ``[M, K, h]`` of every block's drafts, all layers, in one pass.

    Draft ``j`` of a block predicts position ``anchor + 1 + j`` in both slot conventions (the fill-in
    convention's anchor slot, which predicts nothing, is dropped), as ``BlockDrafter.forward_train`` returns it.
    """
    cfg = drafter.config
    s, first = cfg.block_size, 0 if cfg.sample_from_anchor else 1
    ctx = drafter.context(batch.aux_hidden_states)  # [b, T, h]
    b, t = ctx.shape[:2]
    ids = torch.full((anchors.numel(), s), int(cfg.mask_token_id), dtype=torch.long, device=anchors.device)
    ids[:, 0] = batch.input_ids[rows, anchors]
    x = drafter.embed(ids)
    cos, sin = drafter.rope(anchors[:, None] + torch.arange(s, device=anchors.device)[None])
    ctx_cos, ctx_sin = drafter.rope(torch.arange(t, device=ctx.device)[None].expand(b, t))
    for layer in drafter.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        k_blk, v_blk = attn.kv(h, cos, sin)
        k_ctx, v_ctx = attn.kv(ctx, ctx_cos, ctx_sin)
        out = block_attention(_queries(attn, h, cos, sin), k_blk, v_blk, k_ctx, v_ctx, rows, anchors)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x)[:, first:first + cfg.num_drafts]


# --- the loss -------------------------------------------------------------------------------------------------
def _weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (values * weights).sum() / weights.sum().clamp_min(1e-6)


def block_objective(drafter, batch: TTTBatch, teacher, spec: BlockSpec,
                    generator: torch.Generator | None = None) -> tuple[torch.Tensor, TTTStats]:
    """The weighted block loss and per-slot acceptance counts of one batch.

    ``teacher`` is ``teacher_targets``' tuple (probabilities over the draft vocabulary, the target's choice as a
    draft id, whether that choice is in the draft vocabulary), indexed at the position before each label.
    Statistics: ``correct[k]`` counts blocks whose first ``k+1`` greedy drafts (the Markov head fed the drafts
    themselves, as at inference) equal the target's choices; ``total[k]`` those whose first ``k`` did, with
    slot ``k`` scored. ``acc_k = correct/total`` is the acceptance at slot ``k`` given the earlier slots'.
    """
    probs, choice, in_draft = teacher
    valid = torch.arange(batch.input_ids.shape[1], device=batch.input_ids.device)[None] < batch.lengths[:, None]
    answer = batch.loss_mask & valid
    rows, anchors = sample_anchors(answer, batch.lengths, spec.num_anchors, generator)
    rows, anchors = rows.to(batch.input_ids.device), anchors.to(batch.input_ids.device)
    stats = TTTStats(correct=[0.0] * spec.drafted, total=[0.0] * spec.drafted)
    if rows.numel() == 0:  # no answer to anchor on: a zero loss that still gives every parameter a gradient,
        # so that ranks reducing gradients under torchrun reduce the same tensors
        zero = sum(p.sum() for p in drafter.parameters() if p.requires_grad) * 0.0
        return zero, stats
    labels, scored = block_labels(spec, answer, batch.lengths, rows, anchors)
    hidden = block_hidden(drafter, batch, rows, anchors)  # [M, K, h]
    before = labels - 1  # the teacher of label p is the target at p - 1
    prev = batch.input_ids[rows[:, None], before]  # the token before each label (teacher-forced Markov input)
    base = drafter.logits(hidden).float()
    markov = getattr(drafter, "markov_head", None)
    embedded = markov.embed(prev) if markov is not None else None  # one lookup for the Markov and confidence heads
    logits = base + markov.block(prev, hidden, embedded).float() if markov is not None else base
    t_probs, t_choice = probs[rows[:, None], before], choice[rows[:, None], before]
    t_in = in_draft[rows[:, None], before]
    decay = torch.exp(-torch.arange(spec.drafted, device=logits.device, dtype=torch.float32) / spec.gamma)
    w = decay[None].expand_as(scored) * scored
    logp = logits.log_softmax(-1)
    total = logits.new_zeros(())
    if spec.ce_weight:
        ce = -logp.gather(-1, t_choice[..., None]).squeeze(-1)
        total = total + spec.ce_weight * _weighted_mean(ce.masked_fill(~t_in, 0.0), w * t_in)
    l1 = (logp.exp() - t_probs.float()).abs().sum(-1)
    if spec.l1_weight:
        total = total + spec.l1_weight * _weighted_mean(l1, w)
    conf = drafter.confidence_logits(hidden, prev, embedded) if spec.confidence_weight else None
    if conf is not None:
        accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()  # sum_v min(p_v, q_v): the slot's acceptance
        bce = F.binary_cross_entropy_with_logits(conf.float(), accept, reduction="none")
        total = total + spec.confidence_weight * _weighted_mean(bce, w)
    with torch.no_grad():
        drafts = base.argmax(-1) if markov is None else greedy_drafts(drafter, base, hidden, prev[:, 0], t_choice)
        hit = (drafts == t_choice) & t_in & scored
        through = hit.int().cumprod(dim=1).bool()  # the first k+1 drafts all accepted
        reached = torch.cat([torch.ones_like(through[:, :1]), through[:, :-1]], dim=1) & scored
        stats.correct = through.sum(0).double().tolist()
        stats.total = reached.sum(0).double().tolist()
    stats.loss = float(total.detach())
    return total, stats


@torch.no_grad()
def greedy_drafts(drafter, base: torch.Tensor, hidden: torch.Tensor, first_prev: torch.Tensor,
                  choice: torch.Tensor) -> torch.Tensor:
    """Greedy drafts ``[M, D]`` (draft ids), the Markov bias fed each previous draft, wherever every earlier draft
    was the target's choice (``choice``, draft ids): the only drafts the acceptance counts read.

    There the previous draft *is* the target's choice, so every slot's Markov input is known up front and one
    batched pass replaces ``D`` sequential ones; after a miss the drafts differ from decoding's and are unread.
    """
    prev = torch.cat([first_prev[:, None], drafter.to_target_ids(choice[:, :-1])], dim=1)
    return (base + drafter.markov_head.block(prev, hidden).float()).argmax(-1)


@dataclass(frozen=True)
class BlockObjective:
    """The trainer's view of a block kind: ``objective(drafter, batch, teacher, generator) -> (loss, stats)``."""

    spec: BlockSpec

    @property
    def positions(self) -> int:
        return self.spec.drafted

    def __call__(self, drafter, batch: TTTBatch, teacher, generator: torch.Generator | None = None):
        return block_objective(drafter, batch, teacher, self.spec, generator)
