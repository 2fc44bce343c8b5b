"""Training text from files: plain UTF-8, and the gzip/xz files the head's committed text comes
in (benchmarks/head_text/), read the same; corrupt or non-UTF-8 files are named errors."""

import gzip
import lzma

import pytest

from llmaccel.errors import LLMAccelError
from llmaccel.train.data import load_training_text

TEXT = "<|im_start|>system\nYou are a coder.\ndef f(x):\n    return x  # é\n" * 3


@pytest.mark.parametrize("suffix,write", [
    (".txt", lambda p: p.write_text(TEXT, encoding="utf-8")),
    (".txt.gz", lambda p: p.write_bytes(gzip.compress(TEXT.encode()))),
    (".txt.xz", lambda p: p.write_bytes(lzma.compress(TEXT.encode()))),
])
def test_plain_gz_and_xz_files_read_the_same(tmp_path, suffix, write):
    path = tmp_path / f"data{suffix}"
    write(path)
    assert load_training_text(str(path)) == TEXT


@pytest.mark.parametrize("suffix", [".gz", ".xz"])
def test_corrupt_compressed_file_is_a_named_error(tmp_path, suffix):
    path = tmp_path / f"data.txt{suffix}"
    path.write_bytes(b"this is not compressed at all")
    with pytest.raises(LLMAccelError, match=r"data\.txt.*not a readable"):
        load_training_text(str(path))


def test_non_utf8_compressed_file_is_a_named_error(tmp_path):
    path = tmp_path / "data.txt.xz"
    path.write_bytes(lzma.compress(b"\xff\xfe bad bytes"))
    with pytest.raises(LLMAccelError, match="not UTF-8"):
        load_training_text(str(path))
