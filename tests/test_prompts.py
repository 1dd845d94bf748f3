"""Prompt sources: the ShareGPT reader (truncated JSON array), evaluation prompts kept out of training."""

from __future__ import annotations

import json

from draftsmith.data.prompts import (
    BenchPrompt,
    EvaluationPromptDropped,
    drop_evaluation_prompts,
    load_prompts,
    prompt_key,
    training_overlap,
)
from draftsmith.data.records import Conversation, read_records


def _sharegpt(n: int) -> list[dict]:
    return [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i}?"},
                                               {"from": "gpt", "value": f"answer {i}."}]} for i in range(n)]


def test_sharegpt_reader_recovers_complete_objects_before_a_truncated_tail(tmp_path):
    text = json.dumps(_sharegpt(5), indent=2)
    cut = text.rindex('"from": "gpt"')  # inside the last object: the file ends mid-record, as the package's does
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:cut])
    items = list(read_records(path))
    assert [n for n, _ in items] == [1, 2, 3, 4]
    convs = [c for _, c in items]
    assert all(isinstance(c, Conversation) for c in convs)
    assert convs[2].id == "c2"
    assert convs[2].messages == [{"role": "user", "content": "question 2?"},
                                 {"role": "assistant", "content": "answer 2."}]


def test_sharegpt_reader_reports_bad_objects_and_reads_a_complete_array(tmp_path):
    records = _sharegpt(3)
    records[1] = {"id": "empty", "conversations": []}
    path = tmp_path / "full.json"
    path.write_text(json.dumps(records))
    items = list(read_records(path))
    assert len(items) == 3
    assert isinstance(items[1][1], ValueError) and not isinstance(items[0][1], Exception)
    (tmp_path / "not-array.json").write_text('{"id": 1}')
    [(n, err)] = list(read_records(tmp_path / "not-array.json"))
    assert isinstance(err, ValueError) and "array" in str(err)


def test_evaluation_prompts_never_reach_training():
    convs = [(i + 1, Conversation(f"c{i}", [{"role": "user", "content": q}, {"role": "assistant", "content": "a"}]))
             for i, q in enumerate(["Write a  haiku about SPRING.", "unrelated question"])]
    keys = {prompt_key("write a haiku about spring.")}
    out = list(drop_evaluation_prompts(convs, keys))
    assert isinstance(out[0][1], EvaluationPromptDropped) and "evaluation prompt" in str(out[0][1])
    assert out[1][1] is convs[1][1]


def test_training_overlap_names_the_leaked_bench_prompts(tmp_path):
    path = tmp_path / "convs.jsonl"
    path.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                        {"role": "assistant", "content": "x"}]})
                              for q in ["What is 2+2?", "Tell me a joke"]) + "\n")
    prompts = [BenchPrompt("b/1", ["what is 2+2?"]), BenchPrompt("b/2", ["Something else", "Tell me  a joke"]),
               BenchPrompt("b/3", ["never seen"])]
    assert training_overlap(prompts, path) == ["b/1", "b/2"]  # any turn counts; case and spaces do not


def test_bench_prompts_read_a_sharegpt_json_array_with_a_truncated_tail(tmp_path):
    text = json.dumps(_sharegpt(3))
    path = tmp_path / "share.json"
    path.write_text(text[: text.rindex('"from": "gpt"')])  # the last object is cut off, as in the package's file
    assert [p.turns for p in load_prompts(str(path))] == [["question 0?"], ["question 1?"]]
