"""Where text comes from: calibration (GPTQ, AWQ), fine-tuning, draft training and perplexity
all read their text through `find_text`.

A `data` argument is one of:
- a named dataset, `wikitext2` (WikiText-2 raw) or `tinyshakespeare`, found in this order:
  1. $LLMACCEL_DATA_DIR,
  2. `../shared/data` beside a source checkout, where it exists (LLMACCEL_NO_SHARED_DATA=1
     turns this lookup off),
  3. the user cache (`<cache>/data`, where downloads land),
  4. the Hugging Face Hub through `datasets` (WikiText-2 only), downloaded once into the user
     cache with a progress bar;
- a UTF-8 text file (plain, `.gz` or `.xz`), the same text for every split;
- a directory in the layout of WikiText-2's archive (`wiki.valid.raw`, `wiki.test.raw`, ...,
  directly or under `wikitext-2-raw/`);
- a Hugging Face dataset id (`name` or `name:config`), its `text` column, cached once.

Nothing found and the Hub out of reach: one line that names `--data`. A data directory holds
`wikitext-2-raw/wiki.{train,valid,test}.raw` and `tinyshakespeare/input.txt`.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlparse

from llmaccel import envs
from llmaccel.errors import LLMAccelError

SPLITS = ("train", "validation", "test")
NAMED = ("wikitext2", "tinyshakespeare")
_WIKI_FILE = {"train": "wiki.train.raw", "validation": "wiki.valid.raw", "test": "wiki.test.raw"}
_WIKI_DIR = "wikitext-2-raw"
_WIKI_HUB = ("Salesforce/wikitext", "wikitext-2-raw-v1")
_SHAKESPEARE = Path("tinyshakespeare") / "input.txt"
_PATH_LIKE = re.compile(r"^(\.|/|~)|\.(txt|raw|md|gz|xz|json|jsonl|csv)$")
DATA_HINT = ("pass --data FILE|DIR|DATASET (a text file, a directory holding wiki.valid.raw "
             "and wiki.test.raw, or a Hugging Face dataset id)")


class DataNotFoundError(LLMAccelError):
    """Text data that cannot be found, read or downloaded."""


@dataclass(frozen=True)
class TextData:
    """Where one split of a `data` argument was found."""
    name: str            # what was asked for: wikitext2, a path, a dataset id
    split: str           # train, validation or test
    path: Path           # the file holding the text
    origin: str          # which place of the search order held it
    wikitext_rows: bool  # a WikiText raw file: perplexity joins its rows as `datasets` does

    def read(self) -> str:
        return read_text_file(self.path)

    def sha256(self) -> str:
        return file_sha256(self.path)

    def describe(self) -> str:
        return f"{self.name} {self.split} ({self.origin}: {self.path})"


def user_cache_dir() -> Path:
    """`<cache>/data`: $LLMACCEL_CACHE or the platform's user cache directory."""
    from platformdirs import user_cache_dir as platform_cache

    return (envs.LLMACCEL_CACHE or Path(platform_cache("llmaccel"))) / "data"


def shared_data_dir() -> Path | None:
    """`../shared/data` beside a source checkout, if it exists and the lookup is on."""
    if envs.LLMACCEL_NO_SHARED_DATA:
        return None
    path = Path(__file__).resolve().parents[1].parent / "shared" / "data"
    return path if path.is_dir() else None


def _search_dirs() -> list[tuple[str, Path | None]]:
    return [("LLMACCEL_DATA_DIR", envs.LLMACCEL_DATA_DIR),
            ("../shared/data", shared_data_dir()),
            ("user cache", user_cache_dir())]


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise DataNotFoundError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")


def _named_file(name: str, root: Path, split: str) -> Path | None:
    rel = Path(_WIKI_DIR) / _WIKI_FILE[split] if name == "wikitext2" else _SHAKESPEARE
    return root / rel if (root / rel).is_file() else None


def find_text(data: str = "wikitext2", split: str = "validation", *,
              download: bool = True) -> TextData:
    """Locate `data`'s `split` (see the module docstring); `download=False` never goes online."""
    _check_split(split)
    if data in NAMED:
        return _find_named(data, split, download)
    path = Path(data).expanduser()
    if path.is_file():
        return TextData(data, split, path, "file", False)
    if path.is_dir():
        return _from_directory(data, path, split)
    if _PATH_LIKE.search(data) or (os.sep in data and not _looks_like_dataset_id(data)):
        raise DataNotFoundError(f"no such file or directory: {data}")
    return _hub_dataset(data, split, download)


def _looks_like_dataset_id(data: str) -> bool:
    repo = data.partition(":")[0]
    return bool(re.match(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$", repo))


def _find_named(name: str, split: str, download: bool) -> TextData:
    searched = []
    for origin, root in _search_dirs():
        if root is None:
            searched.append(f"{origin} (unset)" if origin.startswith("LLMACCEL")
                            else f"{origin} (off or absent)")
            continue
        found = _named_file(name, root, split)
        if found is not None:
            return TextData(name, split, found, origin, name == "wikitext2")
        searched.append(f"{origin} ({root})")
    what = f"WikiText-2 ({split} split)" if name == "wikitext2" else "Tiny Shakespeare"
    where = ", ".join(searched[:-1]) + " or " + searched[-1]
    if name != "wikitext2" or not download:
        raise DataNotFoundError(f"{what} not found in {where}: {DATA_HINT}")
    _require_hub(f"{what} not found in {where}")
    root = user_cache_dir()
    download_wikitext2(root)
    found = _named_file(name, root, split)
    if found is None:  # pragma: no cover - the download writes every split
        raise DataNotFoundError(f"the WikiText-2 download has no {split} split")
    return TextData(name, split, found, "Hugging Face Hub, cached", True)


def _from_directory(data: str, path: Path, split: str) -> TextData:
    for root in (path, path / _WIKI_DIR):
        f = root / _WIKI_FILE[split]
        if f.is_file():
            return TextData(data, split, f, "directory", True)
    raise DataNotFoundError(f"directory {data} has no {_WIKI_FILE[split]} (the WikiText-2 "
                            f"layout, directly or under {_WIKI_DIR}/); pass a text file "
                            "instead")


def hub_reachable(timeout: float = 3.0) -> bool:
    """False offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set, or no connection to the Hub's
    host within `timeout`): asking `datasets` then would retry for half a minute first."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return False
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname
    try:
        socket.create_connection((host or "huggingface.co", 443), timeout=timeout).close()
    except OSError:
        return False
    return True


def _require_hub(context: str) -> None:
    if not hub_reachable():
        raise DataNotFoundError(f"{context}, and the Hugging Face Hub is unreachable: "
                                f"{DATA_HINT}")


def _datasets_module():
    try:
        import datasets
    except ImportError:
        raise DataNotFoundError("downloading a dataset needs `pip install datasets`; "
                                f"or {DATA_HINT}") from None
    return datasets


def download_wikitext2(root: Path) -> None:
    """Every split of WikiText-2 raw into `root/wikitext-2-raw/` as the archive lays it out:
    one line per `datasets` row, blank rows as the archive's " \\n" lines, so perplexity's
    row joining gives the same text from this copy as from the archive."""
    datasets = _datasets_module()
    try:
        ds = datasets.load_dataset(*_WIKI_HUB)
    except Exception as e:  # offline, moved, rate-limited: all outside our control
        raise DataNotFoundError(f"cannot download WikiText-2 ({'/'.join(_WIKI_HUB)}): "
                                f"{' '.join(str(e).split())[:200]}; {DATA_HINT}") from None
    out = root / _WIKI_DIR
    out.mkdir(parents=True, exist_ok=True)
    for split, name in _WIKI_FILE.items():
        if split not in ds:
            continue
        text = "".join(row if row else " \n" for row in ds[split]["text"])
        _write_atomic(out / name, text)


def _hub_dataset(name: str, split: str, download: bool) -> TextData:
    """A Hugging Face dataset's `text` column, rows joined by a blank line, cached per split
    (the requested split, else the nearest one it has)."""
    safe = re.sub(r"[^\w.-]+", "__", name)
    cached_dir = user_cache_dir() / "hub" / safe
    order = (split,) + tuple(s for s in ("validation", "test", "train") if s != split)
    for s in order:
        f = cached_dir / f"{s}.txt"
        if f.is_file():
            return TextData(name, split, f, "user cache", False)
    if not download:
        raise DataNotFoundError(f"dataset {name!r} is not cached and downloads are off; "
                                f"{DATA_HINT}")
    _require_hub(f"no such file or directory: {name} (nor a cached Hugging Face dataset of "
                 "that id)")
    datasets = _datasets_module()
    repo, _, config = name.partition(":")
    try:
        ds = datasets.load_dataset(repo, config or None)
    except Exception as e:
        raise DataNotFoundError(f"cannot load dataset {name!r}: "
                                f"{' '.join(str(e).split())[:200]}") from None
    have = [s for s in order if s in ds]
    if not have or "text" not in ds[have[0]].column_names:
        raise DataNotFoundError(f"dataset {name!r} has no {'/'.join(SPLITS)} split with a "
                                "'text' column")
    for s in have:
        if "text" in ds[s].column_names:
            _write_atomic(cached_dir / f"{s}.txt", "\n\n".join(ds[s]["text"]))
    return TextData(name, split, cached_dir / f"{have[0]}.txt", "Hugging Face Hub, cached",
                    False)


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def read_text_file(path: Path) -> str:
    """A UTF-8 file, read whole; `.gz` and `.xz` files are decompressed first."""
    import gzip
    import lzma

    opener = {".gz": gzip.open, ".xz": lzma.open}.get(path.suffix)
    try:
        if opener is None:
            return path.read_text(encoding="utf-8")
        with opener(path, "rt", encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError:
        raise DataNotFoundError(f"{path} is not UTF-8 text") from None
    except FileNotFoundError:
        raise DataNotFoundError(f"no such file or directory: {path}") from None
    except (OSError, EOFError, lzma.LZMAError) as e:  # gzip.BadGzipFile is an OSError
        raise DataNotFoundError(f"{path} is not a readable "
                                f"{path.suffix[1:] or 'text'} file: {e}") from None


@lru_cache(maxsize=64)
def _sha256_cached(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    """The file's content hash (remembered per path, size and mtime within a process)."""
    st = path.stat()
    return _sha256_cached(str(path.resolve()), st.st_size, st.st_mtime_ns)


# How WikiText rows become one evaluated text: "hf" as `datasets` joins its rows (a blank line
# between them), "raw" the file as it is.
JOININGS = ("hf", "raw")


def join_rows(raw: str, joining: str) -> str:
    """The evaluated text of a WikiText raw file: its rows joined as `joining` says (JOININGS)."""
    if joining == "raw":
        return raw
    if joining != "hf":
        raise LLMAccelError(f"joining must be one of {JOININGS}, got {joining!r}")
    rows = ["" if line.strip() == "" else line for line in raw.splitlines(keepends=True)]
    return "\n\n".join(rows)


__all__ = ["DATA_HINT", "DataNotFoundError", "NAMED", "SPLITS", "TextData", "download_wikitext2",
           "JOININGS", "file_sha256", "find_text", "hub_reachable", "join_rows", "read_text_file",
           "shared_data_dir", "user_cache_dir"]
