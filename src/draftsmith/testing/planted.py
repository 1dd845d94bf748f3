"""Known silent faults built into an otherwise good export (issue 52): a GGUF for llama.cpp, an HF folder for vLLM.

Each fault is one the 2026 user reports name: a norm stripped, aux ids one off, d2t dropped or in the other
convention, norm_before_residual dropped, a wrong draft vocabulary. The card (drafter_card.json, README.md) is
copied unchanged: it says what was trained, the files say otherwise.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

GGUF_FAULTS = ("aux-ids-plus-1", "d2t-offsets", "d2t-dropped", "norm-before-residual-flipped", "d2t-shuffled")
HF_FAULTS = ("norm-output-stripped", "aux-ids-minus-1", "d2t-dropped", "d2t-absolute",
             "norm-before-residual-dropped", "d2t-shuffled")


def _copy_card(src_dir: Path, dst_dir: Path) -> None:
    for name in ("README.md", "drafter_card.json"):
        if (src_dir / name).is_file():
            shutil.copy(src_dir / name, dst_dir / name)


def _shuffled(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Another draft vocabulary of the same size: the kept ids shifted to their neighbours (sorted, unique)."""
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[: ids.numel()]
    return perm.sort().values.to(ids.dtype)


def plant_gguf(src: str | Path, dst_dir: str | Path, fault: str) -> Path:
    """A copy of the drafter GGUF ``src`` with ``fault``, as ``dst_dir/drafter.gguf`` (and the card beside it)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    from draftsmith.core import llamacpp_facts as facts
    from draftsmith.core.gguf_file import open_gguf
    from draftsmith.stages.export.gguf import copy_field

    if fault not in GGUF_FAULTS:
        raise ValueError(f"unknown fault {fault!r}")
    src, dst_dir = Path(src), Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    dst = dst_dir / "drafter.gguf"
    r = open_gguf(src)
    w = GGUFWriter(dst, r.fields["general.architecture"].contents())
    vocab = len(r.fields["tokenizer.ggml.tokens"].contents()) if "tokenizer.ggml.tokens" in r.fields else None
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if fault == "aux-ids-plus-1" and name in (facts.KEY_TARGET_LAYERS, facts.KEY_TARGET_LAYERS_EARLY):
            w.add_array(name, [int(i) + 1 for i in f.contents()])
        elif fault == "norm-before-residual-flipped" and name == facts.KEY_NORM_BEFORE_RESIDUAL:
            w.add_bool(name, not bool(f.contents()))  # the GGUF drafter of the tests trains without it
        else:
            copy_field(w, f)
    for t in r.tensors:
        data = t.data.copy()
        if t.name == "d2t":
            ids = torch.from_numpy(data)
            if fault == "d2t-dropped":
                continue
            if fault == "d2t-offsets":  # draftsmith's offsets where llama.cpp reads absolute ids
                ids = ids - torch.arange(ids.numel())
            elif fault == "d2t-shuffled":
                ids = _shuffled(ids, vocab)
            w.add_tensor("d2t", ids.numpy(), raw_dtype=GGMLQuantizationType.I64)
            continue
        if t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.I64):
            raise ValueError(f"{src}: plant faults into an fp32 export ({t.name} is {t.tensor_type.name})")
        w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _copy_card(src.parent, dst_dir)
    return dst


def plant_hf(src: str | Path, dst: str | Path, fault: str) -> Path:
    """A copy of an HF-layout export folder (vllm, speculators, sglang) with ``fault``."""
    from safetensors.torch import load_file, save_file

    if fault not in HF_FAULTS:
        raise ValueError(f"unknown fault {fault!r}")
    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    w = load_file(dst / "model.safetensors")
    if fault == "norm-output-stripped":
        cfg["norm_output"] = False
    elif fault == "aux-ids-minus-1":
        cfg["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in cfg["eagle_aux_hidden_state_layer_ids"]]
    elif fault == "norm-before-residual-dropped":
        cfg.pop("norm_before_residual", None)
        cfg["norm_before_residual"] = False
    elif fault == "d2t-dropped":
        w.pop("d2t")
    elif fault == "d2t-absolute":  # absolute ids where vLLM adds the offset to the draft id
        w["d2t"] = w["d2t"] + torch.arange(w["d2t"].numel(), dtype=w["d2t"].dtype)
    elif fault == "d2t-shuffled":
        ids = w["d2t"] + torch.arange(w["d2t"].numel(), dtype=w["d2t"].dtype)
        w["d2t"] = _shuffled(ids, int(cfg["vocab_size"])) - torch.arange(ids.numel(), dtype=ids.dtype)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


# --- a fitted pair for llama.cpp: SmolLM2 as an F32 GGUF, a drafter fitted to its greedy continuations -----------
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Water boils at")


def fit_chain_drafter(target, dv, sequences, steps: int = 60, ttt_steps: int = 3, **overrides):
    """(drafter, acc): a drafter (reduced vocabulary ``dv``) fitted to the target's greedy choices along
    ``sequences`` (TTT chain), and its last step's accuracy per draft position (what training's eval.json holds)."""
    from draftsmith.model.drafter import new_drafter

    torch.manual_seed(0)
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    valid = torch.zeros_like(ids, dtype=torch.bool)
    for i, s in enumerate(sequences):
        ids[i, : len(s)], valid[i, : len(s)] = torch.tensor(s), True
    with torch.no_grad():
        out = target(ids)
    labels = out.logits.argmax(-1)
    dlabels = dv.draft_ids(labels)
    aux = tuple(a[:, :-1] for a in out.aux_hidden_states)
    d = new_drafter(target, draft_vocab=dv, seed=0, **overrides).train()
    opt = torch.optim.Adam([p for p in d.parameters() if p.requires_grad], lr=1e-2)
    acc = []
    for _ in range(steps):
        g, inp, loss, acc = d.fuse(aux), ids[:, 1:], 0.0, []
        for step in range(ttt_steps):
            n = inp.shape[1]
            h = d(g, inp, torch.arange(step, step + n)[None])
            ok = valid[:, 2 + step: 2 + step + n]
            cut = ok.shape[1]
            want, dwant, h = labels[:, 1 + step: 1 + step + n][:, :cut], dlabels[:, 1 + step: 1 + step + n][:, :cut], \
                h[:, :cut]
            ok = ok & (dwant >= 0)
            logits = d.logits(h)
            ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), dwant.clamp_min(0), reduction="none")
            loss = loss + 0.8**step * (ce * ok).sum() / ok.sum().clamp_min(1)
            acc.append(float(((logits.argmax(-1) == dwant) & ok).sum() / ok.sum().clamp_min(1)))
            g, inp = h[:, :-1], want[:, :-1]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d.eval(), acc


def write_f32_gguf(src: str | Path, dst: str | Path) -> None:
    """A de-quantized copy of a GGUF (same keys, every tensor F32), so llama.cpp computes what PyTorch does."""
    from gguf import GGUFWriter
    from gguf.quants import dequantize

    from draftsmith.core.gguf_file import open_gguf
    from draftsmith.stages.export.gguf import copy_field

    reader = open_gguf(src)
    w = GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name not in ("general.architecture", "general.file_type"):
            copy_field(w, field)
    for t in reader.tensors:
        w.add_tensor(t.name, dequantize(t.data, t.tensor_type).astype("float32"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def fitted_smollm2_run(root: str | Path, new_tokens: int = 32) -> dict:
    """A drafter fitted to SmolLM2's greedy continuations of PROMPTS (test_llamacpp's recipe), saved as a run
    (best/ with the fit's per-position accuracy as eval.json) with the card's expectation decoded on the same
    prompts (decoded.json). The prompts come back as token ids (no chat template: the drafter was fitted on raw
    text). Fitted once per folder."""
    from draftsmith.core import vocab as vocab_mod
    from draftsmith.model.target import load_target
    from draftsmith.stages.decode import SpeculativeDecoder

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    target = load_target("smollm2", pack=False, dtype=torch.float32)
    tok = target.tokenizer
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    run = root / "run"
    if not (run / "best" / "eval.json").is_file():  # fitted once per world folder
        plain = SpeculativeDecoder(target)
        eos = [tok.eos_token_id]
        seqs = [p + plain.generate(p, max_new_tokens=new_tokens, eos_token_ids=eos).token_ids for p in prompts]
        kept = torch.cat([torch.tensor([t for s in seqs for t in s]), torch.arange(256)])
        dv = vocab_mod.from_target_ids(kept, target.vocab_size)
        drafter, acc = fit_chain_drafter(target, dv, seqs)
        drafter.save(run / "best")
        (run / "best" / "eval.json").write_text(json.dumps({"step": 60, "acc": acc, "tokens": sum(map(len, seqs))}))
        (run / "config.json").write_text(json.dumps({"target": "smollm2", "conversations": None, "store": None,
                                                     "ttt_steps": 3, "eval_fraction": 0.0, "lr": 1e-2}))
    decoded_file = run / "decoded.json"
    if not decoded_file.is_file():  # the card's expectation by decoding (the fit's prompts: no held-out split here)
        from draftsmith.model.drafter import load_drafter
        from draftsmith.stages.calibration import CalibrationSet, decoded_expectation

        cal = CalibrationSet(prompts, f"the {len(prompts)} prompts the drafter was fitted on", False)
        decoded = decoded_expectation(target, load_drafter(run / "best", target), cal, k=5, max_new_tokens=new_tokens)
        decoded_file.write_text(json.dumps(decoded))
    return {"run": run, "drafter_dir": run / "best", "prompts": prompts, "new_tokens": new_tokens,
            "decoded": json.loads(decoded_file.read_text())}


def llamacpp_world(root: str | Path, new_tokens: int = 32) -> dict:
    """SmolLM2 as an F32 GGUF and the fitted run (``fitted_smollm2_run``) exported as an fp32 GGUF with its card."""
    from draftsmith.model.sources import smollm2_gguf_path
    from draftsmith.stages.export.gguf import export_gguf

    root = Path(root)
    fitted = fitted_smollm2_run(root, new_tokens)
    target_gguf = root / "smollm2-f32.gguf"
    if not target_gguf.is_file():
        write_f32_gguf(smollm2_gguf_path(), target_gguf)
    run = fitted["run"]
    good_dir = root / "good"
    if good_dir.exists():
        shutil.rmtree(good_dir)
    good = export_gguf(run / "best", good_dir / "drafter.gguf", target=target_gguf, dtype="fp32",
                       card={"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "decoded": fitted["decoded"]}).path
    return {"target_gguf": target_gguf, "run": run, "drafter_dir": run / "best", "good": good,
            "prompts": fitted["prompts"], "new_tokens": new_tokens}
