"""The vLLM facts table (core/vllm_facts.py) against a committed snapshot, and that snapshot against vLLM's source.

Doctor's verdicts come from the table: an architecture dropped from it changes a verdict without any other test
noticing. The default run compares the table with ``fixtures/vllm_facts_snapshot.json``; the slow run, where
``.venv-vllm`` exists, compares the snapshot with vLLM's installed source (every text-generation and multimodal
architecture of its registry, with its SupportsEagle3 verdict). After an intended table change, and the slow test
passing on it, rewrite the snapshot with ``DRAFTSMITH_WRITE_SNAPSHOT=1 pytest tests/test_vllm_facts_snapshot.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from draftsmith.core import vllm_facts
from draftsmith.core.pysource import VllmSource

SNAPSHOT = Path(__file__).parent / "fixtures" / "vllm_facts_snapshot.json"
VLLM_VENV = Path(__file__).resolve().parents[1] / ".venv-vllm"


def _plain(value):
    if isinstance(value, frozenset | set):
        return sorted(value)
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in sorted(value.items())}
    return value


def table_as_json() -> dict:
    return {name: {f.name: _plain(getattr(p, f.name)) for f in dataclasses.fields(p)}
            for name, p in sorted(vllm_facts.VLLM_PROFILES.items())}


def test_facts_table_matches_the_snapshot():
    table = table_as_json()
    if os.environ.get("DRAFTSMITH_WRITE_SNAPSHOT") == "1":
        SNAPSHOT.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    snapshot = json.loads(SNAPSHOT.read_text())
    regen = "an intended change? see this module's docstring to rewrite the snapshot"
    assert table.keys() == snapshot.keys(), regen
    for name in table:
        assert table[name].keys() == snapshot[name].keys(), f"{name}: fields changed ({regen})"
        for key in table[name]:
            got, want = table[name][key], snapshot[name][key]
            if isinstance(want, list) and isinstance(got, list):
                assert not set(map(str, want)) - set(map(str, got)), f"{name}.{key} lost entries ({regen})"
                assert not set(map(str, got)) - set(map(str, want)), f"{name}.{key} gained entries ({regen})"
            assert got == want, f"{name}.{key} ({regen})"


@pytest.mark.slow  # needs .venv-vllm, which `make test-slow` creates
def test_snapshot_matches_vllm_source():
    """The 0.32 snapshot names every text-generation and multimodal architecture of vLLM 0.32's registry, each on
    the side of SupportsEagle3 its class is (where the source reader can tell), and the plugin's patchable set."""
    roots = sorted(VLLM_VENV.glob("lib/python3*/site-packages/vllm"))
    if not roots:
        pytest.skip(f"no vLLM source at {VLLM_VENV} (make vllm-env)")
    source = VllmSource(roots[0], "0.32.0")
    snap = json.loads(SNAPSHOT.read_text())["0.32"]
    eagle3, no_eagle3 = set(snap["eagle3_targets"]), set(snap["no_eagle3_targets"])
    tables = source._registry_tables
    registered = set(tables["_TEXT_GENERATION_MODELS"]) | set(tables["_MULTIMODAL_MODELS"])
    assert not eagle3 & no_eagle3
    assert registered - (eagle3 | no_eagle3) == set(), "registered in vLLM, missing from the snapshot"
    assert (eagle3 | no_eagle3) - registered == set(), "in the snapshot, not registered in vLLM"
    for arch in sorted(registered):
        verdict = source.supports_eagle3(arch)
        if verdict is not None:
            assert verdict == (arch in eagle3), arch
    assert {a for a in no_eagle3 if source.plugin_patchable(a)} == set(snap["plugin_patchable"])
    assert set(snap["eagle3_drafter_archs"]) <= set(tables["_SPECULATIVE_DECODING_MODELS"])
    assert set(snap["transformers_backend_archs"]) <= source.transformers_backend_archs
