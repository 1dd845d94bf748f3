"""The block proposer: one DFlash/DSpark pass drafts k tokens, which the decoder verifies as a chain.

Per round the target states of the positions verified last round (the previous pending token and the drafts it
accepted) enter the drafter's context cache, and one block ``[pending, mask, ...]`` at the pending token's
position is filled. DFlash picks each draft from its own slot; DSpark goes left to right adding the Markov bias of
the token drafted before (the pending token for the first). At temperature > 0 each draft is sampled and its
proposal distribution q (the one it was actually sampled from, Markov bias included) is kept for the decoder's
rejection sampling, which is what keeps the output distribution the target's. Only verified positions ever enter
the drafter's cache, so nothing is rolled back after a partial acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.core.errors import UsageError
from draftsmith.model.block_drafter import MAX_BLOCK_SIZE, BlockCache, BlockDrafter, check_fits


@dataclass(frozen=True)
class SamplingLike:
    """What drafting reads of ``decode.SamplingParams`` (greedy unless a temperature is given)."""

    temperature: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class BlockSpec:
    """Drafts per block; None: all the drafter was trained to draft (``num_drafts``). ``kind`` names the drafter
    in reports (set by ``resolve_block_spec``)."""

    k: int | None = None
    kind: str = "block"

    def __post_init__(self):
        if self.k is not None and not 1 <= self.k <= MAX_BLOCK_SIZE:
            raise UsageError(f"a block drafts 1..{MAX_BLOCK_SIZE} tokens, got {self.k}")

    @property
    def max_draft_tokens(self) -> int:
        return self.k

    @property
    def max_accepted(self) -> int:
        return self.k + 1


def resolve_block_spec(drafter: BlockDrafter, target, spec: BlockSpec | None) -> BlockSpec:
    """The spec with k set, after checking the drafter fits the target and was trained for that many drafts."""
    check_fits(drafter.config, target)
    if tuple(target.aux_layers) != drafter.config.aux_layer_ids:
        target.set_aux_hidden_state_layers(drafter.config.aux_layer_ids)
    most = drafter.config.num_drafts
    k = most if spec is None or spec.k is None else spec.k
    if k > most:
        raise UsageError(f"this {drafter.kind} drafter drafts at most {most} tokens a block (block_size "
                         f"{drafter.config.block_size}), not {k}")
    return BlockSpec(k, drafter.kind)


def new_block_cache(drafter: BlockDrafter) -> BlockCache:
    return BlockCache(drafter.config.num_hidden_layers)


@torch.no_grad()
def propose_block(drafter: BlockDrafter, cache: BlockCache, feats, positions: torch.Tensor, pending: int, k: int,
                  sampling, generator: torch.Generator | None) -> tuple[list[int], list[torch.Tensor]]:
    """(k drafted target ids, their proposal distributions over the target vocabulary, empty when greedy).

    ``feats`` are the target's aux states of ``positions`` (the positions verified since the last call); the
    pending token sits at the next position.
    """
    drafter.extend_context(feats, positions, cache)
    return draft_block(drafter, cache, pending, int(positions[0, -1]) + 1, k, sampling, generator)


@torch.no_grad()
def draft_block(drafter: BlockDrafter, cache: BlockCache, pending: int, position: int, k: int, sampling,
                generator: torch.Generator | None) -> tuple[list[int], list[torch.Tensor]]:
    """One block at ``position`` on the context already in ``cache`` (what a round's drafting costs)."""
    hid = drafter.draft_hidden(pending, position, k, cache)[0]
    base = drafter.logits(hid)
    if drafter.markov_head is None and sampling.greedy:
        return drafter.to_target_ids(base.argmax(-1)).tolist(), []
    tokens, q_probs, state = [], [], None
    prev = torch.tensor([pending], device=hid.device)
    for j in range(k):
        bias, state = drafter.markov_bias(prev, hid[j][None], state)
        logits = base[j] if bias is None else base[j] + bias[0]
        if sampling.greedy:
            draft = logits.argmax()
        else:
            q = (logits.float() / sampling.temperature).softmax(-1)
            draft = torch.multinomial(q, 1, generator=generator)[0]
            q_probs.append(scatter_q(drafter, q))
        prev = drafter.to_target_ids(draft.reshape(1))
        tokens.append(int(prev))
    return tokens, q_probs


def scatter_q(drafter, q: torch.Tensor) -> torch.Tensor:
    """A drafter's distribution over the full target vocabulary (zero outside the draft vocab)."""
    full = torch.zeros(drafter.config.vocab_size, dtype=q.dtype, device=q.device)
    return full.index_copy(0, drafter.to_target_ids(torch.arange(q.numel(), device=q.device)), q)
