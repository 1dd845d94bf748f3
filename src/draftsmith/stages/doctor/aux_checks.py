"""Aux-layer checks: which target layers the engine will feed the drafter, against the target's depth, the
layers the drafter was trained on and the width of its fusion layer.

draftsmith and vLLM number an aux layer L as the residual stream entering layer L; SGLang's ``eagle_config``
ids are one lower (its loader adds one).
"""

from __future__ import annotations

from draftsmith.core.conventions import default_aux_layers, from_sglang_layer_ids
from draftsmith.stages.doctor.report import Findings
from draftsmith.stages.doctor.state import DrafterFiles, EngineFacts, TargetFiles


def check_aux_layers(out: Findings, engine: EngineFacts, t: TargetFiles, d: DrafterFiles) -> None:
    """The aux layer ids the engine will read, against the target's depth and the ids the drafter was trained on."""
    n = t.num_layers
    if not isinstance(n, int):
        return

    c = d.cfg
    top = [int(i) for i in c.get("eagle_aux_hidden_state_layer_ids") or []]
    nested_raw = [int(i) for i in (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []]
    nested = from_sglang_layer_ids(nested_raw)
    default = list(default_aux_layers(n)) if n >= 3 else []
    ours = (d.raw.get("draftsmith") or {}).get("aux_layer_convention") == "input_of_layer"
    where = "drafter config.json"
    if top and nested and top != nested:
        if top == nested_raw:
            msg = (f"eagle_aux_hidden_state_layer_ids {top} and eagle_config's {nested_raw} are the same numbers "
                   f"in two conventions (vLLM reads the first as input of layer L, SGLang adds one to the "
                   f"second): one of them is off by one")
        else:
            msg = f"top-level aux ids {top} and eagle_config's {nested_raw} (= input of layers {nested}) disagree"
        out.add("aux.conflict", "error", msg, f"{where}: eagle_aux_hidden_state_layer_ids = {top}; "
                f"eagle_config.eagle_aux_hidden_state_layer_ids = {nested_raw}",
                "keep the ids the drafter was trained on: top-level = input-of-layer ids, eagle_config = the "
                "same minus one (draftsmith export writes both)")
        trained = top
    else:
        trained = top or nested
    out.facts["aux_layer_ids"] = trained or None
    # What the engine will actually read.
    if engine.name == "vllm":
        read, how = (top, "top-level eagle_aux_hidden_state_layer_ids, literally") if top else (
            (nested_raw, "eagle_config's ids, literally (vLLM does not add one)") if nested_raw else
            (default, f"none in the drafter: the target's default {default}"))
    elif engine.name == "sglang":
        read, how = (nested, "eagle_config's ids plus one") if nested_raw else (
            default, f"no eagle_config ids: the target's default {default} (SGLang ignores the top-level field)")
    else:
        read, how = (top, "top-level ids") if top else ((nested, "eagle_config's ids plus one") if nested else (
            default, f"none in the drafter: the target's default {default}"))
    out.facts["aux_layer_ids_read_by_engine"] = read
    bad = [i for i in read if not 0 <= i < n]
    if bad:
        out.add("aux.range", "error", f"aux layer ids {bad} are outside the target's {n} layers (valid: "
                f"0..{n - 1}, id L = the residual stream entering layer L)", f"{where}: {how} -> {read}",
                "train the drafter for this target, or fix the ids to the layers it was trained on")
    if len(set(read)) != len(read):
        out.add("aux.range", "error", f"aux layer ids {read} repeat a layer", f"{where}: {how}",
                "list distinct layers")
    if trained and read != trained and not bad:
        out.add("aux.engine-convention", "error", f"{engine.name} reads {read} ({how}) but the drafter was "
                f"trained on {trained} (input of layer L): every aux state comes from the wrong layer and "
                "acceptance collapses", f"{where}: eagle_aux_hidden_state_layer_ids = {top or None}; "
                f"eagle_config ids = {nested_raw or None}", "draftsmith export --format "
                f"{'vllm' if engine.name == 'vllm' else 'sglang'} writes the ids in {engine.name}'s convention",
                engine_fact=engine.name == "vllm")
    elif not trained:
        out.add("aux.unknown", "info", f"the drafter records no aux layer ids: {engine.name} uses the target's "
                f"default {default}", f"{where}: no eagle_aux_hidden_state_layer_ids",
                "record the ids the drafter was trained on (draftsmith import --aux-layers)")
    if trained and default and not ours and from_sglang_layer_ids(trained) == default:
        out.add("aux.off-by-one", "warning", f"the ids {trained} are each one below the default {default}: "
                "they look like SGLang's output-of-layer ids written where input-of-layer ids belong",
                f"{where}: aux ids {trained} for a {n}-layer target",
                f"if the drafter was trained on the default layers, write {default} at the top level and "
                f"{trained} in eagle_config")
    # The fusion width: how many aux states fc takes, against what the engine will feed it.
    fc = d.names.get("fc.weight")
    th = d.target_hidden
    if fc is not None and len(fc.shape) == 2 and isinstance(th, int) and th > 0:
        k, rem = divmod(fc.shape[1], th)
        if rem:
            out.add("aux.count", "error", f"fc.weight takes {fc.shape[1]} inputs, not a multiple of "
                    f"target_hidden_size {th}", f"{d.weights_file}: fc.weight {list(fc.shape)}",
                    "re-export the drafter with the right target_hidden_size")
            return
        if read and len(read) != k:
            out.add("aux.count", "error", f"fc.weight fuses {k} aux states but {engine.name} will feed "
                    f"{len(read)} ({read})", f"{d.weights_file}: fc.weight {list(fc.shape)}; {how}",
                    "record the aux ids the drafter was trained on")
        if engine.name == "vllm":
            vk = c.get("num_aux_hidden_states") or (len(nested_raw) if nested_raw else 3)
            if vk != k:
                out.add("aux.count", "error", f"vLLM sizes the drafter's fc for {vk} aux states "
                        "(num_aux_hidden_states, else eagle_config's id count, else 3), the weights fuse "
                        f"{k}", f"{where}: num_aux_hidden_states = {c.get('num_aux_hidden_states')}",
                        f'add "num_aux_hidden_states": {k}', engine_fact=True)


__all__ = ["check_aux_layers"]
