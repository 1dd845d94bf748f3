"""Target checks: what the target's config and tokenizer files say, and where its decoder keeps its layers."""

from __future__ import annotations

import contextlib
from pathlib import Path

from draftsmith.stages.doctor.report import Findings
from draftsmith.stages.doctor.state import (
    TOKENIZER_FILES,
    VOCABULARY_FILES,
    EngineFacts,
    TargetFiles,
    vocabulary_files,
)


def check_target(out: Findings, engine: EngineFacts, t: TargetFiles) -> None:
    """The target's config: an architecture, the sizes every other check needs, a model transformers knows."""
    where = "config.json"
    nested = "text_config." if t.text_raw is not t.raw else ""
    if not t.arch:
        out.add("target.architecture", "error", "config.json names no architecture: engines pick the model "
                "class by it", f"{where}: architectures is missing or empty",
                'add "architectures": ["<ModelClass>"] as the model\'s publisher wrote it')
    known = t.hf.knows(t.raw.get("model_type")) if t.hf is not None else None
    if known is False:
        sev = "error" if engine.name == "draftsmith" else "warning"
        out.add("target.transformers-config", sev, f"transformers {t.hf.version} does not know model_type "
                f"{t.raw.get('model_type')!r}; draftsmith's capture and online training load the target "
                "through transformers", f"{where}: model_type = {t.raw.get('model_type')!r}",
                "upgrade transformers (draftsmith never runs remote code)")
    if not isinstance(t.num_layers, int) or t.num_layers < 1:
        out.add("target.num-layers", "error", "the target's decoder depth is unknown, so no aux layer id can "
                "be checked", f"{where}: {nested}num_hidden_layers = {t.num_layers!r}",
                "add num_hidden_layers to the (text) config")
        return
    for name, value in (("hidden_size", t.hidden_size), ("vocab_size", t.vocab_size)):
        if not isinstance(value, int):
            out.add(f"target.{name.replace('_', '-')}", "error", f"the target's {name} is unknown",
                    f"{where}: {nested}{name} = {value!r}", f"add {name} to the (text) config")
    if known:
        _check_decoder_layers(out, engine, t)


def _check_decoder_layers(out: Findings, engine: EngineFacts, t: TargetFiles) -> None:
    """Find the decoder layer list in transformers' source for this model; if that fails, build the model on
    the meta device with its decoder cut to a few layers and look there."""
    path, how = t.hf.decoder_layers_path(t.raw), "transformers source"
    err = None
    if path is None:
        path, err = _meta_layers_path(t.path)
        how = "meta-device instantiation"
    evidence = (f"config.json: architectures = {t.raw.get('architectures')}, "
                f"{t.nested}num_hidden_layers = {t.num_layers}")
    if path is not None:
        out.facts["layers_path"] = path
        out.facts["layers_found_by"] = how
        return
    sev = "error" if engine.name == "draftsmith" else "warning"
    out.add("target.decoder-layers", sev, f"draftsmith cannot find the decoder layers of this model ({err}); "
            "capture and online training hook the layers to read aux hidden states", evidence,
            "check that the model is a decoder-only LM (or a wrapper with a text_config); add its layer path "
            "to draftsmith.model.target._KNOWN_LAYER_PATHS if it keeps them somewhere unusual")


def check_tokenizer(out: Findings, t: TargetFiles) -> None:
    """Tokenizer files next to the target, a chat template, no token id beyond the vocabulary."""
    if not t.tokenizer_files and not t.tokenizer_errors:
        out.add("tokenizer.missing", "warning", "no tokenizer files next to the target: training data, the "
                "draft vocabulary and serving all depend on the exact tokenizer",
                f"{t.path}: none of {', '.join(TOKENIZER_FILES)}",
                "copy the tokenizer files from the model's release into this directory")
        return
    if t.tokenizer_errors:
        out.add("tokenizer.unreadable", "error", f"a tokenizer file cannot be read: {'; '.join(t.tokenizer_errors)}: "
                "engines and draftsmith fail to load the tokenizer (a download or copy was cut short)",
                f"{t.path}: {', '.join(e.split(':')[0] for e in t.tokenizer_errors)}",
                "copy the tokenizer files again from the model's release")
    tok_cfg = t.tokenizer_config
    if not vocabulary_files(t.path) and not t.tokenizer_errors:
        named = tok_cfg.get("tokenizer_class")
        out.add("tokenizer.no-vocabulary", "error", f"{', '.join(t.tokenizer_files)} but no vocabulary file: no "
                f"tokenizer can be built from this folder{f' ({named} reads tokenizer.json)' if named else ''}; "
                "draftsmith refuses it and engines fail at load",
                f"{t.path}: none of {', '.join(VOCABULARY_FILES)}",
                "copy tokenizer.json (or the model's tokenizer.model / vocab files) from the model's release")
    template = (tok_cfg.get("chat_template") or (t.path / "chat_template.jinja").is_file()
                or (t.path / "chat_template.json").is_file())
    if not template:
        out.add("tokenizer.chat-template", "warning", "no chat template: conversations were rendered with one "
                "during training, and the engine's chat endpoint renders prompts with this one; without it "
                "prompts no longer look like the training data (acceptance drops) or chat requests fail",
                "tokenizer_config.json: chat_template absent; no chat_template.jinja / chat_template.json",
                "copy chat_template.jinja (or tokenizer_config.json's chat_template) from the model's release")
    n_tok, source = t.tokenizer_size, t.tokenizer_source
    out.facts["tokenizer_size"] = n_tok
    if n_tok is not None and isinstance(t.vocab_size, int) and n_tok > t.vocab_size:
        out.add("tokenizer.vocab-size", "error", f"the tokenizer produces ids up to {n_tok - 1}, beyond the "
                f"target's vocabulary of {t.vocab_size}", f"{source}: {n_tok} tokens; config.json: "
                f"vocab_size = {t.vocab_size}", "use the tokenizer that belongs to this model")


def _meta_layers_path(directory: Path) -> tuple[str | None, str | None]:
    """Build the model on the meta device with its decoder cut to a few layers; (layer path, error).

    The fallback when transformers' source does not say: imports the modeling code (seconds), allocates nothing.
    """
    try:
        import torch
        import transformers

        from draftsmith.model.target import TargetError, find_decoder_layers, text_config_of

        cfg = transformers.AutoConfig.from_pretrained(directory, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 (any failure is the finding)
        return None, f"transformers cannot read the config: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
    if hasattr(cfg, "auto_map"):  # never run or prompt for remote code
        with contextlib.suppress(AttributeError):
            delattr(cfg, "auto_map")
    text = text_config_of(cfg)
    n = int(text.num_hidden_layers)
    keep = min(n, max(4, int(getattr(text, "first_k_dense_replace", 0) or 0) + 2))
    if keep < n:  # the layer path does not depend on the depth; per-layer lists are cut along
        for name, value in list(vars(text).items()):
            if isinstance(value, (list, tuple)) and len(value) == n:
                setattr(text, name, type(value)(value[:keep]))
        text.num_hidden_layers = keep
    auto = None
    for mapping, auto_name in (("MODEL_FOR_CAUSAL_LM_MAPPING", "AutoModelForCausalLM"),
                               ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING", "AutoModelForImageTextToText")):
        m = getattr(transformers, mapping, None)
        if m is not None and type(cfg) in m:
            auto = getattr(transformers, auto_name)
            break
    if auto is None:
        return None, f"transformers has no causal-LM class for {type(cfg).__name__}"
    try:
        with torch.device("meta"):
            model = auto.from_config(cfg, trust_remote_code=False)
        path, _ = find_decoder_layers(model, keep)
        return path, None
    except TargetError as e:
        return None, str(e).split(":")[0]
    except Exception as e:  # noqa: BLE001 (any construction failure is the finding)
        return None, f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"


__all__ = ["check_target", "check_tokenizer"]
