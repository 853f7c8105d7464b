"""The GGUF header reader steps over long metadata arrays and reads everything else as gguf-py's
stock GGUFReader does (rooflm/model/gguf_loader.py: _header_reader)."""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from rooflm.errors import ModelLoadError  # noqa: E402
from rooflm.model.gguf_loader import LONG_ARRAY, _header_reader  # noqa: E402


def _write(path):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(LONG_ARRAY + 500)])
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(LONG_ARRAY + 7)])
    w.add_array("short.strings", ["a", "bc"])
    w.add_uint32("llama.block_count", 3)
    w.add_string("general.name", "header-test")
    w.add_tensor("token_embd.weight", np.arange(24, dtype=np.float32).reshape(4, 6))
    w.add_tensor("blk.0.attn_q.weight", np.ones((6, 6), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_long_arrays_are_stepped_over_and_the_rest_equals_the_stock_reader(tmp_path):
    path = tmp_path / "h.gguf"
    _write(path)
    stock, fast = gguf.GGUFReader(str(path)), _header_reader(gguf.GGUFReader)(str(path))
    assert fast.skipped_arrays == {"tokenizer.ggml.tokens": LONG_ARRAY + 500, "tokenizer.ggml.scores": LONG_ARRAY + 7}
    assert list(fast.fields) == list(stock.fields)
    for key, field in stock.fields.items():
        assert fast.fields[key].offset == field.offset, key
        if key not in fast.skipped_arrays and not key.startswith("GGUF."):
            assert fast.fields[key].contents() == field.contents(), key
    assert fast.fields["short.strings"].contents() == ["a", "bc"]
    assert [(t.name, t.data_offset) for t in fast.tensors] == [(t.name, t.data_offset) for t in stock.tensors]
    for a, b in zip(fast.tensors, stock.tensors):
        np.testing.assert_array_equal(a.data, b.data)


def test_reading_a_skipped_array_names_it(tmp_path):
    from rooflm.model.gguf_loader import GGUFFile

    path = tmp_path / "h.gguf"
    _write(path)
    reader = _header_reader(gguf.GGUFReader)(str(path))
    opened = GGUFFile.__new__(GGUFFile)  # the header alone: this file is no model
    opened.path, opened.reader = str(path), reader
    assert opened.field("llama.block_count") == 3
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.tokens"):
        opened.field("tokenizer.ggml.tokens")
