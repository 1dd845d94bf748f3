"""draftsmith's own decoder on the engine's prompts: the reference acceptance, and the faulty readings replayed.

The reference is the drafter read as draftsmith reads it (its files, faithfully), decoded with a greedy chain of
k on the same token-id prompts and token budget as the engine. Each replay variant reads it one known wrong way
(``signatures.REPLAYS``); the variant whose acceptance lands on the engine's names how the engine read it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from draftsmith.stages.check.signatures import REPLAYS


def load_pair(target: str | Path, drafter: str | Path, dtype: torch.dtype = torch.float32):
    """(target, drafter) in draftsmith: the target model (a directory, 'smollm2' or a .gguf draftsmith loads) and
    the drafter from any layout import reads, bound to it (its aux ids set on the target)."""
    from draftsmith.model.target import load_target
    from draftsmith.stages.export.readers import read_checkpoint

    t = load_target(str(target), dtype=dtype, pack=False)
    ckpt = read_checkpoint(drafter)
    d = ckpt.build().to(dtype)
    if not ckpt.has_own_embedding:
        d.bind_embeddings(t.embed_tokens)
    if ckpt.aux_known and tuple(ckpt.config.aux_layer_ids) != tuple(t.aux_layers):
        t.set_aux_hidden_state_layers(ckpt.config.aux_layer_ids)
    return t, d


@torch.no_grad()
def chain_runs(target, drafter, prompts: Sequence[Sequence[int]], k: int, max_new_tokens: int,
               eos: Sequence[int] = ()) -> list[tuple[int, int, list[int]]]:
    """(accepted drafts, verify passes, tokens) per prompt of a greedy chain of ``k`` in draftsmith's decoder."""
    from draftsmith.stages.decode import ChainSpec, SpeculativeDecoder

    dec = SpeculativeDecoder(target, drafter, ChainSpec(k))
    out = []
    for p in prompts:
        r = dec.generate(list(p), max_new_tokens, eos_token_ids=list(eos))
        out.append((sum(r.accepted_per_step), len(r.accepted_per_step), r.token_ids))
    return out


def tau_of(runs: Sequence[tuple[int, int, list[int]]]) -> float:
    accepted, passes = sum(r[0] for r in runs), sum(r[1] for r in runs)
    return 1.0 + accepted / passes if passes else 1.0


def chain_tau(target, drafter, prompts: Sequence[Sequence[int]], k: int, max_new_tokens: int,
              eos: Sequence[int] = ()) -> tuple[float, list[list[int]]]:
    """(acceptance length, tokens per prompt) of a greedy chain of ``k`` in draftsmith's decoder."""
    runs = chain_runs(target, drafter, prompts, k, max_new_tokens, eos)
    return tau_of(runs), [r[2] for r in runs]


@torch.no_grad()
def plain_top2(target, prompts: Sequence[Sequence[int]], plain: Sequence[Sequence[int]],
               spec: Sequence[Sequence[int]]) -> list[list[list[list[float]]]]:
    """The target's top-2 log-probabilities along plain's output, in draftsmith (for an engine that reports none):
    ``[prompt][position] -> [[id, log-prob], ...]``, with the speculative run's token at the first difference added,
    so a divergence there is measured against plain's choice. Only prompts whose outputs differ are computed."""
    out: list[list[list[list[float]]]] = []
    for ids, a, b in zip(prompts, plain, spec, strict=False):
        if list(a) == list(b) or not a:
            out.append([])
            continue
        seq = torch.tensor([list(ids) + list(a)], dtype=torch.long)
        logits = target(seq).logits[0, len(ids) - 1: len(ids) - 1 + len(a)].float()
        lp = torch.log_softmax(logits, dim=-1)
        vals, idx = lp.topk(2, dim=-1)
        rows = [[[int(i), float(v)] for i, v in zip(ri.tolist(), rv.tolist(), strict=True)]
                for ri, rv in zip(idx, vals, strict=True)]
        j = next((n for n, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if j is not None and int(b[j]) not in {t for t, _ in rows[j]}:
            rows[j].append([int(b[j]), float(lp[j, int(b[j])])])
        out.append(rows)
    return out


@contextlib.contextmanager
def variant(target, drafter, label: str) -> Iterator[bool]:
    """Read the drafter the ``label`` way for the block (yields False where the variant does not apply)."""
    saved = {}
    ok = True
    try:
        if label.startswith("aux ids"):
            shift = -1 if "-1" in label else 1
            ids = [i + shift for i in target.aux_layers]
            ok = all(0 <= i < target.num_layers for i in ids)
            if ok:
                saved["aux"] = tuple(target.aux_layers)
                target.set_aux_hidden_state_layers(ids)
        elif label.startswith("d2t"):
            n = drafter.d2t.numel()
            ok = n < drafter.config.vocab_size  # a full vocabulary has no d2t to lose
            if ok:
                saved["d2t"] = drafter.d2t.clone()
                ar = torch.arange(n, device=drafter.d2t.device)
                new = torch.zeros_like(drafter.d2t) if label == "d2t dropped" else (drafter.d2t - ar)
                drafter.d2t.copy_((ar + new).clamp(0, drafter.config.vocab_size - 1) - ar)
        elif label == "norm_output ignored":
            ok = drafter.config.norm_output
            if ok:
                saved["norm_output"] = True
                drafter.config.norm_output = False
        elif label in ("fc_norm ignored", "norm_before_fc ignored"):
            attr = "fc_norm" if label.startswith("fc_norm") else "input_norm"
            ok = getattr(drafter, attr, None) is not None
            if ok:
                saved[attr] = getattr(drafter, attr)
                setattr(drafter, attr, None)
        elif label == "norm_before_residual flipped":
            layers = [m for m in drafter.modules() if hasattr(m, "norm_before_residual") and m is not drafter]
            ok = bool(layers)
            saved["nbr"] = [(m, m.norm_before_residual) for m in layers]
            for m in layers:
                m.norm_before_residual = not m.norm_before_residual
        yield ok
    finally:
        if "aux" in saved:
            target.set_aux_hidden_state_layers(saved["aux"])
        if "d2t" in saved:
            drafter.d2t.copy_(saved["d2t"])
        if "norm_output" in saved:
            drafter.config.norm_output = True
        for attr in ("fc_norm", "input_norm"):
            if attr in saved:
                setattr(drafter, attr, saved[attr])
        for m, v in saved.get("nbr", []):
            m.norm_before_residual = v


def replay_all(target, drafter, prompts: Sequence[Sequence[int]], k: int, max_new_tokens: int,
               eos: Sequence[int] = ()) -> dict[str, float]:
    """Acceptance length of every replay variant that applies to this drafter."""
    out = {}
    for _, label in REPLAYS:
        with variant(target, drafter, label) as ok:
            if ok:
                out[label] = chain_tau(target, drafter, prompts, k, max_new_tokens, eos)[0]
    return out
