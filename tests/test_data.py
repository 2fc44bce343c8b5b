"""Finding text (llmaccel.data): a file, a WikiText-2 directory, $LLMACCEL_DATA_DIR,
../shared/data, the user cache and the Hub, in that order; one clear line when none has it."""

from __future__ import annotations

import sys
import time
import types

import pytest

from conftest import generated_text, write_wikitext_dir
from llmaccel import data as D
from llmaccel.eval.perplexity import join_rows


@pytest.fixture
def nowhere(tmp_path, monkeypatch):
    """No data anywhere: an empty LLMACCEL_DATA_DIR, ../shared off, an empty cache, offline."""
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("LLMACCEL_DATA_DIR", str(empty))
    monkeypatch.setenv("LLMACCEL_NO_SHARED_DATA", "1")
    monkeypatch.setenv("LLMACCEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path


def test_offline_with_no_data_is_one_line_naming_data(nowhere):
    t0 = time.perf_counter()
    with pytest.raises(D.DataNotFoundError) as e:
        D.find_text("wikitext2", "test")
    msg = str(e.value)
    assert "\n" not in msg and "--data" in msg and "unreachable" in msg
    assert "LLMACCEL_DATA_DIR" in msg and "../shared/data (off or absent)" in msg
    assert time.perf_counter() - t0 < 2  # no half-minute of retries first


def test_search_order(nowhere, monkeypatch):
    env_dir = write_wikitext_dir(nowhere / "env")
    cache = write_wikitext_dir(nowhere / "cache" / "data")
    monkeypatch.setenv("LLMACCEL_DATA_DIR", str(env_dir))
    found = D.find_text("wikitext2", "validation")
    assert found.origin == "LLMACCEL_DATA_DIR" and found.path.parent.parent == env_dir
    assert found.wikitext_rows
    monkeypatch.delenv("LLMACCEL_DATA_DIR")
    found = D.find_text("wikitext2", "test")
    assert found.origin == "user cache" and found.path.parent.parent == cache


def test_shared_data_lookup_and_its_switch(monkeypatch):
    monkeypatch.delenv("LLMACCEL_NO_SHARED_DATA", raising=False)
    shared = D.shared_data_dir()
    if shared is None:
        pytest.skip("no ../shared/data beside this checkout")
    monkeypatch.setenv("LLMACCEL_NO_SHARED_DATA", "1")
    assert D.shared_data_dir() is None


def test_a_file_a_directory_and_a_missing_path(nowhere):
    f = nowhere / "mine.txt"
    f.write_text("hello world\n")
    found = D.find_text(str(f), "test")
    assert found.origin == "file" and found.read() == "hello world\n" and not found.wikitext_rows
    root = write_wikitext_dir(nowhere / "wt")
    for d in (root, root / "wikitext-2-raw"):  # the archive's folder or the one above it
        assert D.find_text(str(d), "test").path.name == "wiki.test.raw"
    with pytest.raises(D.DataNotFoundError, match="has no wiki.valid.raw"):
        D.find_text(str(nowhere), "validation")
    for missing in ("./nope.txt", "data/nope.txt", str(nowhere / "nope")):
        with pytest.raises(D.DataNotFoundError, match="no such file or directory: "):
            D.find_text(missing, "test")


def test_an_unknown_dataset_id_offline(nowhere):
    with pytest.raises(D.DataNotFoundError) as e:
        D.find_text("someone/some-text", "train")
    assert str(e.value).startswith("no such file or directory: someone/some-text")
    assert "--data" in str(e.value)


class _Split:
    def __init__(self, rows):
        self.rows = rows
        self.column_names = ["text"]

    def __getitem__(self, key):
        assert key == "text"
        return self.rows


def _fake_datasets(monkeypatch, rows_by_split):
    calls = []

    def load_dataset(repo, config=None):
        calls.append((repo, config))
        return {s: _Split(r) for s, r in rows_by_split.items()}

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setattr(D, "hub_reachable", lambda timeout=3.0: True)
    return calls


def test_wikitext_from_the_hub_is_cached_once_and_joins_like_datasets(nowhere, monkeypatch):
    rows = ["", " = Title = \n", "", " Some words here . \n", " More words . \n", ""]
    calls = _fake_datasets(monkeypatch, {"train": rows, "validation": rows, "test": rows})
    found = D.find_text("wikitext2", "test")
    assert calls == [("Salesforce/wikitext", "wikitext-2-raw-v1")]
    assert found.origin == "Hugging Face Hub, cached" and found.wikitext_rows
    assert found.path.is_relative_to(nowhere / "cache")
    # the cached copy gives perplexity the text `datasets` rows give it
    assert join_rows(found.read(), "hf") == "\n\n".join(rows)
    again = D.find_text("wikitext2", "validation")
    assert calls == [("Salesforce/wikitext", "wikitext-2-raw-v1")]  # no second download
    assert again.origin == "user cache"


def test_a_hub_dataset_id_is_cached_per_split(nowhere, monkeypatch):
    calls = _fake_datasets(monkeypatch, {"train": ["a b c", "d e"]})
    found = D.find_text("org/corpus:cfg", "train")
    assert calls == [("org/corpus", "cfg")] and found.read() == "a b c\n\nd e"
    assert D.find_text("org/corpus:cfg", "train").origin == "user cache"
    assert len(calls) == 1


def test_content_hash_follows_the_text(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(generated_text(5))
    first = D.find_text(str(f)).sha256()
    f.write_text(generated_text(5, seed=1))
    assert D.find_text(str(f)).sha256() != first
