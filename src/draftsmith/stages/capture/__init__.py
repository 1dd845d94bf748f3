"""Capture: conversations in, EAGLE-3 training features out.

Offline training needs, per token of every conversation, the target's aux hidden states (the residual
stream entering each aux layer) and its final post-norm hidden state (the teacher, from which the
trainer recomputes the target's logits with the frozen lm_head). This module runs the target's
prefill over a conversations JSONL and writes those features into a ``FeatureStore``.

Why it looks the way it does:

* **Batched prefill, right padding.** Conversations are tokenized in windows of ``sort_window``,
  sorted by length (longest first, so an out-of-memory batch shows up at once) and packed into batches
  bounded by ``batch_size`` and ``max_tokens_per_batch`` *padded* tokens. Padding goes on the right
  with a 2D attention mask: with causal attention a real position never attends to a later pad, so
  positions and features of real tokens equal an unbatched pass; the padded rows are sliced off.
  Logits are not needed (the teacher is the stored final hidden state), so only one position's logits
  are computed.
* **Resume and exactly-once.** The store commits whole shards atomically; a rerun skips ids that are
  committed before tokenizing them. ``kill -9`` at any point then a rerun yields every sample once.
  Shards are also flushed every ``flush_interval_s`` so a slow capture never holds much uncommitted work.
* **Nothing silently dropped.** Every input record ends in exactly one bucket of ``CaptureCounts``
  (captured, already stored, duplicate id, invalid, template error, no loss tokens, too long, NaN/Inf);
  the buckets add up to the records read, and truncations are counted too.
* **Provenance.** The store's meta records aux layer ids (input of layer L; SGLang's ids are one lower),
  hidden size, the target and tokenizer fingerprints, the draftsmith version and the length policy, so
  ``check_store_matches_target`` can refuse to train on features from another target.

The draft vocabulary (``d2t``/``t2d``) is built right after capture from the tokens at loss positions
(``build_vocab``), and written into the store directory as ``vocab.safetensors``.

Backends: ``hf`` (``hf.py``, the default: transformers in this process) and ``vllm`` (``vllm.py``: vLLM's offline
engine in child processes, the states spooled per request and ingested into the same store; see
``docs/capture-at-scale.md``). Both share the reading side and the store meta (``common.py``).
"""

from __future__ import annotations

from draftsmith.data.store import MATCH_KEYS, check_store_matches_target
from draftsmith.stages.capture.common import (
    AUX_CONVENTION,
    CaptureConfig,
    CaptureCounts,
    CaptureInputError,
    CaptureReport,
    VocabReport,
    capture_with,
    errors_path,
    record_tokens,
    store_meta,
)
from draftsmith.stages.capture.hf import SampleFeatures, _plan_batches, batched_features, capture, run_capture
from draftsmith.stages.capture.vllm import VllmOptions, run_capture_vllm
from draftsmith.stages.capture.vocab import build_vocab, count_store_tokens

__all__ = [
    "AUX_CONVENTION",
    "MATCH_KEYS",
    "CaptureConfig",
    "CaptureCounts",
    "CaptureInputError",
    "CaptureReport",
    "SampleFeatures",
    "VllmOptions",
    "VocabReport",
    "_plan_batches",
    "batched_features",
    "build_vocab",
    "capture",
    "capture_with",
    "check_store_matches_target",
    "count_store_tokens",
    "errors_path",
    "record_tokens",
    "run_capture",
    "run_capture_vllm",
    "store_meta",
]
