"""The drafter's card: what it should accept, how to serve it, what made it; a README.md and one JSON, per export.

The commonest failure users of drafter tools report is a drafter that loads, runs and accepts almost nothing,
with no error. A served drafter can only be checked against a number it carries, so every export writes:

* ``README.md``: a hub-ready model card (YAML front matter with ``base_model``, ``library_name``, ``tags``,
  ``license`` where known), the serve lines for the engines that read this layout, the expected acceptance length
  by k (held-out samples at training: ``eval.json``, the split by a hash of the sample id that training never
  trained on), benched numbers where given, the training data, steps and recipe, and the versions;
* ``drafter_card.json``: the same facts for a program (``draftsmith check`` and ``serve --check`` read it).

Nothing here reads the network; ``push_to_hub`` (``export --push-to-hub``) uploads the folder with huggingface_hub.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path

from draftsmith import __version__
from draftsmith.core.conventions import speculative_config
from draftsmith.core.io import atomic_write

CARD_FILE = "README.md"
CARD_JSON = "drafter_card.json"
CARD_SCHEMA = "draftsmith-card/1"
#: The embedded default's hub id (``smollm2`` in draftsmith's commands).
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
#: The hub's ``library_name`` for each layout: the library that loads the folder as written.
LIBRARY = {"vllm": "vllm", "speculators": "speculators", "sglang": "sglang", "gguf": "gguf", "openvino": "openvino"}
#: Engines whose serve line the card prints, per layout (vLLM reads the SGLang layout too: it carries both ids).
ENGINES = {"vllm": ("vllm",), "speculators": ("vllm",), "sglang": ("sglang", "vllm"), "gguf": ("llama.cpp",),
           "openvino": ("openvino",)}
#: ``draftsmith check --engine`` for each layout.
CHECK_ENGINE = {"gguf": "llamacpp", "openvino": "openvino"}
#: The acceptance the card promises is taken this far (vLLM and llama.cpp serve chains of k drafts).
MAX_K = 8


def expected_by_k(acc: Sequence[float], max_k: int = MAX_K) -> dict[str, float]:
    """Acceptance length (accepted + the bonus token) of a greedy chain of k drafts, k = 1..len(acc):
    1 + sum_{j<=k} prod_{i<j} acc_i, with acc_i the rate at draft position i given the earlier ones accepted."""
    out, run, tau = {}, 1.0, 1.0
    for k, a in enumerate(acc[:max_k], start=1):
        run *= float(a)
        tau += run
        out[str(k)] = round(tau, 4)
    return out


def expected_acceptance(drafter_dir: str | Path | None) -> dict | None:
    """The held-out acceptance training measured for this drafter (its ``eval.json``), or None where there is none.

    Training scores the drafter on the samples ``split_eval`` holds out by a hash of their id: prompts it never
    trained on, decoded by the target itself (the text the engine will verify).
    """
    if drafter_dir is None:
        return None
    path = Path(drafter_dir) / "eval.json"
    try:
        ev = json.loads(path.read_text())
        acc = [float(a) for a in ev["acc"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    run = run_of(drafter_dir)
    data = training_facts(drafter_dir)["data"] if run is not None else None
    return {"source": "held-out split at training (eval.json: samples chosen by a hash of their id, never "
                      "trained on; teacher-forced chain, greedy)",
            "held_out": True, "step": ev.get("step"), "tokens": ev.get("tokens"),
            "prompts": {"set": f"held-out split of {data}" if data else "held-out split of the training data",
                        "count": ev.get("samples"), "in_distribution": True},
            "k": len(acc), "temperature": 0.0,
            "per_position": [round(a, 4) for a in acc], "by_k": expected_by_k(acc)}


def run_of(drafter_dir: str | Path | None) -> Path | None:
    """The training run a drafter directory came from (``run/best`` or ``run/final``), or None."""
    if drafter_dir is None:
        return None
    run = Path(drafter_dir).resolve().parent
    cfg = run / "config.json"
    try:
        d = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return None
    return run if isinstance(d, dict) and "ttt_steps" in d and "eval_fraction" in d else None


#: Recipe fields the card lists (the rest stay in the run's config.json).
_RECIPE = ("ttt_steps", "step_decay", "lr", "batch_tokens", "grad_accum", "warmup_steps", "max_length",
           "teacher_temperature", "train_on", "draft_vocab_size", "norm_before_fc", "fc_norm", "norm_output",
           "norm_before_residual", "eval_fraction", "seed", "epochs", "max_steps", "max_minutes")


def training_facts(drafter_dir: str | Path | None) -> dict | None:
    """Data, steps and recipe of the run that trained the drafter (None: not a draftsmith run directory)."""
    run = run_of(drafter_dir)
    if run is None:
        return None
    cfg = json.loads((run / "config.json").read_text())
    rows = []
    metrics = run / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    steps = max((r["step"] for r in rows if isinstance(r.get("step"), int)), default=None)
    return {"data": cfg.get("store") or cfg.get("conversations"),
            "data_kind": "feature store (offline)" if cfg.get("store") else "conversations (online)",
            "target": cfg.get("target"), "steps": steps, "recipe": {k: cfg[k] for k in _RECIPE if k in cfg}}


def draft_ids_hash(d2t, draft_vocab_size: int, vocab_size: int) -> str | None:
    """sha256 of the draft vocabulary as absolute target ids (``i + d2t[i]``): the same for every layout, whether it
    stores offsets (HF layouts) or absolute ids (GGUF). None for a full vocabulary (no d2t)."""
    import hashlib

    import torch

    if d2t is None or draft_vocab_size == vocab_size:
        return None
    ids = torch.arange(d2t.numel(), dtype=torch.int64) + d2t.to(torch.int64)
    return hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16]


def base_model_of(target: str | Path | None) -> str | None:
    """The target's hub id where it is known (a hub id given, the embedded default, or the ``_name_or_path`` a
    local directory's config.json records); else the directory's name; None when nothing names it."""
    from draftsmith.stages.doctor.hub import parse_hub_id

    if target is None or str(target) == "":
        return None
    if str(target) == "smollm2":
        return SMOLLM2_HUB_ID
    p = Path(target).expanduser()
    if p.exists():
        cfg = (p if p.is_dir() else p.parent) / "config.json"
        try:
            name = json.loads(cfg.read_text()).get("_name_or_path") or ""
        except (OSError, ValueError, AttributeError):
            name = ""
        ref = parse_hub_id(name) if name and not Path(name).expanduser().exists() else None
        return ref.repo_id if ref is not None else (p.stem if p.is_file() else p.resolve().name)
    ref = parse_hub_id(str(target))
    return ref.repo_id if ref is not None else str(target)


def benchmark_rows(reports: Sequence[str | Path]) -> list[dict]:
    """Acceptance and speed per dataset and method from ``bench`` reports (bench.json, bench-llamacpp.json)."""
    rows = []
    for path in reports:
        try:
            rep = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not a bench report ({e})") from None
        engine = rep.get("engine", "draftsmith")
        for res in rep.get("results", []):
            for name, m in res.get("methods", {}).items():
                if name == "plain" or "acceptance_length" not in m:
                    continue
                rows.append({"dataset": res.get("dataset"), "engine": engine, "method": name,
                             "prompts": res.get("prompts"), "acceptance_length": round(m["acceptance_length"], 3),
                             "speedup": round(m.get("speedup", 0.0), 3)})
    return rows


def versions(engines: dict[str, str] | None = None) -> dict:
    """draftsmith, torch, transformers (and each engine's where it was checked)."""
    import torch
    import transformers

    return {"draftsmith": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "engines": dict(engines or {})}


def usage_lines(fmt: str, where: str, base_model: str | None, k: int, target_gguf: str | None = None,
                llama_line: str | None = None) -> dict:
    """The serve command per engine this layout is for; ``where`` is the folder (or hub repo) as the user has it.
    ``llama_line``: llama-server's, which the GGUF writer builds (its flags live there)."""
    target = base_model or "TARGET"
    out = {}
    for engine in ENGINES.get(fmt, ()):
        if engine == "vllm":
            spec = speculative_config(where, k) | {"model": where}  # a hub repo stays a repo id
            out["vllm"] = (f"vllm serve {shlex.quote(target)} --speculative-config "
                           f"{shlex.quote(json.dumps(spec))}") if fmt != "speculators" else f"vllm serve {where}"
        elif engine == "sglang":
            out["sglang"] = (f"python -m sglang.launch_server --model-path {shlex.quote(target)} "
                             f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {shlex.quote(where)} "
                             f"--speculative-num-steps {k} --speculative-eagle-topk 1 "
                             f"--speculative-num-draft-tokens {k + 1}")
        elif engine == "llama.cpp" and llama_line:
            out["llama.cpp"] = llama_line
        elif engine == "openvino":
            out["openvino"] = (f"python -c \"import openvino_genai as og; p = og.LLMPipeline('TARGET_IR', 'CPU', "
                               f"draft_model=og.draft_model({where!r}, 'CPU'), KV_CACHE_PRECISION='f32'); "
                               f"c = og.GenerationConfig(max_new_tokens=128, num_assistant_tokens={k}); "
                               f"print(p.generate('Hello', c))\"")
    out["check"] = (f"draftsmith check --engine {CHECK_ENGINE.get(fmt, 'vllm')} --target "
                    f"{shlex.quote(target_gguf or target)} --drafter {shlex.quote(where)}")
    return out


def card_sources(source: str | Path | None, base_model: str | None, out: str | Path,
                 repo_id: str | None) -> tuple[Path | None, dict | None, str | None, str]:
    """What every kind's card starts from: the training run's folder and facts, the base model (given, else the
    run's target) and where the drafter will live (the hub repo, else the export's path)."""
    src_dir = Path(source) if source is not None and Path(source).is_dir() else None
    training = training_facts(src_dir)
    base = base_model or base_model_of(training["target"] if training else None)
    return src_dir, training, base, repo_id or str(Path(out).resolve())


def card_facts(*, fmt: str, out: str | Path, drafter_config, source: str | Path | None, base_model: str | None,
               num_speculative_tokens: int, files: Sequence[str], license: str | None = None,
               bench_reports: Sequence[str | Path] = (), repo_id: str | None = None,
               target_gguf: str | None = None, engines: dict[str, str] | None = None,
               llama_line: str | None = None, d2t=None, decoded: dict | None = None) -> dict:
    """Everything the card says, as one JSON-able dict (``drafter_card.json``).

    ``decoded``: the acceptance measured by decoding held-out prompts (``calibration.decoded_expectation``); when
    given it is the card's expected acceptance, and training's simulated one is kept beside it.
    """
    cfg = drafter_config
    src_dir, training, base, where = card_sources(source, base_model, out, repo_id)
    return {
        "schema": CARD_SCHEMA,
        "kind": "eagle3",
        "format": fmt,
        "files": sorted(files),
        "base_model": base,
        "target_fingerprint": dict(cfg.target),
        "license": license,
        "num_speculative_tokens": num_speculative_tokens,
        "aux_layer_ids": list(cfg.aux_layer_ids),
        "aux_layer_ids_convention": "input of target layer L (vLLM, llama.cpp, draftsmith)",
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": bool(cfg.norm_before_residual),
        "norms": cfg.norm_flags(),
        "expected_acceptance": decoded or expected_acceptance(src_dir),
        "simulated_acceptance": expected_acceptance(src_dir) if decoded else None,
        "benchmarks": benchmark_rows(bench_reports),
        "training": training,
        "versions": versions(engines),
        "draft_ids_sha256": draft_ids_hash(d2t, cfg.draft_vocab_size, cfg.vocab_size),
        "usage": usage_lines(fmt, where, base, num_speculative_tokens, target_gguf, llama_line),
    }


def render_card(facts: dict) -> str:
    """README.md: YAML front matter the hub reads, then the facts for people."""
    import yaml

    meta = {"base_model": facts["base_model"], "library_name": LIBRARY.get(facts["format"], "draftsmith"),
            "tags": ["speculative-decoding", facts["kind"], "draftsmith", "draft-model", facts["format"]],
            "pipeline_tag": "text-generation"}
    if facts.get("license"):
        meta["license"] = facts["license"]
    meta = {k: v for k, v in meta.items() if v is not None}
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).rstrip(), "---", "",
             f"# {facts['kind'].upper()} drafter for {facts['base_model'] or 'its target'}", "",
             f"A speculative-decoding drafter ({facts['kind']}, {facts['format']} layout) made with draftsmith "
             f"{facts['versions']['draftsmith']}. It drafts tokens that the target verifies: the output is the "
             "target's own greedy output in draftsmith's decoder and in vLLM; in llama.cpp near-ties (the target's "
             "two best tokens within ~0.1 nats) may flip, because its batched verify pass rounds differently.", "",
             "## Usage", ""]
    for engine, line in facts["usage"].items():
        lines += [f"{engine}:", "", "```bash", line, "```", ""]
    lines += ["## Expected acceptance", ""]
    exp = facts["expected_acceptance"]
    if exp:
        where = (f"step {exp.get('step')}, {exp.get('tokens')} tokens" if "step" in exp
                 else f"{exp.get('passes')} verify passes")
        lines += [f"Acceptance length (accepted drafts + 1 per verify pass) of a greedy chain of k drafts, from the "
                  f"{exp['source']}; {where}.", ""]
        if provenance_line(exp):
            lines += [provenance_line(exp), ""]
        lines += ["| k | " + " | ".join(exp["by_k"]) + " |", "|---|" + "---|" * len(exp["by_k"]),
                  "| acceptance length | " + " | ".join(f"{v:.2f}" for v in exp["by_k"].values()) + " |"]
        if exp.get("by_k_interval"):
            lines += ["| point estimate | " + " | ".join(f"{exp['by_k_point'][k]:.2f}" for k in exp["by_k"]) + " |",
                      f"| {exp.get('interval_level', 0.9):.0%} interval over prompts | "
                      + " | ".join(f"{lo:.2f}-{hi:.2f}" for lo, hi in (exp["by_k_interval"][k] for k in exp["by_k"]))
                      + " |"]
        if exp.get("per_position") and "block_size" in facts:  # a block drafter: the rate at each draft slot
            pos = exp["per_position"][: len(exp["by_k"])]
            lines.append("| accepted at this position (given the earlier ones) | "
                         + " | ".join(f"{a:.2f}" for a in pos) + " |")
        lines += ["",
                  "`draftsmith check` compares an engine's served acceptance with these numbers; far below them is a "
                  "silent collapse (a convention the engine reads otherwise), not a weak drafter.", ""]
    else:
        lines += ["Not measured at export (no training eval.json beside the drafter): `draftsmith check` "
                  "measures draftsmith's own decoder on the same prompts instead.", ""]
    if facts["benchmarks"]:
        lines += ["Benchmarked:", "", "| dataset | engine | method | prompts | acceptance length | speedup |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {b['dataset']} | {b['engine']} | {b['method']} | {b['prompts']} | {b['acceptance_length']:.2f} "
                  f"| {b['speedup']:.2f}x |" for b in facts["benchmarks"]]
        lines.append("")
    lines += ["## Drafter", "",
              f"- aux layer ids {facts['aux_layer_ids']} ({facts['aux_layer_ids_convention']})",
              f"- draft vocabulary {facts['draft_vocab_size']} of {facts['vocab_size']}"]
    if "block_size" in facts:
        lines += [f"- block size {facts['block_size']}, {facts['num_speculative_tokens']} drafts a round; slot "
                  f"convention {facts['slot_meaning']} (an engine reading the other one drafts every token one "
                  "position off)", f"- mask token id {facts['mask_token_id']}", ""]
    else:
        lines += [f"- norm_before_residual {facts['norm_before_residual']}; EAGLE-3.1 norms "
                  f"{[k for k, on in facts['norms'].items() if on] or 'none'}",
                  f"- draft tokens per step in the serve lines: {facts['num_speculative_tokens']}", ""]
    tr = facts["training"]
    lines += ["## Training", ""]
    if tr:
        lines += [f"- data: {tr['data']} ({tr['data_kind']})", f"- target: {tr['target']}", f"- steps: {tr['steps']}",
                  "- recipe: " + ", ".join(f"{k}={v}" for k, v in tr["recipe"].items()), ""]
    else:
        lines += ["Not recorded (the drafter was not exported from a draftsmith run directory).", ""]
    if facts.get("checks"):
        lines += ["## Checked in engines", "", "`draftsmith check --record`: the pair decoded in the engine, greedy, "
                  "its own counters against the expected acceptance.", "",
                  "| engine | version | k | prompts | served acceptance length | expected | date |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {c['engine']} | {c['version']} | {c['k']} | {c['prompts']} ({c['prompt_source']}) | "
                  f"{c['served_tau']:.3f} | {c['expected_tau']:.3f} ({c['expected_from']}) | {c['date']} |"
                  for c in facts["checks"]]
        lines.append("")
    v = facts["versions"]
    lines += ["## Versions", "",
              f"- draftsmith {v['draftsmith']}, torch {v['torch']}, transformers {v['transformers']}"]
    lines += [f"- {name} {ver} (checked)" for name, ver in v["engines"].items()]
    lines += ["", f"Machine-readable: `{CARD_JSON}`.", ""]
    return "\n".join(lines)


def provenance_line(exp: dict) -> str | None:
    """Where the expected acceptance came from, in one sentence: which prompts, how many, at what k and temperature
    (None for a card written before it was recorded)."""
    src = exp.get("prompts")
    if not isinstance(src, dict):
        return None
    count = f"{src['count']} prompts" if src.get("count") is not None else "prompts"
    kind = (" (the training distribution: expect less on users' prompts)" if src.get("in_distribution")
            else " (out of the training distribution, no evaluation set)")
    length = f", {exp['max_new_tokens']} new tokens each" if exp.get("max_new_tokens") else ""
    low = (f"; the first row is the low end of the {exp.get('interval_level', 0.9):.0%} interval over prompts, "
           "what `draftsmith check` holds engines to" if exp.get("by_k_interval") else "")
    return (f"Calibrated on {count} of {src.get('set') or 'an unnamed set'}{kind}, a greedy chain of up to "
            f"k={exp.get('k', len(exp.get('by_k', {})))} drafts at temperature {exp.get('temperature', 0.0):g}"
            f"{length}{low}.")


def write_card(out_dir: str | Path, facts: dict) -> tuple[Path, Path]:
    """README.md and drafter_card.json in ``out_dir``, each written atomically."""
    out_dir = Path(out_dir)
    readme, js = out_dir / CARD_FILE, out_dir / CARD_JSON
    atomic_write(js, (json.dumps(facts, indent=2) + "\n").encode())
    atomic_write(readme, render_card(facts).encode())
    return readme, js


def record_check(path: str | Path, check: dict) -> Path:
    """Add a passed ``draftsmith check`` to the drafter's card: the engine's version under versions.engines and the
    run (engine, version, k, prompts, served and expected acceptance, date) under ``checks``, replacing an earlier
    one for the same engine and k. drafter_card.json is rewritten atomically; README.md too when it is the card's
    own rendering (a README.md of the user's is kept, as export keeps it). Returns the JSON's path."""
    p = Path(path)
    folder = p if p.is_dir() else p.parent
    facts = read_card(folder)
    if facts is None:
        raise ValueError(f"{folder}: no drafter_card.json to record the check into (export it with draftsmith)")
    readme = folder / CARD_FILE
    ours = not readme.exists() or _is_card_readme(readme.read_text(), facts)
    facts.setdefault("versions", {}).setdefault("engines", {})[check["engine"]] = check["version"]
    facts["checks"] = [c for c in facts.get("checks") or []
                       if (c.get("engine"), c.get("k")) != (check["engine"], check["k"])] + [check]
    atomic_write(folder / CARD_JSON, (json.dumps(facts, indent=2) + "\n").encode())
    if ours:
        atomic_write(readme, render_card(facts).encode())
    return folder / CARD_JSON


def set_expected(path: str | Path, expected: dict) -> Path:
    """Put a calibrated expectation (``calibration.decoded_expectation``'s shape) into an exported drafter's card,
    keeping what it replaces as ``simulated_acceptance`` where that was training's; README.md is rewritten when it
    is the card's own rendering. Returns the JSON's path."""
    p = Path(path)
    folder = p if p.is_dir() else p.parent
    facts = read_card(folder)
    if facts is None:
        raise ValueError(f"{folder}: no drafter_card.json to put the expectation into (export it with draftsmith)")
    readme = folder / CARD_FILE
    ours = not readme.exists() or _is_card_readme(readme.read_text(), facts)
    if facts.get("simulated_acceptance") is None and "step" in (facts.get("expected_acceptance") or {}):
        facts["simulated_acceptance"] = facts["expected_acceptance"]
    facts["expected_acceptance"] = expected
    atomic_write(folder / CARD_JSON, (json.dumps(facts, indent=2) + "\n").encode())
    if ours:
        atomic_write(readme, render_card(facts).encode())
    return folder / CARD_JSON


def _is_card_readme(text: str, facts: dict) -> bool:
    """README.md as the card rendered it (or, after a kill between the two writes, a rendering of a later one)."""
    try:
        if text == render_card(facts):
            return True
    except (KeyError, TypeError, ValueError):
        pass
    return f"Machine-readable: `{CARD_JSON}`." in text and "made with draftsmith" in text


def read_card(path: str | Path) -> dict | None:
    """The card facts of a drafter (its folder, or the folder of its .gguf); None when it carries none."""
    p = Path(path)
    folder = p if p.is_dir() else p.parent
    try:
        d = json.loads((folder / CARD_JSON).read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) and d.get("schema") == CARD_SCHEMA else None
