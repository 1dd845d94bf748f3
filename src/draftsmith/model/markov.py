"""DSpark's sequential heads: the low-rank Markov head (previous token -> bias on a draft position's logits) and
the confidence head (predicted acceptance of a draft position).

The Markov head is what makes a block semi-autoregressive: the backbone fills every slot in one pass, then draft
positions are sampled left to right, each biased by the token drafted before it. Three types, as DeepSpec defines
them (``deepspec/modeling/dspark/markov_head.py``); vLLM 0.32 and llama.cpp read only ``vanilla``:

- vanilla: ``bias = markov_w2(markov_w1[prev])``
- gated:   ``e = markov_w1[prev]; bias = markov_w2(sigmoid(gate_proj(cat(hid, e))) * e)``
- rnn:     a GRU-like state over the block: ``g, c, o = joint_proj(cat(s, markov_w1[prev], hid)).chunk(3)``,
           ``s = sig(g) * s + (1 - sig(g)) * tanh(c)``, ``bias = markov_w2(tanh(o))``; ``s`` starts at zero.

``markov_w1`` is indexed by *target* token ids (vocab_size rows); ``markov_w2`` writes draft-vocabulary logits,
as vLLM's ``DSparkMarkovHead`` lays them out. Module names are the checkpoint's weight names.
"""

from __future__ import annotations

import torch
from torch import nn

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


class MarkovHead(nn.Module):
    """The vanilla head; subclasses change only how a step's bias is computed."""

    head_type = "vanilla"

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int):
        super().__init__()
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)

    def embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """The rank-r embedding of the previous (target) token; the confidence head reads it too."""
        return self.markov_w1(prev_ids.long())

    def step(self, prev_ids: torch.Tensor, hid: torch.Tensor, state: torch.Tensor | None = None,
             embedded: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Bias for one draft position of every row: prev_ids [...], hid [..., H] -> ([..., Vd], next state).

        ``embedded``: ``embed(prev_ids)`` when the caller has it (the trainer shares one lookup with the confidence
        head: one gradient of the vocabulary-sized table instead of two)."""
        e = self.embed(prev_ids) if embedded is None else embedded
        return self.markov_w2(e.to(self.markov_w2.weight.dtype)), state

    def block(self, prev_ids: torch.Tensor, hid: torch.Tensor, embedded: torch.Tensor | None = None
              ) -> torch.Tensor:
        """Teacher-forced biases for whole blocks: prev_ids [..., K], hid [..., K, H] -> [..., K, Vd]."""
        return self.step(prev_ids, hid, embedded=embedded)[0]


class GatedMarkovHead(MarkovHead):
    head_type = "gated"

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int):
        super().__init__(vocab_size, draft_vocab_size, rank, hidden_size)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def step(self, prev_ids, hid, state=None, embedded=None):
        e = (self.embed(prev_ids) if embedded is None else embedded).to(hid.dtype)
        gate = torch.sigmoid(self.gate_proj(torch.cat([hid, e], dim=-1)))
        return self.markov_w2(gate * e), state


class RNNMarkovHead(MarkovHead):
    head_type = "rnn"

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int):
        super().__init__(vocab_size, draft_vocab_size, rank, hidden_size)
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def step(self, prev_ids, hid, state=None, embedded=None):
        e = (self.embed(prev_ids) if embedded is None else embedded).to(hid.dtype)
        if state is None:
            state = torch.zeros_like(e)
        gate, cand, out = self.joint_proj(torch.cat([state, e, hid], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(cand)
        return self.markov_w2(torch.tanh(out)), state

    def block(self, prev_ids, hid, embedded=None):
        state, biases = None, []
        for j in range(prev_ids.shape[-1]):
            e = None if embedded is None else embedded[..., j, :]
            bias, state = self.step(prev_ids[..., j], hid[..., j, :], state, e)
            biases.append(bias)
        return torch.stack(biases, dim=-2)


_HEADS = {cls.head_type: cls for cls in (MarkovHead, GatedMarkovHead, RNNMarkovHead)}


def build_markov_head(head_type: str, vocab_size: int, draft_vocab_size: int, rank: int,
                      hidden_size: int) -> MarkovHead | None:
    """The head a config names, or None for rank 0 (a DSpark without a Markov head is a DFlash)."""
    if rank == 0:
        return None
    return _HEADS[head_type](vocab_size, draft_vocab_size, rank, hidden_size)


class ConfidenceHead(nn.Module):
    """``proj(cat(hid, markov_w1[prev]))`` (or ``proj(hid)``): the logit of the acceptance probability."""

    def __init__(self, hidden_size: int, markov_rank: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden_size + (markov_rank if with_markov else 0), 1)

    def forward(self, hid: torch.Tensor, markov_embed: torch.Tensor | None) -> torch.Tensor:
        x = torch.cat([hid, markov_embed.to(hid.dtype)], dim=-1) if self.with_markov else hid
        return self.proj(x).squeeze(-1)
