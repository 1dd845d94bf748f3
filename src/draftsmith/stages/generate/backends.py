"""The backend interface and the in-process engines: the local KV-cache loop and vLLM's offline engine.

Both keep the tokenizer, chat template, stops and turn-granular batching here (``_TokenBackend``), so their
records match; the OpenAI-compatible client lives in ``openai.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from draftsmith.core.processes import child_options
from draftsmith.data.chat import assistant_turn_prefix, encode_rendered, stop_tokens
from draftsmith.stages.generate.config import GenerateError, _TurnTooLong
from draftsmith.stages.generate.jobs import _derive_seed, _Job, _Outcome, _Reply


@dataclass(frozen=True)
class _Sampling:
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int = 0  # 0: off


class _Backend(Protocol):
    name: str
    model_name: str
    tokenizer: Any

    def write_questions(self, prefix_ids: list[int], seeds: list[int], sampling: _Sampling,
                        stop_texts: Sequence[str]) -> list[_Reply | Exception]: ...

    def run(self, jobs: Iterator[_Job], sampling: _Sampling, seed: int) -> Iterator[_Outcome]: ...


def _prompt_ids(tokenizer: Any, history: list[dict[str, str]], limit: int | None, turn: int) -> list[int]:
    """Token ids the target sees before answering; raises _TurnTooLong past `limit`."""
    ids = encode_rendered(tokenizer, assistant_turn_prefix(tokenizer, history))
    if limit is not None and len(ids) > limit:
        raise _TurnTooLong(f"prompt of turn {turn + 1} has {len(ids)} tokens, more than the limit of {limit} "
                           "(max-input-length or the model's context)")
    return ids


def _finish(job: _Job, history: list[dict[str, str]], replies: list[_Reply], error: Exception | None) -> _Outcome:
    """Turn a job's state into its outcome: a first-turn failure is an error, a later too-long turn ends it."""
    if error is not None and not (isinstance(error, _TurnTooLong) and replies):
        return _Outcome(job, error=str(error) or type(error).__name__)
    counts = [r.num_tokens for r in replies]
    return _Outcome(
        job,
        messages=history,
        num_tokens=sum(counts) if all(c is not None for c in counts) else None,  # type: ignore[arg-type]
        finish_reasons=[r.finish_reason for r in replies],
        truncated=error is not None,
    )


def _assistant_message(reply: _Reply) -> dict[str, str]:
    """OpenAI-style message; reasoning stays a separate field that chat.assistant_content folds back in."""
    msg = {"role": "assistant", "content": reply.content}
    if reply.reasoning:
        msg["reasoning_content"] = reply.reasoning
    return msg


class _TokenBackend:
    """What the in-process engines share: the tokenizer's stops, turn-granular batching, question writing.

    Subclasses provide ``generate_ids`` (a batch of prompts continued to a stop or the budget).
    """

    name = "token"
    default_batch_size = 8

    def __init__(self, tokenizer: Any, model_name: str, batch_size: int | None, max_positions: int | None,
                 max_input_length: int | None, extra_eos: Any = None) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.batch_size = batch_size or self.default_batch_size
        self.max_positions = max_positions
        limits = [x for x in (max_input_length, self.max_positions and self.max_positions - 1) if x]
        self.max_input_length = min(limits) if limits else None
        self.stop_ids, self.stop_texts = stop_tokens(tokenizer, extra_eos)

    def generate_ids(self, prompts: list[list[int]], sampling: _Sampling,
                     seeds: list[int]) -> list[tuple[list[int], str]]:
        """Continue each prompt until a stop token/text or the token budget: (new ids, finish reason)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the engine (nothing to do in-process)."""

    def _text(self, generated: list[int], reason: str) -> str:
        if reason == "stop" and generated and generated[-1] in self.stop_ids:
            generated = generated[:-1]
        text = self.tokenizer.decode(generated, skip_special_tokens=True)
        for stop in self.stop_texts:
            i = text.find(stop)
            if i >= 0:
                text = text[:i]
        return text

    # --- backend interface -------------------------------------------------------------------------
    def write_questions(self, prefix_ids: list[int], seeds: list[int], sampling: _Sampling,
                        stop_texts: Sequence[str]) -> list[_Reply | Exception]:
        results: list[_Reply | Exception] = []
        for start in range(0, len(seeds), self.batch_size):
            chunk = seeds[start:start + self.batch_size]
            for ids, reason in self.generate_ids([prefix_ids] * len(chunk), sampling, chunk):
                results.append(_Reply(self._text(ids, reason), finish_reason=reason, num_tokens=len(ids)))
        return results

    def run(self, jobs: Iterator[_Job], sampling: _Sampling, seed: int) -> Iterator[_Outcome]:
        """Continuous batching at turn granularity: each round answers the next turn of every active job."""
        jobs = iter(jobs)
        active: list[tuple[_Job, list[dict[str, str]], list[_Reply]]] = []
        exhausted = False
        while True:
            while not exhausted and len(active) < self.batch_size:
                job = next(jobs, None)
                if job is None:
                    exhausted = True
                else:
                    active.append((job, [], []))
            if not active:
                return
            prompts, rows, still = [], [], []
            for state in active:
                job, history, replies = state
                turn = len(replies)
                history.extend(job.segments[turn])
                try:
                    prompts.append(_prompt_ids(self.tokenizer, history, self.max_input_length, turn))
                except Exception as exc:  # too long, or a template that rejects this conversation
                    yield _finish(job, history[: len(history) - len(job.segments[turn])], replies, exc)
                    continue
                rows.append(state)
            if rows:
                seeds = [_derive_seed(seed, f"{job.id}/{len(replies)}") for job, _, replies in rows]
                for (job, history, replies), (ids, reason) in zip(
                        rows, self.generate_ids(prompts, sampling, seeds), strict=True):
                    reply = _Reply(self._text(ids, reason), finish_reason=reason, num_tokens=len(ids))
                    replies.append(reply)
                    history.append(_assistant_message(reply))
                    if len(replies) == len(job.segments):
                        yield _finish(job, history, replies, None)
                    else:
                        still.append((job, history, replies))
            active = still


class LocalBackend(_TokenBackend):
    """The target adapter in-process: left-padded batches, one KV cache, rows dropped as they stop.

    Multi-turn conversations advance one turn per round and a finished conversation's slot is refilled
    at once, so a batch stays full when conversations have different numbers of turns.
    """

    name = "local"

    def __init__(self, target: Any, batch_size: int | None = None, max_input_length: int | None = None) -> None:
        import torch

        if target.tokenizer is None:
            raise GenerateError(f"{target.name}: no tokenizer next to the model")
        max_pos = getattr(target.config, "max_position_embeddings", None)
        gen_cfg = getattr(target.model, "generation_config", None)
        super().__init__(target.tokenizer, str(target.name), batch_size, int(max_pos) if max_pos else None,
                         max_input_length, getattr(gen_cfg, "eos_token_id", None))
        self.target = target
        self._torch = torch
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (sorted(self.stop_ids) or [0])[0])

    # --- the generation loop ---------------------------------------------------------------------
    def generate_ids(self, prompts: list[list[int]], sampling: _Sampling,
                     seeds: list[int]) -> list[tuple[list[int], str]]:
        """Continue each prompt until a stop token/text or the token budget: (new ids, finish reason)."""
        torch = self._torch
        dev = self.target.device
        n = len(prompts)
        width = max(len(p) for p in prompts)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[r, width - len(p):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        budgets = [sampling.max_new_tokens if self.max_positions is None
                   else min(sampling.max_new_tokens, self.max_positions - len(p)) for p in prompts]
        gens = [torch.Generator().manual_seed(s) for s in seeds] if sampling.temperature > 0 else None
        cache = self.target.new_cache()
        logits = self.target.forward(ids, cache=cache, attention_mask=mask, position_ids=positions,
                                     logits_to_keep=1).logits[:, -1]
        next_pos = positions[:, -1:] + 1
        out: list[list[int]] = [[] for _ in range(n)]
        reasons = ["length"] * n
        active = list(range(n))  # prompt index of each cache row
        while True:
            tokens = self._pick(logits, sampling, [gens[r] for r in active] if gens else None)
            keep = []
            for row, r in enumerate(active):
                out[r].append(tokens[row])
                if tokens[row] in self.stop_ids or self._hit_stop_text(out[r]):
                    reasons[r] = "stop"
                elif len(out[r]) < budgets[r]:
                    keep.append(row)
            if not keep:
                break
            if len(keep) < len(active):
                idx = torch.tensor(keep, device=dev)
                cache.select_rows(idx)
                mask, next_pos = mask[idx], next_pos[idx]
                active = [active[row] for row in keep]
            step = torch.tensor([[out[r][-1]] for r in active], dtype=torch.long, device=dev)
            mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=1)
            logits = self.target.forward(step, cache=cache, attention_mask=mask, position_ids=next_pos,
                                         logits_to_keep=1).logits[:, -1]
            next_pos = next_pos + 1
        return [(o, reason) for o, reason in zip(out, reasons, strict=True)]

    def _pick(self, logits: Any, sampling: _Sampling, gens: list[Any] | None) -> list[int]:
        """Greedy argmax, or temperature + top-k + nucleus sampling, one generator per row (batch-invariant).

        Only the candidates top-k/top-p keep go to the per-row CPU samplers: a multinomial over the whole
        vocabulary for each row was most of a self-prompting step on an H200 (512 rows, 49k tokens).
        """
        torch = self._torch
        if sampling.temperature <= 0 or gens is None:
            return logits.argmax(-1).tolist()
        logits = logits.float() / sampling.temperature
        order = None  # candidate column -> token id, when the candidates are a sorted subset
        if 0 < sampling.top_k < logits.shape[-1]:
            logits, order = torch.topk(logits, sampling.top_k, dim=-1)
        elif sampling.top_p < 1.0:
            logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(logits, dim=-1)
        kept = None
        if sampling.top_p < 1.0:  # nucleus: keep the smallest prefix of sorted tokens with mass >= top_p
            keep = (probs.cumsum(-1) - probs) < sampling.top_p
            kept = keep.sum(-1)
            width = int(kept.max())
            probs, order, kept = probs[:, :width], order[:, :width], kept.tolist()
        probs = probs.cpu()
        order = order.cpu() if order is not None else None
        picked = []
        for row, gen in enumerate(gens):
            # each row samples its own kept prefix only, so its draw never depends on its batch neighbours
            choice = int(torch.multinomial(probs[row, : kept[row]] if kept else probs[row], 1, generator=gen))
            picked.append(int(order[row, choice]) if order is not None else choice)
        return picked

    def _hit_stop_text(self, generated: list[int]) -> bool:
        if not self.stop_texts:
            return False
        tail = self.tokenizer.decode(generated[-8:], skip_special_tokens=False)
        return any(t in tail for t in self.stop_texts)


class VllmBackend(_TokenBackend):
    """vLLM's offline engine in a child process (``integrations/vllm_worker.py``), fed whole batches.

    The child runs under ``python`` (a venv with vLLM: it pins its own torch and transformers); this
    process keeps the tokenizer, chat template, stops and batching, so records match the local backend's.
    vLLM schedules each batch itself (continuous batching at token level, ``max_num_seqs`` in flight).
    """

    name = "vllm"
    default_batch_size = 256  # a round is one llm.generate call; vLLM schedules it with max_num_seqs in flight

    def __init__(self, model_dir: str | Path, python: str | Path, *, batch_size: int | None = None,
                 max_input_length: int | None = None, dtype: str | None = None, max_model_len: int = 4096,
                 max_num_seqs: int = 128, kv_cache_gib: float = 2.0, seed: int = 0,
                 log_path: str | Path | None = None, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float | None = None) -> None:
        import subprocess

        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        model_dir = Path(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        config = AutoConfig.from_pretrained(model_dir)
        try:
            eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
        except OSError:
            eos = None
        max_pos = getattr(config, "max_position_embeddings", None)
        max_model_len = min(max_model_len, int(max_pos)) if max_pos else max_model_len
        super().__init__(tokenizer, model_dir.name, batch_size, max_model_len, max_input_length, eos)
        opts = {"model": str(model_dir), "dtype": dtype or "auto", "max_model_len": max_model_len,
                "max_num_seqs": max_num_seqs, "kv_cache_memory_bytes": int(kv_cache_gib * (1 << 30)), "seed": seed,
                "tensor_parallel_size": tensor_parallel_size, "gpu_memory_utilization": gpu_memory_utilization}
        worker = Path(__file__).resolve().parents[2] / "integrations" / "vllm_worker.py"  # draftsmith/integrations
        self._log_path = Path(log_path) if log_path else None
        self._log = open(self._log_path, "ab") if self._log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self._proc = subprocess.Popen([str(python), str(worker), json.dumps(opts)], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1,
                                          **child_options())
        except OSError as exc:
            raise GenerateError(f"cannot start vLLM with {python}: {exc}") from None
        ready = self._read()
        if not ready.get("ready"):
            raise GenerateError(f"vLLM worker did not start: {ready.get('error', ready)}")

    def _read(self) -> dict:
        line = self._proc.stdout.readline() if self._proc.stdout else ""
        if not line:
            code = self._proc.wait()
            tail = ""
            if self._log_path and self._log_path.is_file():
                tail = "\n" + "\n".join(self._log_path.read_text(errors="replace").splitlines()[-15:])
            raise GenerateError(f"the vLLM worker exited with status {code}"
                                + (f" (log: {self._log_path}){tail}" if self._log_path else ""))
        return json.loads(line)

    def generate_ids(self, prompts: list[list[int]], sampling: _Sampling,
                     seeds: list[int]) -> list[tuple[list[int], str]]:
        # run() refuses prompts past max_positions - 1, so every budget is at least one token.
        budgets = [min(sampling.max_new_tokens, self.max_positions - len(p)) if self.max_positions
                   else sampling.max_new_tokens for p in prompts]
        req = {"prompts": prompts, "max_tokens": budgets, "temperature": sampling.temperature,
               "top_p": sampling.top_p, "top_k": sampling.top_k, "seeds": seeds if sampling.temperature > 0 else None,
               "stop_token_ids": sorted(self.stop_ids), "stop": self.stop_texts}
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(req) + "\n")
        self._proc.stdin.flush()
        reply = self._read()
        if "error" in reply:
            raise GenerateError(f"vLLM: {reply['error']}")
        return [(o["ids"], o["finish_reason"]) for o in reply["outputs"]]

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=60)
            except Exception:
                self._proc.kill()
        if self._log_path:
            self._log.close()
