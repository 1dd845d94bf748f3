"""Engine checks on the target: what the vLLM version checked against does with this target class.

Facts come from the installed vLLM's source when it is the version checked against, else from the per-version
table in ``draftsmith.core.vllm_facts``. The drafter-side engine facts (architecture names, weight names, aux
conventions) are checked with the drafter.
"""

from __future__ import annotations

from draftsmith.core import vllm_facts
from draftsmith.core.conventions import layer_kinds
from draftsmith.stages.doctor.hfsource import get_dotted
from draftsmith.stages.doctor.hybrid_checks import ways_out
from draftsmith.stages.doctor.report import Findings
from draftsmith.stages.doctor.state import EngineFacts, TargetFiles


def check_vllm_target(out: Findings, engine: EngineFacts, t: TargetFiles) -> None:
    """What vLLM does with this target class: SupportsEagle3, an older model-type allowlist, multimodal fields."""
    p = engine.profile
    arch = t.arch
    if arch is None:
        return
    evidence = f"config.json: architectures[0] = {arch}"
    supports, how = _vllm_supports_eagle3(engine, arch)
    out.facts["vllm_supports_eagle3"] = supports
    version = engine.version or p.name
    if supports is False:
        refusal = (engine.live.plugin_refusal(arch) if engine.live is not None else
                   None if arch in p.plugin_patchable else p.plugin_refusals.get(arch, "not in its verified set"))
        patchable = refusal is None and arch in vllm_facts.plugin_candidates()
        if patchable and engine.live is not None and vllm_facts.plugin_installed():
            out.add("vllm.eagle3-interface", "info", f"vLLM {version}'s {arch} lacks SupportsEagle3; "
                    "draftsmith's vLLM plugin (installed here) adds it", f"{evidence} ({how})")
        else:
            hybrid = layer_kinds(t.text_raw) is not None
            if patchable:
                fix = ("install draftsmith into vLLM's environment (pip install --no-deps draftsmith): its "
                       f"vllm.general_plugins entry point adds SupportsEagle3 to {arch}")
                if hybrid:
                    fix += "".join(f"; or {w}" for w in ways_out(arch, t.text_raw.get("model_type"), besides="vllm"))
            elif hybrid:
                fix = (f"draftsmith's vLLM plugin cannot add SupportsEagle3 to {arch} ({refusal}): "
                       + "; or ".join(ways_out(arch, t.text_raw.get("model_type"), besides="vllm")))
            else:
                fix = (f"use a vLLM version whose {arch} implements SupportsEagle3"
                       + (" (0.32 does)" if arch in vllm_facts.VLLM_PROFILES["0.32"].eagle3_targets else "")
                       + ", or serve with SGLang / draftsmith")
            out.add("vllm.eagle3-interface", "error", f"vLLM {version}: \"{p.seed_error}\": the target "
                    f"class {arch} does not implement SupportsEagle3, found only after the full target load",
                    f"{evidence} ({how})", fix, engine_fact=True)
    elif supports is None:
        out.add("vllm.eagle3-interface", "warning", f"cannot tell whether vLLM {version}'s class for {arch} "
                "implements SupportsEagle3", f"{evidence} ({how})",
                "install that vLLM here and rerun (doctor then reads its source), or try --vllm-import")
    # Model types an older allowlist refuses (substring match on the text config's model_type).
    mt = t.text_raw.get("model_type") or t.raw.get("model_type")
    if p.model_type_allowlist is not None and not any(s in str(mt) for s in p.model_type_allowlist):
        out.add("vllm.model-type", "error", f"vLLM {version} refuses EAGLE-3 for this model type: \"Eagle3 is "
                f"only supported for {list(p.model_type_allowlist)} models. Got model_type={mt!r}\"",
                f"config.json: {t.nested}model_type = {mt!r}",
                "upgrade vLLM (0.32 has no such allowlist)", engine_fact=True)
    _check_vllm_multimodal(out, engine, t, arch)


def _vllm_supports_eagle3(engine: EngineFacts, arch: str) -> tuple[bool | None, str]:
    p = engine.profile
    if engine.live is not None:
        if engine.vllm_import:
            from draftsmith.integrations.vllm import supports_eagle3_by_import  # imports vLLM: only when asked

            got = supports_eagle3_by_import(arch)
            if got is not None:
                return got, f"vLLM {engine.live.version}: class imported through its registry"
        if arch in engine.live.registry:
            got = engine.live.supports_eagle3(arch)
            module, cls = engine.live.registry[arch]
            return got, f"vLLM {engine.live.version} source: {module}.{cls}"
        return p.transformers_backend_eagle3, (f"{arch} is not in vLLM {engine.live.version}'s registry: its "
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


def _check_vllm_multimodal(out: Findings, engine: EngineFacts, t: TargetFiles, arch: str) -> None:
    p = engine.profile
    mm_archs = engine.live.multimodal_archs if engine.live is not None else frozenset()
    multimodal = arch in mm_archs or arch in p.mm_token_field or isinstance(t.raw.get("vision_config"), dict)
    if not multimodal:
        return
    field_path = p.mm_token_field.get(arch, p.mm_token_field_default)
    value = get_dotted(t.raw, field_path)
    out.facts["vllm_mm_token_field"] = field_path
    if value is not None:
        return
    if "." not in field_path and t.hf is not None and t.hf.config_default(t.raw.get("model_type"),
                                                                          field_path):
        return  # the config class supplies a default (e.g. LlavaConfig.image_token_index)
    alternatives = {k: t.raw[k] for k in ("image_token_index", "image_token_id", "media_placeholder_token_id",
                                              "img_context_token_id") if k in t.raw}
    version = engine.version or p.name
    fix = (f'add "{field_path}": {next(iter(alternatives.values()))} (the same token as '
           f"{next(iter(alternatives))}) to config.json" if alternatives else
           f"add the image placeholder token id as {field_path} to config.json")
    if p.name != "0.32" and arch in vllm_facts.VLLM_PROFILES["0.32"].mm_token_field:
        fix += f", or upgrade to vLLM 0.32, which reads {vllm_facts.VLLM_PROFILES['0.32'].mm_token_field[arch]}"
    out.add("vllm.multimodal-field", "error", f"vLLM {version}'s EAGLE-3 loader reads the multimodal target's "
            f"config.{field_path}, which this config lacks: AttributeError after the full target load",
            f"config.json: {field_path} absent"
            + (f"; present: {', '.join(f'{k} = {v}' for k, v in alternatives.items())}" if alternatives else ""),
            fix, engine_fact=True)


__all__ = ["check_vllm_target"]
