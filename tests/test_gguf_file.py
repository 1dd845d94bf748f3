"""draftsmith's GGUF reader (core/gguf_file.py) reads what gguf's own reader reads: every field, every tensor."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from draftsmith.core.gguf_file import open_gguf, reader_class  # noqa: E402


def _write_every_kind(path) -> None:
    """A GGUF with a value of every type, arrays of strings and numbers, and tensors of three types."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint8("t.u8", 7)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", -1.5e300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(3000)] + ["", "ünï"])
    w.add_array("tokenizer.ggml.scores", [float(i) / 3 for i in range(100)])
    w.add_array("t.ints", list(range(-50, 50)))
    w.add_tensor("a", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("b", np.linspace(-1, 1, 64, dtype=np.float16).reshape(2, 32))
    w.add_tensor("d2t", np.arange(5, dtype=np.int64))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_the_reader_reads_every_field_and_tensor_as_ggufs_own(tmp_path):
    path = tmp_path / "every.gguf"
    _write_every_kind(path)
    ours, theirs = open_gguf(path), gguf.GGUFReader(path)
    assert type(ours) is reader_class() and reader_class() is not gguf.GGUFReader, (
        "gguf's reader changed its private _get: open_gguf fell back to the slow reader")
    assert list(ours.fields) == list(theirs.fields)
    for name, f in theirs.fields.items():
        g = ours.fields[name]
        assert (g.offset, g.name, g.data, g.types) == (f.offset, f.name, f.data, f.types), name
        assert [bytes(p) for p in g.parts] == [bytes(p) for p in f.parts], name
        assert g.contents() == f.contents(), name
    assert ours.fields["tokenizer.ggml.tokens"].contents()[-2:] == ["", "ünï"]
    assert ours.fields["t.u64"].contents() == 2**63 + 5
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors] == ["a", "b", "d2t"]
    for g, t in zip(ours.tensors, theirs.tensors, strict=True):
        assert (g.tensor_type, list(g.shape), g.n_elements, g.n_bytes, g.data_offset) == (
            t.tensor_type, list(t.shape), t.n_elements, t.n_bytes, t.data_offset), t.name
        assert g.data.dtype == t.data.dtype and np.array_equal(g.data, t.data), t.name
