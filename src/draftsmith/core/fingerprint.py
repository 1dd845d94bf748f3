"""Fingerprints that tie every artefact to the target and tokenizer that made it."""

from __future__ import annotations

import hashlib
import json

# Fields that change with how a config was saved, not with what the model computes.
_VOLATILE = {"_name_or_path", "name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash",
             "architectures", "use_cache", "_attn_implementation_autoset", "output_hidden_states"}


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_fingerprint(config) -> str:
    """Short hash of the (text) config's structural fields."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return _sha({k: v for k, v in d.items() if k not in _VOLATILE})


def tokenizer_fingerprint(tokenizer) -> str:
    """Short hash of the vocabulary, special tokens and chat template (training data depends on all three)."""
    vocab = tokenizer.get_vocab()
    return _sha({
        "vocab": sorted(vocab.items(), key=lambda kv: kv[1]),
        "special": sorted(map(str, getattr(tokenizer, "all_special_tokens", []))),
        "chat_template": getattr(tokenizer, "chat_template", None),
    })
