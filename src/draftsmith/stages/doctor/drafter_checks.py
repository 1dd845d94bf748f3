"""Drafter checks: its config against the target's, its architecture and weight names against the engine's
loader, tensor shapes against its config, and the d2t/t2d draft vocabulary (and the t2d that a speculators
layout needs for the speculators library to load it).
"""

from __future__ import annotations

from draftsmith.core import vllm_facts
from draftsmith.core.conventions import OPTIONAL_WEIGHTS, REQUIRED_WEIGHTS, is_norm_weight, layer_param_shapes
from draftsmith.core.layouts import LLAMA_EAGLE3_ARCHITECTURES
from draftsmith.core.tensorfile import TensorInfo, read_small_tensor
from draftsmith.stages.doctor.report import Findings
from draftsmith.stages.doctor.state import DrafterFiles, EngineFacts, TargetFiles

# SGLang facts (from its public source; not checked against an installed SGLang): the EAGLE-3 drafter class it
# registers, and that its loader skips weight names it does not know without a word.
SGLANG_DRAFTER_ARCHS = frozenset({"LlamaForCausalLMEagle3"})


def check_drafter_config(out: Findings, engine: EngineFacts, t: TargetFiles, d: DrafterFiles) -> None:
    """The drafter's config against the target's: vocabulary, widths, depth, the target it was made for."""
    c, tv, th = d.cfg, t.vocab_size, t.hidden_size
    arch = d.architecture
    _check_drafter_architecture(out, engine, d, arch)
    layers = c.get("num_hidden_layers", 1)
    if layers != 1 and engine.name in ("draftsmith", "sglang"):
        out.add("drafter.num-layers", "error", f"a {layers}-layer drafter: {engine.name} runs one-layer "
                "EAGLE-3 drafters", f"config.json: num_hidden_layers = {layers}", "train a one-layer drafter")
    if isinstance(tv, int) and isinstance(d.vocab, int) and d.vocab != tv:
        out.add("drafter.vocab-size", "error", f"drafter vocab_size {d.vocab} != target vocab_size {tv}: "
                "the drafter was made for another tokenizer (its token ids and d2t mean other tokens here)",
                f"drafter config.json: vocab_size = {d.vocab}; target config.json: vocab_size = {tv}",
                "train the drafter for this target (draftsmith train --target ...)")
    n_tok = t.tokenizer_size
    if isinstance(n_tok, int) and isinstance(d.vocab, int) and n_tok > d.vocab:
        out.add("drafter.tokenizer", "error", f"the tokenizer has {n_tok} tokens, the drafter's vocabulary "
                f"{d.vocab}", f"drafter config.json: vocab_size = {d.vocab}",
                "train the drafter with this target's tokenizer")
    lm = d.names.get("lm_head.weight")
    if not isinstance(d.draft_vocab, int):
        out.add("drafter.draft-vocab-size", "error", "the drafter states no draft_vocab_size or vocab_size",
                "drafter config.json: draft_vocab_size absent", "re-export the drafter")
    else:
        if isinstance(d.vocab, int) and d.draft_vocab > d.vocab:
            out.add("drafter.draft-vocab-size", "error", f"draft_vocab_size {d.draft_vocab} exceeds "
                    f"vocab_size {d.vocab}", f"drafter config.json: draft_vocab_size = {d.draft_vocab}",
                    "rebuild the draft vocabulary (draftsmith vocab)")
        if lm is not None and lm.shape and lm.shape[0] != d.draft_vocab:
            stated = "draft_vocab_size" if "draft_vocab_size" in c else "vocab_size (no draft_vocab_size)"
            out.add("drafter.draft-vocab-size", "error", f"lm_head.weight has {lm.shape[0]} rows but the config "
                    f"says {stated} = {d.draft_vocab}: the engine builds a head of the config's size and "
                    "the weights do not fit", f"{d.weights_file}: lm_head.weight {list(lm.shape)}; "
                    f"config.json: {stated.split()[0]} = {d.draft_vocab}",
                    f'set "draft_vocab_size": {lm.shape[0]} in the drafter\'s config.json')
    if isinstance(th, int) and isinstance(d.target_hidden, int) and d.target_hidden != th:
        stated = "target_hidden_size" if c.get("target_hidden_size") else "hidden_size (no target_hidden_size)"
        out.add("drafter.target-hidden-size", "error", f"the drafter fuses target states of width "
                f"{d.target_hidden}, the target's hidden size is {th}",
                f"drafter config.json: {stated.split()[0]} = {d.target_hidden}; target: hidden_size = {th}",
                "train the drafter for this target" if c.get("target_hidden_size") else
                f'add "target_hidden_size": {th} if fc.weight was trained on this target\'s states')
    if (isinstance(th, int) and isinstance(d.hidden, int) and d.hidden != th
            and "embed_tokens.weight" not in d.names and d.weights is not None):
        out.add("drafter.embedding", "error", f"the drafter is {d.hidden} wide but carries no embedding: "
                f"engines then share the target's {th}-wide table, which does not fit",
                f"{d.weights_file}: no embed_tokens.weight; config.json: hidden_size = {d.hidden}",
                "export with the drafter's own embedding (draftsmith export --include-embeddings)")
    fp = ((d.raw.get("draftsmith") or {}).get("target") or {})
    for key, have in (("num_layers", t.num_layers), ("hidden_size", th), ("vocab_size", tv)):
        if fp.get(key) is not None and have is not None and fp[key] != have:
            out.add("drafter.target-fingerprint", "error", f"the drafter was made for a target with {key} "
                    f"{fp[key]}, this one has {have}", f"drafter config.json: draftsmith.model.target.{key} = "
                    f"{fp[key]}", "pass the target the drafter was trained on, or train one for this target")
            break


def _check_drafter_architecture(out: Findings, engine: EngineFacts, d: DrafterFiles, arch: str | None) -> None:
    where = "drafter config.json: architectures[0]"
    if d.format == "speculators":
        mt = (d.raw.get("transformer_layer_config") or {}).get("model_type", "llama")
        if engine.name == "sglang":
            out.add("drafter.architecture", "warning", "a speculators-layout drafter: SGLang reads the EAGLE-3 "
                    "HF layout", "drafter config.json: speculators_model_type",
                    "draftsmith export --format sglang")
        elif mt != "llama":
            out.add("drafter.architecture", "error", f"transformer_layer_config model_type {mt!r}: only Llama "
                    "EAGLE-3 layers are what draftsmith trains", "drafter config.json: "
                    "transformer_layer_config.model_type", "re-export with draftsmith export --format speculators")
        return
    if arch is None:
        out.add("drafter.architecture", "error", "the drafter config names no architecture",
                f"{where} absent", 'add "architectures": ["LlamaForCausalLMEagle3"]')
        return
    if engine.name == "vllm":
        name = vllm_facts.drafter_architecture_in_vllm(arch)
        module = engine.profile.eagle3_drafter_archs.get(name)
        version = engine.version or engine.profile.name
        if module is None:
            out.add("drafter.architecture", "error", f"vLLM {version} looks the drafter up as {name} (it "
                    "prefixes Eagle3 to names that neither start nor end with it) and has no such class",
                    f"{where} = {arch}", 'declare "architectures": ["LlamaForCausalLMEagle3"] (a Qwen2 or '
                    "DeepSeek target's drafter still declares a Llama architecture)", engine_fact=True)
        elif module != "llama_eagle3":
            out.add("drafter.architecture", "error", f"vLLM {version} computes {name} with its {module} module, "
                    "not the Llama EAGLE-3 layer these weights are for", f"{where} = {arch}",
                    'declare "architectures": ["LlamaForCausalLMEagle3"]', engine_fact=True)
    elif engine.name == "sglang":
        if arch not in SGLANG_DRAFTER_ARCHS:
            out.add("drafter.architecture", "error", f"SGLang registers the EAGLE-3 drafter as "
                    f"{', '.join(sorted(SGLANG_DRAFTER_ARCHS))}, not {arch}", f"{where} = {arch}",
                    "draftsmith export --format sglang")
    elif arch not in LLAMA_EAGLE3_ARCHITECTURES:
        out.add("drafter.architecture", "error", f"{arch} is not a Llama-style EAGLE-3 drafter draftsmith can "
                "run", f"{where} = {arch}", "import it with draftsmith import, or train one")


def check_weights(out: Findings, engine: EngineFacts, d: DrafterFiles) -> None:
    """The tensors the drafter needs are there, none the engine would skip or refuse, shapes fit the config."""
    if d.weights is None:
        return
    names = d.names
    where = d.weights_file
    missing = [n for n in REQUIRED_WEIGHTS if n not in names]
    if missing:
        out.add("weights.missing", "error", f"{len(missing)} tensor(s) the drafter needs are missing: "
                f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}",
                f"{where}: {len(names)} tensors", "re-export the drafter (draftsmith export)")
    # EAGLE-3.1 norm tensors are checked with their switches (norm_checks).
    unknown = sorted(n for n in names if n not in REQUIRED_WEIGHTS and n not in OPTIONAL_WEIGHTS
                     and not is_norm_weight(n))
    biases = [n for n in unknown if n.endswith(".bias")]
    others = [n for n in unknown if not n.endswith(".bias")]
    if engine.name == "sglang" and unknown:
        out.add("weights.skipped", "error", f"SGLang skips weight names it does not know without a word: "
                f"{', '.join(unknown[:6])} would be dropped and the drafter would start and accept ~nothing",
                f"{where}: {', '.join(unknown[:6])}", "rename them to the EAGLE-3 HF layout (draftsmith export "
                "--format sglang) or drop them")
    elif engine.name == "vllm":
        if biases:
            out.add("weights.skipped", "error", f"vLLM's loader ignores unexpected *.bias tensors silently: "
                    f"{', '.join(biases[:6])} would be dropped (the drafter computes without them and accepts "
                    "~nothing)", f"{where}: {', '.join(biases[:6])}",
                    "train without biases, or serve with an engine whose drafter has them")
        if others:
            out.add("weights.unexpected", "error", f"vLLM's loader raises on names its drafter does not have: "
                    f"{', '.join(others[:6])} (after the target has loaded)", f"{where}: {', '.join(others[:6])}",
                    "draftsmith export --format vllm writes only the names vLLM loads")
    elif unknown:
        out.add("weights.unexpected", "error", f"tensors draftsmith's drafter has no place for: "
                f"{', '.join(unknown[:6])}", f"{where}: {', '.join(unknown[:6])}",
                "import the checkpoint with draftsmith import, which names what it drops")
    _check_shapes(out, d)


def _check_shapes(out: Findings, d: DrafterFiles) -> None:
    c = d.cfg
    try:
        h = int(c["hidden_size"])
        heads = int(c["num_attention_heads"])
        kv = int(c.get("num_key_value_heads") or heads)
        hd = int(c.get("head_dim") or h // heads)
        inter = int(c["intermediate_size"])
    except (KeyError, TypeError, ValueError):
        out.add("drafter.config", "error", "the drafter config lacks Llama sizes (hidden_size, "
                "num_attention_heads, intermediate_size)", "drafter config.json", "re-export the drafter")
        return
    want = {"norm.weight": (h,), **layer_param_shapes(h, heads, kv, hd, inter)}
    if isinstance(d.vocab, int):
        want["embed_tokens.weight"] = (d.vocab, h)
    bad = [f"{n} {list(d.names[n].shape)} (config: {list(s)})" for n, s in want.items()
           if n in d.names and d.names[n].shape != s]
    fc = d.names.get("fc.weight")
    if fc is not None and (len(fc.shape) != 2 or fc.shape[0] != h):
        bad.append(f"fc.weight {list(fc.shape)} (config: [{h}, k * target_hidden_size])")
    if bad:
        out.add("weights.shapes", "error", "tensor shapes do not fit the drafter's config: " + "; ".join(bad[:4]),
                f"{d.weights_file} vs drafter config.json", "re-export the drafter from its checkpoint")


def check_vocab_mapping(out: Findings, engine: EngineFacts, t: TargetFiles, d: DrafterFiles) -> None:
    """d2t/t2d describe a valid draft vocabulary, in the form the engine loads."""
    if d.weights is None or d.remote or not isinstance(d.draft_vocab, int):
        return  # before torch's import: a metadata-only check needs none
    import torch

    from draftsmith.core import vocab as vocab_mod

    tv = t.vocab_size if isinstance(t.vocab_size, int) else d.vocab
    d2t = t2d = None
    where = d.weights_file
    for name in ("d2t", "t2d"):
        info = d.weights.get(_raw_name(d.weights, name))
        if info is None:
            continue
        try:
            tensor = read_small_tensor(info)
        except ValueError as e:
            out.add("vocab.mapping", "error", f"{name} cannot be read: {e}", f"{where}: {name}",
                    "re-export the drafter")
            return
        if name == "d2t":
            d2t = tensor
        else:
            t2d = tensor
    reduced = isinstance(tv, int) and d.draft_vocab < tv
    if d.format == "speculators" and reduced and t2d is None:
        out.add("weights.speculators-t2d", "error", "a speculators-layout drafter with a reduced vocabulary and no "
                "t2d: the speculators library slices the verifier's lm_head with t2d when it loads the drafter, "
                "and without it the load fails (size mismatch for lm_head)",
                f"{where}: no t2d; draft_vocab_size = {d.draft_vocab} < vocab_size = {tv}",
                "re-export it (draftsmith export --format speculators keeps t2d)")
    if d2t is not None:
        if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
            out.add("vocab.mapping", "error", f"d2t has dtype {d2t.dtype}: it holds integer offsets",
                    f"{where}: d2t", "rebuild the draft vocabulary (draftsmith vocab)")
            return
        if d2t.numel() != d.draft_vocab:
            out.add("vocab.mapping", "error", f"d2t has {d2t.numel()} entries, draft_vocab_size is "
                    f"{d.draft_vocab}", f"{where}: d2t {list(d2t.shape)}", "rebuild the draft vocabulary")
            return
        try:
            vocab_mod.validate(d2t, t2d.bool() if t2d is not None else None, tv)
        except vocab_mod.VocabError as e:
            out.add("vocab.mapping", "error", f"d2t/t2d do not describe a valid draft vocabulary: {e}; draft "
                    "tokens would map to the wrong target tokens and acceptance collapses",
                    f"{where}: d2t {list(d2t.shape)}" + (f", t2d {list(t2d.shape)}" if t2d is not None else ""),
                    "rebuild the pair from the capture store (draftsmith vocab) and re-export")
            return
        if engine.name == "vllm" and not reduced:
            out.add("vocab.d2t-full", "error", "a d2t on a full vocabulary: vLLM creates its d2t parameter only "
                    "when draft_vocab_size != vocab_size, so the load fails on it", f"{where}: d2t; config: "
                    f"draft_vocab_size = {d.draft_vocab} = vocab_size", "drop d2t and t2d "
                    "(draftsmith export --format vllm does)", engine_fact=True)
    elif reduced:
        identity = t2d is not None and bool(t2d.bool()[: d.draft_vocab].all()) and int(
            t2d.bool().sum()) == d.draft_vocab
        if t2d is not None and not identity:
            out.add("vocab.missing-d2t", "error", "t2d without d2t: engines read only d2t and assume draft id i "
                    "is target id i, but this t2d keeps other tokens: drafts would be the wrong tokens",
                    f"{where}: t2d present, d2t absent", "write d2t (draftsmith export does)")
        elif t2d is None:
            out.add("vocab.missing-d2t", "warning", f"no d2t: engines assume the draft vocabulary is the first "
                    f"{d.draft_vocab} target ids; a vocabulary of frequent tokens would accept ~nothing",
                    f"{where}: no d2t, no t2d; draft_vocab_size = {d.draft_vocab} < vocab_size = {tv}",
                    "write the d2t the drafter was trained with")


def _raw_name(weights: dict[str, TensorInfo], name: str) -> str:
    return name if name in weights else f"model.{name}"


__all__ = ["SGLANG_DRAFTER_ARCHS", "check_drafter_config", "check_vocab_mapping", "check_weights"]
