"""Where prompt rows come from, read through Hugging Face `datasets`: a local .json/.jsonl/.parquet file, a
folder of them, or a hub dataset id with a split.

Each local file is read on its own, so an error names the file and its row (0-based, blank lines skipped).
Local reads build their Arrow cache in a temporary folder that is removed afterwards: a file rewritten in
place is never served from a stale cache, and nothing piles up in ~/.cache. Hub datasets use datasets'
own cache (HF_HOME), as a download should. Without a network a hub id fails after datasets' retries, with
one line saying so (HF_HUB_OFFLINE=1 makes that immediate).
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.config import ConfigError
from protocol.logs import first_line

BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}  # extension -> datasets' builder
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


@dataclass(frozen=True, slots=True)
class Part:
    """The rows of one file (or one hub split), as plain Python values."""

    name: str  # what errors name: the file's path, or "hub dataset ID (split S)"
    columns: list[str]  # top-level column names
    rows: list[dict[str, Any]]


@contextmanager
def _quiet() -> Iterator[None]:
    """datasets' progress bars and its own error lines would repeat, worse, what our one-line error says."""
    import datasets

    verbosity = datasets.logging.get_verbosity()
    bars = datasets.is_progress_bar_enabled()
    datasets.logging.set_verbosity(logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()


def source_files(path: Path) -> list[Path]:
    """A file itself, or a folder's .json/.jsonl/.parquet files (recursively, sorted, hidden ones skipped)."""
    if path.is_file():
        return [path]
    return sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and p.suffix.lower() in BUILDERS and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )


def read_source(source: str, field: str, *, split: str = "train", subset: str = "") -> list[Part]:
    """The parts of `source` (a file, a folder, or a hub id); `field` (data.path, data.test_path) starts every error."""
    path = Path(source)
    if path.exists():
        if path.is_file() and path.suffix.lower() not in BUILDERS:
            raise ConfigError(f"{field}: {source}: unknown extension {path.suffix!r} (expected .json, .jsonl or .parquet)")
        files = source_files(path)
        if not files:
            raise ConfigError(f"{field}: {source}: a folder with no .json, .jsonl or .parquet files")
        parts = [read_file(f, field) for f in files]
    elif path.suffix.lower() in BUILDERS or not _HUB_ID.match(source):
        raise ConfigError(f"{field}: {source} not found")
    else:
        parts = [read_hub(source, field, split, subset)]
    if not any(p.rows for p in parts):
        raise ConfigError(f"{field}: {source}: no rows")
    return parts


def read_file(path: Path, field: str) -> Part:
    import datasets

    builder = BUILDERS[path.suffix.lower()]
    with _quiet(), tempfile.TemporaryDirectory(prefix="fleetrl-data-") as cache:
        try:
            ds = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache, keep_in_memory=True)
        except ValueError as e:  # ArrowInvalid (not Parquet) is a ValueError; so is datasets' "no data" for an empty file
            if "corresponds to no data" in str(e):
                return Part(str(path), [], [])
            raise ConfigError(f"{field}: {path}: not readable as {builder} ({first_line(e)})") from e
        except datasets.exceptions.DatasetGenerationError as e:
            raise ConfigError(f"{field}: {path}: {_json_error(path) or first_line(e.__cause__ or e)}") from e
        rows = ds.to_list()
    return Part(str(path), list(ds.column_names), rows)


def read_hub(dataset_id: str, field: str, split: str, subset: str) -> Part:
    import datasets

    name = f"hub dataset {dataset_id}" + (f" ({subset})" if subset else "") + f", split {split!r}"
    with _quiet():
        try:
            ds = datasets.load_dataset(dataset_id, subset or None, split=split)
        except (OSError, ValueError) as e:  # ConnectionError, DatasetNotFoundError (FileNotFoundError), unknown split
            raise ConfigError(
                f"{field}: {dataset_id!r} is not a local file or folder, and loading it as a Hugging Face {name} failed: {first_line(e)}"
            ) from e
    if not isinstance(ds, datasets.Dataset):
        raise ConfigError(f"{field}: {name} is not a plain dataset ({type(ds).__name__})")
    return Part(name, list(ds.column_names), ds.to_list())


def _json_error(path: Path) -> str | None:
    """The first line json cannot parse, with its 1-based number, for a JSON Lines file (Arrow counts rows)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        return f"not UTF-8 text ({e})"
    if text.lstrip().startswith("["):  # one JSON array: json's own position is the best there is
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            return f"not valid JSON ({e})"
        return None
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                json.loads(line)
            except json.JSONDecodeError as e:
                return f"line {n}: not valid JSON ({e})"
    return None


def count_rows(path: Path) -> int:
    """Rows of a local prompt file or folder without building a dataset (for `fleetrl plan`): Parquet metadata,
    a JSON array's length, or JSON Lines' non-blank lines."""
    total = 0
    for f in source_files(path):
        if f.suffix.lower() == ".parquet":
            import pyarrow.parquet as pq

            total += int(pq.ParquetFile(f).metadata.num_rows)
            continue
        with f.open(encoding="utf-8") as fh:
            text = fh.read()
        if text.lstrip().startswith("["):
            total += len(json.loads(text))
        else:
            total += sum(1 for line in text.splitlines() if line.strip())
    return total
