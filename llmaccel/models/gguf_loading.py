"""Faster GGUF loads through transformers: one parse of the file's metadata for the config and
the weights, and our torch dequantization (models/gguf_blocks.py) in place of gguf-py's.

transformers opens a GGUF with gguf-py's `GGUFReader` once for the config and once more for
the weights; each open parses every metadata field, 151,936 vocabulary strings included (~10
s on a 2-core CPU for Qwen2.5). And gguf-py dequantizes in small groups of rows (~23 s of
Qwen2.5-Coder-1.5B's load). transformers looks both names up in the `gguf` module when it
loads (`from gguf import GGUFReader, dequantize` inside `load_gguf_checkpoint`), so
`fast_gguf()` swaps them there for the duration of a load:

- `GGUFReader(path)` returns the reader already made for that file (the config's, reused by
  the weights), until `release_readers()`;
- `dequantize(data, type)` runs our code for the formats it has (Q4_0, Q4_1, Q5_0, Q8_0,
  Q4_K, Q5_K, Q6_K; bit-identical to gguf-py's) and gguf-py's for the rest.

Where transformers or gguf-py no longer look like this (the names moved), the swap is a no-op
and loads run as before, only slower; results never depend on it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

_lock = threading.RLock()
_readers: dict[tuple[str, int, int], object] = {}


def _key(path) -> tuple[str, int, int]:
    p = Path(path).resolve()
    st = p.stat()
    return str(p), st.st_size, st.st_mtime_ns


def release_readers() -> None:
    """Drop the readers kept between the config's load and the weights' (their parsed
    metadata and memory maps)."""
    with _lock:
        _readers.clear()


@contextlib.contextmanager
def fast_gguf() -> Iterator[None]:
    """While active, gguf-py's GGUFReader and dequantize as described above."""
    try:
        import gguf
        from gguf import GGMLQuantizationType
    except ImportError:  # transformers will say that gguf is missing
        yield
        return
    from llmaccel.models import gguf_blocks

    orig_reader, orig_dequantize = getattr(gguf, "GGUFReader", None), getattr(
        gguf, "dequantize", None)
    if orig_reader is None or orig_dequantize is None:
        yield
        return

    def reader(path, mode="r"):
        if mode != "r":
            return orig_reader(path, mode)
        key = _key(path)
        with _lock:
            if key not in _readers:
                _readers.clear()  # one file's at a time: a config read alone holds little
                _readers[key] = orig_reader(path, mode)
            return _readers[key]

    def dequantize(data, qtype):
        name = GGMLQuantizationType(qtype).name
        if gguf_blocks.supported(name):
            return gguf_blocks.dequantize(data, name).numpy()
        return orig_dequantize(data, qtype)

    with _lock:
        gguf.GGUFReader, gguf.dequantize = reader, dequantize
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.dequantize = orig_reader, orig_dequantize


__all__ = ["fast_gguf", "release_readers"]
