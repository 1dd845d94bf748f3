"""Training data: samples from a feature store or from the target in the loop, batched deterministically.

The batch order is a function of the seed alone (``make_batches``) and the held-out split a function of
the sample ids alone (``split_eval``), which is what lets a resumed run see the batches it would have seen.
"""

from __future__ import annotations

import hashlib
import random

import torch

from draftsmith.model.ttt import TTTBatch, bucketed
from draftsmith.stages.train.config import TrainError


class StoreSource:
    """Samples from a feature store, read one at a time (bounded memory)."""

    def __init__(self, store, max_length: int, dtype: torch.dtype):
        self.store, self.max_length, self.dtype = store, max_length, dtype
        self.lengths = [min(n, max_length) for n in store.lengths]
        self.ids = list(store.sample_ids)

    def load(self, indices: list[int]) -> TTTBatch:
        samples = [self.store.get(i) for i in indices]
        batch = collate([(s["input_ids"], s["loss_mask"], s["aux_hidden_states"].flatten(-2), s["hidden_state"])
                         for s in samples], self.max_length, self.dtype)
        batch.indices = list(indices)
        return batch


class OnlineSource:
    """Conversations tokenized up front; features computed by the target for each batch (nothing stored)."""

    def __init__(self, target, conversations: str, max_length: int):
        from draftsmith.data.chat import EmptyConversation, read_jsonl, tokenize_conversation

        self.target = target
        self.items, self.ids = [], []
        for _line, conv in read_jsonl(conversations):
            if isinstance(conv, Exception):
                continue
            try:
                tok = tokenize_conversation(target.tokenizer, conv.messages, max_length=max_length, truncate=True)
            except EmptyConversation:
                continue
            self.items.append((torch.tensor(tok.input_ids), torch.tensor(tok.loss_mask, dtype=torch.bool)))
            self.ids.append(conv.id)
        if not self.items:
            raise TrainError(f"{conversations}: no usable conversation")
        self.lengths = [len(x[0]) for x in self.items]
        self.max_length = max_length

    def load(self, indices: list[int]) -> TTTBatch:
        seqs = [self.items[i] for i in indices]
        t = max(len(s[0]) for s in seqs)
        ids = torch.zeros(len(seqs), t, dtype=torch.long)
        attn = torch.zeros(len(seqs), t, dtype=torch.long)
        for r, (x, _) in enumerate(seqs):
            ids[r, : len(x)], attn[r, : len(x)] = x, 1
        out = self.target(ids.to(self.target.device), attention_mask=attn.to(self.target.device), logits_to_keep=1)
        aux = torch.cat(out.aux_hidden_states, -1)
        return collate([(x, m, aux[r, : len(x)].cpu(), out.hidden_state[r, : len(x)].cpu())
                        for r, (x, m) in enumerate(seqs)], self.max_length, aux.dtype)


def every_position(batch: TTTBatch) -> TTTBatch:
    """The batch with every real token marked for the loss (prompts too), padding still out."""
    t = batch.input_ids.shape[1]
    batch.loss_mask = torch.arange(t, device=batch.input_ids.device)[None] < batch.lengths[:, None]
    return batch


def collate(samples, max_length: int, dtype: torch.dtype) -> TTTBatch:
    """Right-padded to the longest sample rounded up to ``SHAPE_BUCKET`` (at most ``max_length``)."""
    samples = [(x[:max_length], m[:max_length], a[:max_length], h[:max_length]) for x, m, a, h in samples]
    b, t = len(samples), bucketed(max(len(s[0]) for s in samples), max_length)
    ids = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.bool)
    aux = torch.zeros(b, t, samples[0][2].shape[-1], dtype=dtype)
    hid = torch.zeros(b, t, samples[0][3].shape[-1], dtype=dtype)
    for r, (x, m, a, h) in enumerate(samples):
        n = len(x)
        ids[r, :n], mask[r, :n], aux[r, :n], hid[r, :n] = x, m.bool(), a.to(dtype), h.to(dtype)
    return TTTBatch(ids, mask, aux, hid, torch.tensor([len(s[0]) for s in samples]))


def _id_hash(sid: str) -> float:
    return int(hashlib.sha256(sid.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


def split_eval(ids: list[str], fraction: float) -> tuple[list[int], list[int]]:
    """Held-out split by a hash of the sample id: stable across reruns and store growth."""
    train, held = [], []
    for i, sid in enumerate(ids):
        (held if _id_hash(sid) < fraction else train).append(i)
    if not train:
        train, held = held, []
    return train, held


def first_samples(ids: list[str], train_idx: list[int], n: int) -> list[int]:
    """The ``n`` training samples first in id-hash order (all when ``n`` is 0): a random subset, and the
    subset for a smaller ``n`` lies inside the one for a larger, so a data-scaling curve only adds data."""
    if not n or n >= len(train_idx):
        return train_idx
    return sorted(sorted(train_idx, key=lambda i: _id_hash(ids[i]))[:n])


def make_batches(indices: list[int], lengths: list[int], batch_tokens: int, seed: int) -> list[list[int]]:
    """Shuffle, then bucket by length inside windows so padding stays small while order stays random."""
    rng = random.Random(seed)
    order = list(indices)
    rng.shuffle(order)
    batches: list[list[int]] = []
    window = 64
    for w in range(0, len(order), window):
        chunk = sorted(order[w: w + window], key=lambda i: lengths[i])
        cur: list[int] = []
        for i in chunk:
            longest = max([lengths[j] for j in cur] + [lengths[i]])
            if cur and longest * (len(cur) + 1) > batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
    rng.shuffle(batches)
    return batches
