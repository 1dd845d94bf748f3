"""Whose features these are: refuse to train on a store captured from another target, tokenizer or layers.

The capture stage records the target's identity in the store's meta; this is the check a trainer runs
against it before reading a single sample. ``check_store_identity`` compares an identity dict, so it needs
no model; ``check_store_matches_target`` builds that dict from a target (or the trainer's heads-only view).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from draftsmith.core.fingerprint import tokenizer_fingerprint
from draftsmith.data.store.reader import FeatureStore

# What a trainer must agree on with the store; version and length policy may differ harmlessly.
MATCH_KEYS = ("target_fingerprint", "tokenizer_fingerprint", "aux_layer_ids", "hidden_size")


def _as_store(store: FeatureStore | str | Path) -> FeatureStore:
    return store if isinstance(store, FeatureStore) else FeatureStore(store)


def check_store_identity(store: FeatureStore | str | Path, expected: Mapping[str, Any], force: bool = False
                         ) -> list[str]:
    """Compare the store's meta with ``expected`` on the ``MATCH_KEYS`` it holds (the others are not checked).

    Raises ``StoreMismatch`` naming the first differing key with both values; with ``force`` it warns
    instead. Returns the differing keys.
    """
    return _as_store(store).check_meta(dict(expected), [k for k in MATCH_KEYS if k in expected], force=force)


def _target_identity(target, stored: Any) -> dict[str, Any]:
    """``target.fingerprint()``, or for a heads-only view (embedding + lm_head + config, as the offline
    trainer loads it) the fields its config determines; fields it cannot know are taken as stored."""
    if callable(getattr(target, "fingerprint", None)):
        return target.fingerprint()
    from draftsmith.core.fingerprint import target_fingerprint
    from draftsmith.model.target import text_config_of

    ours = target_fingerprint(text_config_of(target.config))
    return {**(stored if isinstance(stored, dict) else {}), **ours}


def check_store_matches_target(store: FeatureStore | str | Path, target, tokenizer=None, force: bool = False
                               ) -> list[str]:
    """Refuse features captured from another target, tokenizer or aux layer choice.

    ``target`` is a ``Target``, or any object with a ``config`` and ``hidden_size`` (the trainer's
    heads-only view, which then cannot check the architecture name or aux layer ids). Raises
    ``StoreMismatch`` naming the first differing key of ``MATCH_KEYS`` with both values; with ``force``
    it warns instead. ``tokenizer`` defaults to the target's; with neither it is not checked. Returns the
    differing keys.
    """
    fs = _as_store(store)
    expected: dict[str, Any] = {
        "target_fingerprint": _target_identity(target, fs.meta.get("target_fingerprint")),
        "hidden_size": int(target.hidden_size),
    }
    if getattr(target, "aux_layers", None) is not None:
        expected["aux_layer_ids"] = [int(x) for x in target.aux_layers]
    tokenizer = tokenizer if tokenizer is not None else getattr(target, "tokenizer", None)
    if tokenizer is not None:
        expected["tokenizer_fingerprint"] = tokenizer_fingerprint(tokenizer)
    return check_store_identity(fs, expected, force=force)
