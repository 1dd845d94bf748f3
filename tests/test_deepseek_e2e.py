"""The seed's own case end to end: a DeepSeek-V3 / Kimi-K2-structured target, from capture to EAGLE-3 in vLLM.

Fast tests (no marker) check the tiny target's structure, its Kimi-style forms, aux capture from the MoE/MLA
stack and ``draftsmith doctor`` on the pair. The slow ones build a briefly trained tiny target, run the whole
pipeline on it (generate -> capture -> vocab -> train -> export), serve target + drafter in vLLM (CPU) and
compare what vLLM accepts and computes with what draftsmith measured and captured. They drive vLLM in
subprocesses with ``.venv-vllm`` (``make vllm-env``) and are skipped cleanly without it. Numbers and causes are
written up in docs/deepseek-kimi.md.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from draftsmith.model.target import load_target
from draftsmith.testing.models import VLLM_CPU_MLA, as_kimi_k2, save_tiny_deepseek_target, tiny_chat_corpus

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SCRIPTS = Path(__file__).parent / "vllm_scripts"
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=f"no vLLM venv at {VLLM_PYTHON} (make vllm-env)")
HAS_DOCTOR = importlib.util.find_spec("draftsmith.stages.doctor") is not None

# End-to-end sizes: about 4 minutes on 2 busy CPU cores (most of it fitting the target and the drafter).
TARGET_STEPS = 200  # fit the tiny target to tiny_chat_corpus so its greedy answers vary (random: one repeated token)
TRAIN_CONVERSATIONS = 128
EVAL_PROMPTS = 16
NEW_TOKENS = 48
DRAFTER_STEPS = 300
K = 3


def _vllm(script: str, args: dict, timeout: int = 900) -> dict:
    """Run a tests/vllm_scripts script with the vLLM venv; return its one JSON line (stdout's last line)."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
    proc = subprocess.run([str(VLLM_PYTHON), str(SCRIPTS / script), json.dumps(args)], capture_output=True,
                          text=True, timeout=timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"{script} exit {proc.returncode}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


@functools.cache
def _host_has_amx() -> bool:
    """vLLM-CPU 0.32 serves EAGLE-3 with an MLA target only through its AMX_MLA backend (AMX hosts, bf16):
    the other MLA backend, CPU_MLA, keeps KV blocks of 16 tokens and the drafter's CPU attention multiples of 32."""
    proc = subprocess.run([str(VLLM_PYTHON), "-c", "import torch; print(int(torch.cpu._is_amx_tile_supported()))"],
                          capture_output=True, text=True, timeout=120)
    return proc.stdout.strip() == "1"


def _needs_amx() -> None:
    if not _host_has_amx():
        pytest.skip("no AMX on this host: vLLM-CPU 0.32 cannot serve EAGLE-3 with an MLA target here ('No common "
                    "block size ... CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)]'; test_vllm_cpu_constraints checks it)")


def _chat_ids(tok, conversation) -> list[int]:
    text = tok.apply_chat_template(conversation[:1], add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)


# --- fast: the tiny target and its Kimi-style forms -----------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """Random-weight forms (no fitting: seconds): DeepSeek-V3, its kimi_k2 copy, the Kimi-K2.5-style wrapper."""
    root = tmp_path_factory.mktemp("deepseek-tiny")
    ds = save_tiny_deepseek_target(root / "deepseek_v3")
    return {"deepseek_v3": ds, "kimi_k2": as_kimi_k2(ds, root / "kimi_k2"),
            "kimi_k25_wrapper": save_tiny_deepseek_target(root / "kimi_k25_wrapper", "kimi_k25_wrapper")}


def test_tiny_deepseek_target_has_the_real_structure(tiny_dirs):
    path = tiny_dirs["deepseek_v3"]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["model_type"] == "deepseek_v3"
    # MoE: routed + shared experts, group-limited top-k with a sigmoid router and correction bias; dense first
    assert (cfg["n_routed_experts"], cfg["n_shared_experts"], cfg["num_experts_per_tok"]) == (8, 1, 2)
    assert (cfg["n_group"], cfg["topk_group"], cfg["first_k_dense_replace"]) == (2, 1, 1)
    assert cfg["topk_method"] == "noaux_tc" and cfg["scoring_func"] == "sigmoid"  # what vLLM's loader reads
    assert cfg["routed_scaling_factor"] == 2.5 and cfg["norm_topk_prob"] is True
    # MLA, at the latent sizes vLLM's CPU kernels take (kv_lora_rank 512 + rope 64 = 576)
    assert {k: cfg[k] for k in VLLM_CPU_MLA} == VLLM_CPU_MLA
    assert (cfg["q_lora_rank"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]) == (32, 32, 32)
    assert cfg["rope_interleave"] is True and cfg["rope_parameters"]["rope_type"] == "yarn"
    assert cfg["max_position_embeddings"] == cfg["rope_parameters"]["factor"] * 4096  # as in the real config
    w = _weights(path)
    assert "model.layers.0.mlp.gate_proj.weight" in w and "model.layers.0.mlp.gate.weight" not in w  # dense
    for layer in range(1, cfg["num_hidden_layers"]):
        assert f"model.layers.{layer}.mlp.experts.7.down_proj.weight" in w
        assert f"model.layers.{layer}.mlp.shared_experts.up_proj.weight" in w
        assert w[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"].abs().sum() > 0  # steers selection
    assert w["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].shape == (512 + 64, 64)
    assert w["model.layers.1.self_attn.kv_b_proj.weight"].shape == (2 * (32 + 32), 512)
    assert w["model.layers.1.self_attn.q_b_proj.weight"].shape == (2 * (32 + 64), 32)
    # the DeepSeek-V3 tokenizer and chat template
    target = load_target(path)
    text = target.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant",
                                                                                   "content": "yo"}], tokenize=False)
    assert text == "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜>yo<｜end▁of▁sentence｜>"
    assert target.vocab_size == len(target.tokenizer)


def test_aux_capture_from_the_moe_mla_stack_equals_output_hidden_states(tiny_dirs):
    """Aux layers (2, N//2, N-3) = (2, 4, 5) captured by pre-hooks are output_hidden_states[L], exactly (fp32)."""
    for form in ("deepseek_v3", "kimi_k25_wrapper"):
        # Unpacked: oneDNN's prepacked kernels may round differently for differently aligned buffers, and
        # this test compares two routes through the same weights bit for bit.
        target = load_target(tiny_dirs[form], pack=False)
        assert target.aux_layers == (2, 4, 5) and target.config.model_type == "deepseek_v3"
        ids = torch.tensor([_chat_ids(target.tokenizer, c) for c in tiny_chat_corpus(2, seed=5)][:1])
        out = target(ids)
        ref = target.model(input_ids=ids, output_hidden_states=True)
        for layer, aux in zip(target.aux_layers, out.aux_hidden_states, strict=True):
            torch.testing.assert_close(aux, ref.hidden_states[layer], atol=0, rtol=0)
        torch.testing.assert_close(out.hidden_state, ref.hidden_states[-1], atol=0, rtol=0)
    assert target.layers_path == "model.language_model.layers"


def test_kimi_forms(tiny_dirs):
    src, k2 = tiny_dirs["deepseek_v3"], tiny_dirs["kimi_k2"]
    cfg = json.loads((k2 / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k2" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (k2 / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    wrapper = json.loads((tiny_dirs["kimi_k25_wrapper"] / "config.json").read_text())
    assert wrapper["model_type"] == "kimi_k25" and wrapper["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert wrapper["text_config"]["model_type"] == "kimi_k2" and "vision_config" in wrapper
    assert "media_placeholder_token_id" in wrapper
    assert "image_token_index" not in json.dumps(wrapper)  # what older vLLM's EAGLE-3 loader reads
    assert wrapper["text_config"]["kv_lora_rank"] == 512 and wrapper["tie_word_embeddings"] is False


def test_load_target_reads_a_kimi_k2_config(tiny_dirs):
    """transformers does not register kimi_k2; load_target maps it to DeepSeek-V3 as vLLM does, so capture from
    the Kimi-K2 form gives exactly the DeepSeek-V3 form's aux states (same weights)."""
    target = load_target(tiny_dirs["kimi_k2"])
    assert target.config.model_type in ("deepseek_v3", "kimi_k2") and target.aux_layers == (2, 4, 5)
    same = load_target(tiny_dirs["deepseek_v3"])
    ids = torch.tensor([_chat_ids(same.tokenizer, tiny_chat_corpus(1, seed=6)[0])])
    for a, b in zip(target(ids).aux_hidden_states, same(ids).aux_hidden_states, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# --- fast: doctor ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def random_drafter(tiny_dirs, tmp_path_factory):
    from draftsmith.core import vocab as vocab_mod
    from draftsmith.model.drafter import new_drafter
    from draftsmith.stages.export import export_drafter

    root = tmp_path_factory.mktemp("deepseek-drafter")
    target = load_target(tiny_dirs["deepseek_v3"])
    kept = torch.arange(0, target.vocab_size, 2)
    d = new_drafter(target, draft_vocab=vocab_mod.from_target_ids(kept, target.vocab_size))
    d.save(root / "native")
    export_drafter(root / "native", root / "vllm", "vllm", dtype="bf16")
    return root / "vllm"


def _doctor(target: Path, drafter: Path, *extra: str, python: Path | None = None) -> dict:
    argv = ["doctor", "--target", str(target), "--drafter", str(drafter), "--engine", "vllm", "--json", *extra]
    if python is None:  # this environment's doctor: the CLI's main in this process
        import contextlib
        import io

        from draftsmith.cli import main

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
        stdout, stderr = out.getvalue(), err.getvalue()
    else:
        proc = subprocess.run([str(python), "-m", "draftsmith.cli", *argv], capture_output=True, text=True,
                              timeout=120)
        code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    assert code in (0, 1), stderr
    report = json.loads(stdout)
    assert report["exit_code"] == code
    return report


@pytest.mark.skipif(not HAS_DOCTOR, reason="draftsmith.stages.doctor is not written yet")
def test_doctor_finds_nothing_blocking_for_the_pair(tiny_dirs, random_drafter):
    for form in ("deepseek_v3", "kimi_k2"):
        report = _doctor(tiny_dirs[form], random_drafter)  # no vLLM in this venv: its 0.32 facts table
        assert not report["blocking"], report["findings"]


@pytest.mark.skipif(not HAS_DOCTOR, reason="draftsmith.stages.doctor is not written yet")
def test_doctor_reports_both_seed_failures_for_the_wrapper_on_an_older_engine(tiny_dirs, random_drafter):
    report = _doctor(tiny_dirs["kimi_k25_wrapper"], random_drafter, "--engine-version", "0.11")
    errors = {f["id"]: f for f in report["findings"] if f["severity"] == "error"}
    assert report["blocking"] and {"vllm.eagle3-interface", "vllm.multimodal-field"} <= set(errors), errors
    assert "Model does not support EAGLE3 interface" in errors["vllm.eagle3-interface"]["message"]
    assert "image_token_index" in errors["vllm.multimodal-field"]["message"]
    assert "media_placeholder_token_id" in errors["vllm.multimodal-field"]["evidence"]
    assert not _doctor(tiny_dirs["kimi_k25_wrapper"], random_drafter)["blocking"]  # vLLM 0.32 facts: fine


# --- slow: the pipeline ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    """Target -> generate -> capture (+ vocab) -> train -> export, and draftsmith's own acceptance. ~3 min."""
    from draftsmith.model.drafter import load_drafter
    from draftsmith.stages.capture import CaptureConfig, run_capture
    from draftsmith.stages.decode import ChainSpec, SpeculativeDecoder
    from draftsmith.stages.export import export_drafter
    from draftsmith.stages.generate import GenerateConfig, generate
    from draftsmith.stages.train import load_config, train

    root = tmp_path_factory.mktemp("deepseek-e2e")
    seconds = {}
    t = time.perf_counter()
    target_dir = save_tiny_deepseek_target(root / "target", train_steps=TARGET_STEPS)
    kimi_dir = as_kimi_k2(target_dir, root / "kimi-k2")
    seconds["target"] = time.perf_counter() - t

    t = time.perf_counter()
    with open(root / "prompts.jsonl", "w") as f:
        for i, conv in enumerate(tiny_chat_corpus(TRAIN_CONVERSATIONS, seed=1)):
            f.write(json.dumps({"id": f"train-{i}", "messages": conv[:1]}) + "\n")
    summary = generate(GenerateConfig(out=root / "conversations.jsonl", input=root / "prompts.jsonl",
                                      target=str(target_dir), max_new_tokens=NEW_TOKENS, batch_size=16,
                                      progress=False))
    assert summary.done == TRAIN_CONVERSATIONS and summary.error == 0, summary
    seconds["generate"] = time.perf_counter() - t

    t = time.perf_counter()
    capture = run_capture(CaptureConfig(conversations=root / "conversations.jsonl", out=root / "store",
                                        target=str(target_dir), draft_vocab_size=256, progress=False))
    seconds["capture"] = time.perf_counter() - t

    t = time.perf_counter()
    cfg = load_config(None, dict(target=str(target_dir), store=str(root / "store"), out=str(root / "run"),
                                 max_steps=DRAFTER_STEPS, ttt_steps=3, batch_tokens=1024, lr=3e-3, warmup_steps=10,
                                 eval_every=50, save_every=100, progress=False, plot=False))
    result = train(cfg)
    seconds["train"] = time.perf_counter() - t
    export = export_drafter(root / "run" / "best", root / "drafter-vllm", "vllm", dtype="bf16")

    # draftsmith's own acceptance on held-out prompts, the target in fp32 as at capture
    t = time.perf_counter()
    target = load_target(target_dir)
    tok = target.tokenizer
    drafter = load_drafter(root / "run" / "best", target)
    prompts = [_chat_ids(tok, c) for c in tiny_chat_corpus(EVAL_PROMPTS, seed=2)]
    decoder = SpeculativeDecoder(target, drafter, ChainSpec(K))
    runs = [decoder.generate(p, NEW_TOKENS, eos_token_ids=[tok.eos_token_id]) for p in prompts]
    seconds["draftsmith_decode"] = time.perf_counter() - t
    accepted = sum(sum(r.accepted_per_step) for r in runs)
    drafted = sum(sum(r.drafted_per_step) for r in runs)
    steps = sum(len(r.accepted_per_step) for r in runs)
    return dict(
        root=root, target_dir=target_dir, kimi_dir=kimi_dir, drafter_dir=root / "drafter-vllm", target=target,
        prompts=prompts, eos=tok.eos_token_id, capture=capture, train=result, export=export, seconds=seconds,
        draftsmith=dict(accepted=accepted, drafted=drafted, drafts=steps, rate=accepted / drafted,
                        tau=1 + accepted / steps, tokens=[r.token_ids for r in runs],
                        per_pos=[sum(r.accepted_per_position(K)[i] for r in runs) for i in range(K)]),
    )


def _record(e2e, name: str, value) -> None:
    """Numbers for docs/deepseek-kimi.md: printed (pytest -s) and kept next to the run's artefacts."""
    path = e2e["root"] / "numbers.json"
    numbers = json.loads(path.read_text()) if path.is_file() else {}
    numbers[name] = value
    path.write_text(json.dumps(numbers, indent=2, default=str))
    print(f"\n[deepseek-e2e] {name}: {json.dumps(value, default=str)}")


@pytest.mark.slow
def test_pipeline_captures_the_moe_mla_stack_and_trains_a_drafter(e2e):
    from draftsmith.data.store import FeatureStore

    cap, target = e2e["capture"], e2e["target"]
    assert cap.counts.captured == TRAIN_CONVERSATIONS
    store = FeatureStore(e2e["root"] / "store", out_dtype=torch.float32)
    assert store.meta["aux_layer_ids"] == [2, 4, 5] and store.num_aux == 3
    # Stored aux states (bf16) are output_hidden_states[L] of an unbatched fp32 pass, to bf16 rounding.
    for i in (0, len(store) - 1):
        s = store[i]
        ref = target.model(input_ids=s["input_ids"][None], output_hidden_states=True).hidden_states
        for j, layer in enumerate((2, 4, 5)):
            want = ref[layer][0]
            err = (s["aux_hidden_states"][:, j] - want).norm(dim=-1) / want.norm(dim=-1)
            assert err.max() < 5e-3, (layer, err.max())
        err = (s["hidden_state"] - ref[-1][0]).norm(dim=-1) / ref[-1][0].norm(dim=-1)
        assert err.max() < 5e-3
    assert (e2e["root"] / "store" / "vocab.safetensors").is_file()
    assert json.loads((e2e["drafter_dir"] / "config.json").read_text())["draft_vocab_size"] == 256
    ds = e2e["draftsmith"]
    _record(e2e, "seconds", e2e["seconds"])
    _record(e2e, "capture", {k: cap.to_dict()[k] for k in ("tokens", "loss_tokens", "bytes_per_token", "vocab")})
    _record(e2e, "train", {"best_simulated_tau": e2e["train"].best_simulated_acceptance_length,
                           "last_eval": e2e["train"].last_eval})
    _record(e2e, "draftsmith_fp32", {k: v for k, v in ds.items() if k != "tokens"})
    assert ds["rate"] > 0.4 and ds["tau"] > 2.0, ds  # the drafter accepts tokens (random drafter: ~0)


@pytest.mark.slow
@needs_vllm
@pytest.mark.skipif(not HAS_DOCTOR, reason="draftsmith.stages.doctor is not written yet")
def test_doctor_against_the_installed_vllm(e2e):
    """doctor run in the vLLM venv reads the installed vLLM's source: nothing blocks the trained pair."""
    for target in (e2e["target_dir"], e2e["kimi_dir"]):
        report = _doctor(target, e2e["drafter_dir"], python=VLLM_PYTHON)
        assert report["engine_source"] == "installed here" and report["engine_version"].startswith("0.32"), report
        assert not report["blocking"], report["findings"]
        _record(e2e, f"doctor_installed_vllm_{target.name}", [f"{f['severity']} {f['id']}" for f in report["findings"]])


@pytest.mark.slow
@needs_vllm
def test_vllm_serves_target_and_drafter_and_accepts_like_draftsmith(e2e):
    """vLLM (CPU, bf16) serves the kimi_k2 form of the target with the exported drafter, EAGLE-3 chain of 3.

    Tolerance: |acceptance rate (accepted / drafted) - draftsmith's| <= 0.10 and |tau difference| <= 0.30.
    vLLM's CPU path runs EAGLE-3 with this target only in bf16 (see test_vllm_cpu_constraints), draftsmith
    runs the target in fp32 as at capture. bf16 moves the target's states ~1% per token and flips the expert
    selection of a few tokens (see test_engine_states_match_capture), so the greedy paths of a few prompts
    differ and the two engines measure partly different sequences; with ~500 drafted tokens the sampling error
    of the rate alone is ~0.02 (binomial). Measured: draftsmith 0.649, vLLM 0.649 (another data arrangement:
    0.624 and 0.585). Lossless: the speculative output is vLLM's plain greedy output (bf16) on every prompt.
    """
    _needs_amx()
    args = {"target": str(e2e["kimi_dir"]), "prompts": e2e["prompts"], "max_tokens": NEW_TOKENS,
            "stop_token_ids": [e2e["eos"]], "dtype": "bfloat16"}
    res = _vllm("deepseek_serve.py", {**args, "drafter": str(e2e["drafter_dir"]), "k": K})
    assert res["ok"], res
    plain = _vllm("deepseek_serve.py", args)
    assert plain["ok"], plain
    assert res["tokens"] == plain["tokens"]
    assert res["aux_layers"] == [2, 4, 5]  # read off the served target: the drafter's ids, literally
    m = res["metrics"]
    drafts, drafted = m["vllm:spec_decode_num_drafts"], m["vllm:spec_decode_num_draft_tokens"]
    accepted = m["vllm:spec_decode_num_accepted_tokens"]
    vllm = {"accepted": accepted, "drafted": drafted, "drafts": drafts, "rate": accepted / drafted,
            "tau": 1 + accepted / drafts, "per_pos": m["vllm:spec_decode_num_accepted_tokens_per_pos"],
            "same_output_as_draftsmith_fp32": sum(a == b for a, b in zip(res["tokens"], e2e["draftsmith"]["tokens"],
                                                                         strict=True)),
            "prompts": len(res["tokens"]), "load_s": res["load_s"], "generate_s": res["generate_s"]}
    _record(e2e, "vllm_bf16", vllm)
    ds = e2e["draftsmith"]
    assert accepted > 0 and vllm["rate"] > 0.3, vllm
    assert abs(vllm["rate"] - ds["rate"]) <= 0.10, (vllm, ds)
    assert abs(vllm["tau"] - ds["tau"]) <= 0.30, (vllm, ds)
    assert vllm["per_pos"][0] >= vllm["per_pos"][1] >= vllm["per_pos"][2]


# --- slow: what the engine computes vs what was captured ---------------------------------------------------------
def _route(logits: torch.Tensor, bias: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids DeepSeek-V3's router picks from router logits (sigmoid + correction bias, group-limited top-k,
    as transformers and vLLM's CPU router compute it), and each token's margin to the nearest flip."""
    e, g = logits.shape[-1], cfg["n_group"]
    s = logits.float().sigmoid() + bias
    group = s.view(-1, g, e // g).topk(2, dim=-1)[0].sum(-1)
    keep = torch.zeros_like(group).scatter_(1, group.topk(cfg["topk_group"], dim=-1)[1], 1).bool()
    s = s.masked_fill(~keep.repeat_interleave(e // g, dim=1), float("-inf"))
    top = s.topk(cfg["num_experts_per_tok"] + 1, dim=-1)[0]
    ranked = group.sort(dim=-1, descending=True)[0]
    margin = torch.minimum(top[:, -2] - top[:, -1], ranked[:, cfg["topk_group"] - 1] - ranked[:, cfg["topk_group"]])
    return s.topk(cfg["num_experts_per_tok"], dim=-1)[1].sort(-1)[0], margin


def _compare(target_dir: Path, prompts, run: dict, states_file: Path) -> dict:
    """transformers (fp32, teacher-forced on the engine's own tokens) vs what vLLM computed, per layer."""
    from transformers import AutoModelForCausalLM

    cfg = json.loads((target_dir / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    hf_router: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(lambda m, a, o, i=i: hf_router.__setitem__(i, o[0].detach()))
    saved = torch.load(states_file)
    n = cfg["num_hidden_layers"]
    rel = [0.0] * n
    dlogprob, agree, total, flips, routed, flip_margins, margins = 0.0, 0, 0, 0, 0, [], []
    first_margins: list[float] = []
    for p, gen, lps, states, router in zip(prompts, run["tokens"], run["logprobs"], saved["states"],
                                           saved["router_logits"], strict=True):
        seq = p + gen
        with torch.no_grad():
            out = model(input_ids=torch.tensor([seq[:-1]]), output_hidden_states=True)
        length = len(seq) - 1
        for layer in range(n):  # hidden_states[L] = the residual stream entering layer L (aux state L)
            want, got = out.hidden_states[layer][0], states[layer][:length]
            rel[layer] = max(rel[layer], ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item())
        lp = torch.log_softmax(out.logits[0].double(), -1)
        hf_lp = lp[torch.arange(length), torch.tensor(seq[1:])]
        dlogprob = max(dlogprob, (hf_lp - torch.tensor(lps, dtype=torch.float64)).abs().max().item())
        agree += int((lp.argmax(-1)[len(p) - 1:] == torch.tensor(gen)).sum())
        total += len(gen)
        where = []  # (token, layer, margin) of each flip in this sequence
        for i, logits in router.items():
            bias = model.model.layers[i].mlp.gate.e_score_correction_bias.float()
            mine, margin = _route(hf_router[i][:length], bias, cfg)
            theirs, _ = _route(logits[:length], bias, cfg)
            flipped = (mine != theirs).any(-1)
            flips += int(flipped.sum())
            routed += length
            flip_margins += margin[flipped].tolist()
            margins += margin.tolist()
            where += [(t, i, margin[t].item()) for t in flipped.nonzero().flatten().tolist()]
        # a flip at (t, L) is a first flip when no flip at an earlier layer of token t or of a token before it
        # (through attention) had already changed what layer L of token t reads; later ones are consequences
        first_margins += [m for t, i, m in where if not any(t2 <= t and i2 < i for t2, i2, _ in where)]
    margins.sort()
    return {"max_rel_state_error_per_layer": [float(f"{x:.3g}") for x in rel],
            "max_abs_logprob_diff": float(f"{dlogprob:.3g}"), "greedy_agreement": f"{agree}/{total}",
            "routing_flips": f"{flips}/{routed}", "max_margin_at_flip": max(flip_margins, default=None),
            "first_flips": len(first_margins), "max_margin_at_first_flip": max(first_margins, default=None),
            "median_margin": margins[len(margins) // 2] if margins else None}


def _variant(src: Path, dst: Path, **edits) -> Path:
    """A copy of a target directory with config.json fields changed (None: removed)."""
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in edits.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


@pytest.mark.slow
@needs_vllm
def test_engine_states_match_capture(e2e):
    """vLLM's states vs transformers' (the capture) for the same tokens, and the cause of fp32 differences.

    * fp32 (CPU_MLA) with a config that says what transformers computes: rounding only (~1e-6).
    * bf16 (AMX_MLA or CPU_MLA; the only dtype EAGLE-3 runs in here): ~1% per token, more on the few
      tokens whose expert selection flips: first near-ties (router logits in bf16), then tokens that
      read a flipped token's changed output.
    * The same weights with config fields vLLM reads differently from transformers (both fp32):
      ``scoring_func`` absent (vLLM: softmax routing; transformers: always sigmoid) and
      ``rope_interleave: false`` (vLLM's MLA always applies interleaved rope): 1e-2-level differences.
    """
    root, target_dir = e2e["root"], e2e["target_dir"]
    no_scoring = _variant(target_dir, root / "variant-no-scoring-func", scoring_func=None)
    neox_rope = _variant(target_dir, root / "variant-rope-not-interleaved", rope_interleave=False)
    prompts = e2e["prompts"][:4]
    runs = [("fp32", target_dir, "float32", "CPU_MLA"), ("bf16", target_dir, "bfloat16", None),
            ("fp32_no_scoring_func", no_scoring, "float32", "CPU_MLA"),
            ("fp32_rope_interleave_false", neox_rope, "float32", "CPU_MLA")]
    res = _vllm("deepseek_states.py", {"prompts": prompts, "max_tokens": 32, "runs": [
        {"target": str(d), "dtype": dt, "attention_backend": be, "out": str(root / f"states-{name}.pt")}
        for name, d, dt, be in runs]})
    out = {}
    for (name, d, _, _), run in zip(runs, res["runs"], strict=True):
        assert run["ok"], (name, run)
        out[name] = _compare(d, prompts, run, root / f"states-{name}.pt")
    _record(e2e, "engine_vs_capture", out)
    fp32, bf16 = out["fp32"], out["bf16"]
    assert max(fp32["max_rel_state_error_per_layer"]) < 1e-4 and fp32["max_abs_logprob_diff"] < 1e-4, fp32
    assert fp32["routing_flips"].startswith("0/")
    assert max(bf16["max_rel_state_error_per_layer"][:2]) < 5e-2, bf16  # before routing flips compound
    flips = int(bf16["routing_flips"].split("/")[0])
    # only near-ties flip first (the rest follow from a first flip's changed output); how near depends on the
    # CPU's bf16 kernels, so the bound is loose
    assert flips == 0 or bf16["max_margin_at_first_flip"] < 1e-2, bf16
    no_sf = out["fp32_no_scoring_func"]["max_rel_state_error_per_layer"]
    assert no_sf[1] < 1e-4 < 1e-3 < no_sf[2]  # layer 0 dense, layer 1 the first MoE layer: differs from there
    assert out["fp32_no_scoring_func"]["max_abs_logprob_diff"] > 1e-3
    assert out["fp32_no_scoring_func"]["max_margin_at_first_flip"] > 1e-2  # another router: not near-ties
    assert out["fp32_rope_interleave_false"]["max_rel_state_error_per_layer"][1] > 1e-3  # attention of layer 0


@pytest.mark.slow
@needs_vllm
def test_acceptance_loss_when_the_engine_routes_differently(e2e):
    """The same drafter served against the same weights whose config.json lacks ``scoring_func``: vLLM routes
    with softmax while the features were captured with transformers' sigmoid router. Acceptance drops."""
    _needs_amx()
    variant = e2e["root"] / "variant-no-scoring-func"
    if not variant.is_dir():
        _variant(e2e["target_dir"], variant, scoring_func=None)
    res = _vllm("deepseek_serve.py", {"target": str(variant), "drafter": str(e2e["drafter_dir"]),
                                      "prompts": e2e["prompts"], "max_tokens": NEW_TOKENS, "k": K,
                                      "stop_token_ids": [e2e["eos"]], "dtype": "bfloat16"})
    assert res["ok"], res
    m = res["metrics"]
    rate = m["vllm:spec_decode_num_accepted_tokens"] / m["vllm:spec_decode_num_draft_tokens"]
    same = sum(a == b for a, b in zip(res["tokens"], e2e["draftsmith"]["tokens"], strict=True))
    _record(e2e, "vllm_bf16_no_scoring_func", {
        "accepted": m["vllm:spec_decode_num_accepted_tokens"], "drafted": m["vllm:spec_decode_num_draft_tokens"],
        "drafts": m["vllm:spec_decode_num_drafts"], "rate": rate,
        "tau": 1 + m["vllm:spec_decode_num_accepted_tokens"] / m["vllm:spec_decode_num_drafts"],
        "per_pos": m["vllm:spec_decode_num_accepted_tokens_per_pos"], "same_output_as_draftsmith_fp32": same})
    assert rate < e2e["draftsmith"]["rate"] - 0.05, (rate, e2e["draftsmith"]["rate"])


@pytest.mark.slow
@needs_vllm
def test_vllm_cpu_constraints(e2e, tmp_path):
    """vLLM's CPU path for this architecture, checked one by one (each case builds an engine; ~40 s in all)."""
    small = save_tiny_deepseek_target(tmp_path / "small-latent", vllm_cpu=False)  # kv_lora_rank 32, rope 16
    no_topk = _variant(e2e["target_dir"], tmp_path / "no-topk-method", topk_method=None)
    d, drafter = e2e["target_dir"], str(e2e["drafter_dir"])
    cases = [
        {"name": "no_topk_method", "target": str(no_topk), "dtype": "bfloat16"},
        {"name": "small_latent", "target": str(small), "dtype": "bfloat16"},
        {"name": "fp32_default_backend", "target": str(d), "dtype": "float32"},
        {"name": "fp32_cpu_mla", "target": str(d), "dtype": "float32", "attention_backend": "CPU_MLA"},
        {"name": "fp32_eagle3", "target": str(d), "dtype": "float32", "attention_backend": "CPU_MLA",
         "drafter": drafter},
        {"name": "bf16_eagle3", "target": str(d), "dtype": "bfloat16", "drafter": drafter},
        {"name": "bf16_eagle3_cpu_mla", "target": str(d), "dtype": "bfloat16", "attention_backend": "CPU_MLA",
         "drafter": drafter},
    ]
    out = _vllm("deepseek_constraints.py", {"cases": cases})
    res, amx = {c["name"]: c for c in out["cases"]}, out["host"]["amx"]
    _record(e2e, "vllm_cpu_constraints", {"host": out["host"], **res})
    # the DeepSeek loader builds e_score_correction_bias only for topk_method noaux_tc
    assert not res["no_topk_method"]["ok"] and "e_score_correction_bias" in res["no_topk_method"]["error"]
    # CPU MLA kernels: latent cache kv_lora_rank + qk_rope_head_dim must be 512 + 64
    assert not res["small_latent"]["ok"] and "not supported by MLA" in res["small_latent"]["error"]
    # fp32: AMX hosts pick AMX_MLA (bf16 weights only) unless CPU_MLA is asked for; CPU_MLA takes fp32
    default = res["fp32_default_backend"]
    if amx:
        assert not default["ok"] and "expect weight to be bfloat16" in default["error"], default
    else:
        assert default["ok"], default
    assert res["fp32_cpu_mla"]["ok"], res["fp32_cpu_mla"]
    # EAGLE-3: CPU_MLA keeps KV blocks of 16 tokens only, the drafter's CPU attention multiples of 32, so it
    # runs only with AMX_MLA: on AMX hosts, in bf16
    for name in ("fp32_eagle3", "bf16_eagle3_cpu_mla"):
        assert not res[name]["ok"] and "No common block size" in res[name]["error"], res[name]
    bf16 = res["bf16_eagle3"]
    assert bf16["ok"] if amx else "No common block size" in bf16.get("error", ""), bf16
