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


def target_fingerprint(config, *, architecture: str | None = None) -> dict:
    """What identifies a target for later stages (a store or drafter made for another refuses it).

    ``config`` is the text config (a multimodal wrapper's language model config); ``architecture`` is the
    model class's name, known only where the model itself is loaded, so a heads-only view leaves it out.
    """
    return {
        **({"architecture": architecture} if architecture is not None else {}),
        "config_sha256": config_fingerprint(config),
        "num_layers": int(config.num_hidden_layers),
        "hidden_size": int(config.hidden_size),
        "vocab_size": int(config.vocab_size),
    }


def tokenizer_fingerprint(tokenizer) -> str:
    """Short hash of the vocabulary, special tokens and chat template (training data depends on all three)."""
    vocab = tokenizer.get_vocab()
    return _sha({
        "vocab": sorted(vocab.items(), key=lambda kv: kv[1]),
        "special": sorted(map(str, getattr(tokenizer, "all_special_tokens", []))),
        "chat_template": getattr(tokenizer, "chat_template", None),
    })
