"""What OpenVINO GenAI's EAGLE-3 support reads, and how its conventions differ from draftsmith's.

Checked against PyPI ``openvino-genai==2026.4.1.0`` with ``optimum-intel==2.2.0`` (its exporter builds the draft
IR) and their sources (openvino.genai ``src/cpp/src/speculative_decoding/eagle3_model_transforms.cpp``,
``llm/pipeline.cpp``, ``sampling/sampler.cpp``; optimum-intel ``exporters/openvino/model_patcher.py`` ``LlamaEagle3*``):
  * the draft IR carries rt_info ``eagle3_mode`` (written by optimum-intel) and, optionally, ``hidden_layers_list``
    (never written by optimum-intel). ``draft_model()`` reads both from the IR's rt_info as ``std::vector<int>``;
    passed from Python the list is refused ("hidden_layers_list must be a vector of int32_t values"), so the IR
    is where it goes. Absent: GenAI taps ``[2, N/2, N-3]`` in its own numbering.
  * GenAI's id ``i`` taps the residual Add that ends target layer ``i`` (the node named ``layers.i/`` whose second
    input is the MLP's down projection): the *output* of layer ``i``, Hugging Face ``hidden_states[i+1]``.
    draftsmith's id ``L`` is the *input* of layer ``L`` (``hidden_states[L]``). So GenAI's list is draftsmith's
    ids minus one (SGLang's convention); id 0 (the embedding output) cannot be expressed. Exactly 3 ids.
    Unfixed, a drafter trained on draftsmith's (2, N/2, N-3) is served one layer deep: it runs and accepts less.
  * ``d2t`` is an int64 Constant feeding a Result named ``d2t``; the sampler maps draft id ``i`` to ``i + d2t[i]``
    (offsets, draftsmith's convention). ``fc`` is moved from the draft into the target; the draft's embedding
    is replaced by a copy of the target's.
  * optimum-intel's ``LlamaEagle3DecoderLayer`` takes the residual before ``hidden_norm`` (``norm_before_residual``
    false) and has none of the EAGLE-3.1 norms: a drafter trained with any of them exports and serves without
    them, silently.
  * on CPU the speculative pipeline is the continuous-batching one (paged KV cache). With f32 compute, a tree
    (``tree_depth``/``branching_factor``) over the default f16 KV cache gave 0/5 outputs equal to plain. A u8 KV
    cache (``KV_CACHE_PRECISION``) is not lossless either: on 6 MT-bench first turns (64 tokens, SmolLM2 fp32)
    chain k=2 and tree 3,2,6 each equalled plain on 4/6 over u8 and on 6/6 over f32, while plain and GenAI's
    continuous-batching plain agreed 6/6 over both. In bf16 nothing matched plain token for token.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterable

from draftsmith.core.conventions import ConventionError

N_AUX = 3
RT_EAGLE3_MODE = "eagle3_mode"
RT_HIDDEN_LAYERS = "hidden_layers_list"
DRAFT_XML = "openvino_model.xml"

# Drafter switches optimum-intel's EAGLE-3 graph does not implement: exported and served without them.
UNREAD_SWITCHES = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")

# The pipeline properties bench and check decode with: f32 compute (bf16 matched plain nowhere), and the one KV
# cache precision that kept speculative output equal to plain (f16 broke every tree output, u8 a third of them).
INFERENCE_PRECISION = "f32"
LOSSLESS_KV_PRECISIONS = ("f32",)
DEFAULT_KV_PRECISION = "f32"

# Hugging Face model types whose decoder layer ends in the gated MLP GenAI's tap pattern looks for.
TAPPABLE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe"})


def to_genai_layer_ids(ids: Iterable[int]) -> list[int]:
    """draftsmith ids (input of layer L) -> GenAI's ``hidden_layers_list`` (output of layer L-1)."""
    ids = [int(i) for i in ids]
    if len(ids) != N_AUX:
        raise ConventionError(f"OpenVINO GenAI taps exactly {N_AUX} target layers; this drafter reads {len(ids)} "
                              f"({ids})")
    if any(i < 1 for i in ids):
        raise ConventionError(f"aux layer ids {ids} include layer 0 (the embedding output), which GenAI cannot tap "
                              "(its ids name the output of a decoder layer)")
    return [i - 1 for i in ids]


def from_genai_layer_ids(ids: Iterable[int]) -> list[int]:
    return [int(i) + 1 for i in ids]


def genai_default_layer_ids(num_layers: int) -> list[int]:
    """What GenAI taps when the IR names no list, in its own numbering (``[2, N/2, N-3]``)."""
    return [2, num_layers // 2, num_layers - 3]


def _model_rt_info(root: ET.Element) -> ET.Element:
    if root.tag != "net":
        raise ConventionError(f"not an OpenVINO IR (root element <{root.tag}>, expected <net>)")
    rt = root.find("rt_info")
    if rt is None:
        rt = ET.SubElement(root, "rt_info")
    return rt


def read_rt_info(xml_text: str) -> dict[str, str]:
    """The IR's model-level rt_info as name -> value (nested sections left out)."""
    rt = _model_rt_info(ET.fromstring(xml_text))
    return {child.tag: child.get("value") for child in rt if child.get("value") is not None}


def read_hidden_layers(xml_text: str) -> list[int] | None:
    value = read_rt_info(xml_text).get(RT_HIDDEN_LAYERS)
    return None if value is None else [int(x) for x in value.replace(",", " ").split()]


def with_hidden_layers(xml_text: str, genai_ids: Iterable[int]) -> str:
    """The IR text with rt_info ``hidden_layers_list`` set (replaced if present), as GenAI's reader parses a vector of
    ints: the numbers separated by spaces. The rest of the IR is written back unchanged in content."""
    ids = [int(i) for i in genai_ids]
    root = ET.fromstring(xml_text)
    rt = _model_rt_info(root)
    if rt.find(RT_EAGLE3_MODE) is None:
        raise ConventionError(f"the IR has no rt_info {RT_EAGLE3_MODE}: not an EAGLE-3 draft model as optimum-intel "
                              "exports it")
    for old in rt.findall(RT_HIDDEN_LAYERS):
        rt.remove(old)
    node = ET.SubElement(rt, RT_HIDDEN_LAYERS)
    node.set("value", " ".join(str(i) for i in ids))
    return '<?xml version="1.0"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def without_hidden_layers(xml_text: str) -> str:
    """The IR text with no rt_info ``hidden_layers_list``: the draft as optimum-intel writes it (GenAI then taps its
    default list)."""
    root = ET.fromstring(xml_text)
    rt = _model_rt_info(root)
    for old in rt.findall(RT_HIDDEN_LAYERS):
        rt.remove(old)
    return '<?xml version="1.0"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def unread_switches(switches: dict) -> list[str]:
    """The drafter switches that are on but that the exported graph does not implement."""
    return [name for name in UNREAD_SWITCHES if bool(switches.get(name))]


def kv_cache_precision(tree: bool, requested: str | None = None) -> str:
    """The KV cache precision to decode with: the one asked for, else f32. A tree over f16 is refused: every output
    was wrong (u8 loses some; chains over f16 are allowed where asked for, as GenAI's default)."""
    precision = requested or DEFAULT_KV_PRECISION
    if tree and precision == "f16":
        raise ConventionError(f"a tree over an {precision} KV cache gives wrong output in OpenVINO GenAI 2026.4 "
                              f"(0/5 equal to plain); use {' or '.join(LOSSLESS_KV_PRECISIONS)}")
    return precision
