"""The demo's bench runs in a child process (demo.bench_in_fresh_process), so that training's process does not slow
its timings. The default suite runs that command in its own process (test_demo.bench_in_this_process); here the
child runs it, and counts the same acceptance."""

from __future__ import annotations

import json

import pytest
from test_demo import bench_in_this_process

from draftsmith.app import demo
from draftsmith.model.drafter import new_drafter
from draftsmith.model.target import load_target
from draftsmith.testing.models import save_tiny_target


@pytest.mark.slow  # a child interpreter that imports torch
def test_the_demo_bench_child_counts_what_this_process_counts(tmp_path):
    target = save_tiny_target(tmp_path / "target")
    new_drafter(load_target(target), seed=1).save(tmp_path / "drafter")
    conversations = tmp_path / "conversations.jsonl"
    conversations.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": "hello"}]}) + "\n")
    preset = demo.PRESETS["tiny"]
    args = (str(target), None, tmp_path / "drafter", preset)
    child, paths = demo.bench_in_fresh_process(*args, tmp_path / "child", False, conversations)
    here, _ = bench_in_this_process(*args, tmp_path / "here", False, conversations)
    assert paths["json"].is_file() and paths["table"].is_file()
    methods = child["results"][0]["methods"]
    assert methods.keys() == here["results"][0]["methods"].keys() and len(methods) > 1
    for name, m in here["results"][0]["methods"].items():
        assert (methods[name]["accepted"], methods[name]["verify_passes"]) == (m["accepted"], m["verify_passes"]), name
