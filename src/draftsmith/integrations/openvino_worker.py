"""Runs inside OpenVINO's environment (``.venv-openvino``): decode token-id prompts with OpenVINO GenAI, plain and
with an EAGLE-3 draft model, and inspect a converted draft IR. Driven by ``integrations.openvino`` as
``python -m draftsmith.integrations.openvino_worker REQUEST.json RESPONSE.json``; imports only the standard library,
openvino and openvino_genai (draftsmith's own modules need torch versions this environment need not share).

Every method decodes every prompt in turn (interleaved), so machine noise hits them alike. Greedy only. The
counters are GenAI's own: ``perf_metrics`` (generate time, time to first token, tokens) and, for a speculative
pipeline, ``extended_perf_metrics.get_num_accepted_tokens()``.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time


def _properties(req: dict) -> dict:
    props = {"INFERENCE_PRECISION_HINT": req.get("inference_precision", "f32")}
    if req.get("kv_cache_precision"):
        props["KV_CACHE_PRECISION"] = req["kv_cache_precision"]
    if req.get("threads"):
        props["INFERENCE_NUM_THREADS"] = int(req["threads"])
    return props


def _pipeline(req: dict, method: dict):
    import openvino_genai as og

    props = _properties(req)
    kw = dict(props)
    if method["mode"] == "eagle3":
        kw["draft_model"] = og.draft_model(req["draft"], "CPU", **props)
    elif method["mode"] == "plain-cb":  # the continuous-batching backend the speculative pipeline runs on
        kw["scheduler_config"] = og.SchedulerConfig()
    return og.LLMPipeline(req["target"], "CPU", **kw)


def _config(method: dict, max_new_tokens: int, eos: list[int]):
    import openvino_genai as og

    cfg = og.GenerationConfig()
    cfg.max_new_tokens = max_new_tokens
    cfg.do_sample = False
    if eos:
        cfg.stop_token_ids = set(eos)
    if method["mode"] == "eagle3":
        cfg.num_assistant_tokens = int(method["k"])
        if method.get("tree_depth"):
            cfg.tree_depth = int(method["tree_depth"])
            cfg.branching_factor = int(method["branching_factor"])
    return cfg


def _run(pipe, cfg, ids: list[int]) -> dict:
    import numpy as np
    import openvino as ov
    import openvino_genai as og

    arr = np.asarray([ids], dtype=np.int64)
    inputs = og.TokenizedInputs(ov.Tensor(arr), ov.Tensor(np.ones_like(arr)))
    t0 = time.perf_counter()
    res = pipe.generate(inputs, cfg)
    wall = (time.perf_counter() - t0) * 1000.0
    tokens = [int(t) for t in res.tokens[0]]
    pm = res.perf_metrics
    out = {"tokens": tokens, "wall_ms": wall, "generate_ms": float(pm.get_generate_duration().mean),
           "ttft_ms": float(pm.get_ttft().mean), "accepted": 0}
    ext = getattr(res, "extended_perf_metrics", None)
    if ext is not None and hasattr(ext, "get_num_accepted_tokens"):
        out["accepted"] = int(ext.get_num_accepted_tokens())
        with contextlib.suppress(Exception):  # the split is a nicety; the counters above are what bench needs
            out["draft_ms"] = float(sum(ext.draft_model_metrics.raw_metrics.m_durations)) / 1000.0
    return out


def decode(req: dict) -> dict:
    pipes = {}
    for m in req["methods"]:
        try:
            pipes[m["name"]] = _pipeline(req, m)
        except Exception as e:  # noqa: BLE001 - GenAI's refusal is the answer: quoted, one line
            return {"error": f"{m['name']}: {type(e).__name__}: {' '.join(str(e).split())}"}
    eos = [int(t) for t in req.get("eos", [])]
    cfgs = {m["name"]: _config(m, int(req["max_new_tokens"]), eos) for m in req["methods"]}
    warm = req["prompts"][0][:8] if req["prompts"] else [1]
    for pipe in pipes.values():  # first-call costs land on no method
        _run(pipe, _config({"mode": "plain"}, 4, eos), warm)
    runs = {m["name"]: [] for m in req["methods"]}
    for i, ids in enumerate(req["prompts"]):
        for m in req["methods"]:
            runs[m["name"]].append(_run(pipes[m["name"]], cfgs[m["name"]], ids))
        if req.get("progress"):
            print(f"openvino bench: {i + 1}/{len(req['prompts'])}", end="\r", file=sys.stderr, flush=True)
    return {"runs": runs, "versions": _versions()}


def inspect_draft(req: dict) -> dict:
    """The draft IR as GenAI will read it: rt_info, the d2t Constant's type and values, the parameters."""
    import openvino as ov

    model = ov.Core().read_model(req["xml"])
    rt = {}
    for key in ("eagle3_mode", "hidden_layers_list"):
        if model.has_rt_info(key):
            value = model.get_rt_info(key)  # an OVAny
            rt[key] = str(value.astype(str) if hasattr(value, "astype") else value)
    d2t = None
    for result in model.get_results():
        node = result.input_value(0).get_node()
        if node.get_type_name() == "Constant" and "d2t" in node.get_friendly_name():
            d2t = {"type": node.get_element_type().get_type_name(), "values": [int(x) for x in node.get_data().ravel()]}
    return {"rt_info": rt, "d2t": d2t, "inputs": [p.get_any_name() for p in model.inputs],
            "versions": _versions()}


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("openvino", "openvino-genai", "optimum-intel", "transformers", "torch"):
        with contextlib.suppress(PackageNotFoundError):
            out[name] = version(name)
    return out


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        req = json.load(f)
    op = {"decode": decode, "inspect-draft": inspect_draft}[req["op"]]
    try:
        resp = op(req)
    except Exception as e:  # noqa: BLE001 - reported to the caller as one line, with the engine's own words
        resp = {"error": f"{type(e).__name__}: {' '.join(str(e).split())}"}
    with open(argv[1], "w") as f:
        json.dump(resp, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
