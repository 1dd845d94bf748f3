"""HF capture: the target's prefill through transformers, in length-sorted, right-padded batches.

Conversations are tokenized in windows of ``sort_window``, sorted by length (longest first, so an
out-of-memory batch shows up at once) and packed into batches bounded by ``batch_size`` and
``max_tokens_per_batch`` *padded* tokens. Padding goes on the right with a 2D attention mask: with causal
attention a real position never attends to a later pad, so positions and features of real tokens equal an
unbatched pass; the padded rows are sliced off. Logits are not needed (the teacher is the stored final hidden
state), so only one position's logits are computed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draftsmith.stages.capture.common import CaptureConfig, CaptureReport, _Progress, _Run, capture_with
from draftsmith.stages.capture.vocab import add_vocab


@dataclass
class SampleFeatures:
    """One sample's features, sliced out of a batch: ``aux`` is ``[T, n, H]``, ``hidden`` ``[T, H]``."""

    aux: torch.Tensor
    hidden: torch.Tensor


def batched_features(target, sequences: Sequence[Sequence[int]], pad_id: int = 0) -> list[SampleFeatures]:
    """Run one right-padded prefill over ``sequences`` and return each one's unpadded features.

    Right padding keeps position ids and causal attention of real tokens identical to an unbatched pass,
    so padding cannot leak into them; the 2D mask keeps pads out of attention (and is omitted when no
    row is padded, letting the backend take its causal fast path). Online training's ``OnlineSource`` runs
    its own right-padded pass the same way (always with the mask).
    """
    if not sequences:
        return []
    lengths = [len(s) for s in sequences]
    if min(lengths) < 1:
        raise ValueError("cannot prefill an empty sequence")
    t = max(lengths)
    ids = torch.full((len(sequences), t), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(sequences), t), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        mask[i, : len(s)] = 1
    device = target.device
    padded = min(lengths) < t
    out = target.forward(ids.to(device), attention_mask=mask.to(device) if padded else None, logits_to_keep=1)
    aux = torch.stack(out.aux_hidden_states, dim=2)  # [B, T, n, H]
    return [SampleFeatures(aux=aux[i, :n], hidden=out.hidden_state[i, :n]) for i, n in enumerate(lengths)]


def _plan_batches(lengths: Sequence[int], batch_size: int, max_tokens: int | None) -> list[list[int]]:
    """Indices grouped longest first; a batch's padded size (rows x longest) stays within max_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches:
            cur = batches[-1]
            longest = lengths[cur[0]]
            if len(cur) < batch_size and (max_tokens is None or (len(cur) + 1) * longest <= max_tokens):
                cur.append(i)
                continue
        batches.append([i])
    return batches



class _Capture(_Run):
    """HF prefill of each window, batch by batch, straight into the writer."""

    def __init__(self, target, tokenizer, config: CaptureConfig, writer, report: CaptureReport,
                 progress: _Progress) -> None:
        super().__init__(tokenizer, target.vocab_size, config, writer, report, progress)
        self.target = target
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None and 0 <= pad < target.vocab_size else 0

    def run_window(self) -> None:
        """Prefill the window in length-sorted batches and hand each sample to the store."""
        cfg, counts, report, writer = self.config, self.counts, self.report, self.writer
        for batch in _plan_batches([len(p.input_ids) for p in self.window], cfg.batch_size, cfg.max_tokens_per_batch):
            items = [self.window[i] for i in batch]
            t0 = time.perf_counter()
            feats = batched_features(self.target, [p.input_ids for p in items], self.pad_id)
            report.forward_s += time.perf_counter() - t0
            report.padded_tokens += len(items) * max(len(p.input_ids) for p in items)
            for p, f in zip(items, feats, strict=True):
                rejected = writer.rejected_nonfinite
                ids = torch.tensor(p.input_ids, dtype=torch.long)
                mask = torch.tensor(p.loss_mask, dtype=torch.bool)
                self.added(p, writer.add(p.sample_id, ids, mask, f.aux, f.hidden), rejected)
            del feats
            self.progress.update(len(items), counts.captured, report.tokens)
            if writer.num_pending and time.perf_counter() - self.last_flush >= cfg.flush_interval_s:
                writer.flush()  # bound the work a crash can lose on a slow capture
                self.last_flush = time.perf_counter()
        self.window.clear()


def capture(target, tokenizer, config: CaptureConfig) -> CaptureReport:
    """Capture features for every conversation in ``config.conversations`` into the store ``config.out``.

    Returns the report (its counts add up to the records read), after building the draft vocabulary
    unless ``config.draft_vocab_size`` is None. Raises ``ValueError`` for unusable inputs (no chat
    template, a tokenizer larger than the target's vocabulary), ``StoreMismatch`` when resuming into a
    store captured under other meta, ``StoreWriteError``/``OSError`` when the disk fails; the store on
    disk stays valid in every case and a rerun resumes where the last committed shard ended.
    """
    report = capture_with(target, tokenizer, config, lambda writer, report, progress: _Capture(
        target, tokenizer, config, writer, report, progress))
    return add_vocab(report, config, target.vocab_size)


def run_capture(config: CaptureConfig) -> CaptureReport:
    """``draftsmith capture``: validate the config, load the target, capture, build the draft vocab."""
    from draftsmith.model.target import load_target

    config.validate()  # before the (possibly long) target load
    dtype = getattr(torch, config.target_dtype) if config.target_dtype else None
    target = load_target(config.target, device=config.device, dtype=dtype, aux_layers=config.aux_layers)
    return capture(target, target.tokenizer, config)


