"""Local corpora: `training.dataset_path` (or `validation.dataset_path`) naming a file or a
folder of files on this machine, read offline with Hugging Face `datasets`, streamed.

Formats, by extension: `.jsonl` / `.json` (one JSON object per line with a "text" field),
`.parquet` (a "text" column), `.txt` (each line a document). A folder takes all its files of
one format (recursively, sorted by path). Documents are read in that order; the loader
(data/loader.py) tokenizes them with BOS / EOS, packs them into windows and resumes exactly
where a checkpoint was written.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
TEXT_FIELD = "text"


def is_local_path(path: str | None) -> bool:
    return bool(path) and Path(path).expanduser().exists()


def corpus_files(field: str, path: str) -> tuple[str, list[str]]:
    """(the `datasets` builder, the files) of a local corpus; ValueError naming `field`."""
    root = Path(path).expanduser()
    files = ([root] if root.is_file() else
             sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in FORMATS))
    if not files:
        raise ValueError(f"{field} '{path}' holds no corpus file ({', '.join(FORMATS)})")
    unknown = [p.name for p in files if p.suffix not in FORMATS]
    if unknown:
        raise ValueError(f"{field} '{path}': {unknown[0]} is not a corpus file "
                         f"({', '.join(FORMATS)})")
    builders = {FORMATS[p.suffix] for p in files}
    if len(builders) > 1:
        raise ValueError(f"{field} '{path}' mixes formats ({', '.join(sorted(builders))}): "
                         "use one format per corpus")
    return builders.pop(), [str(p) for p in files]


def check_corpus(field: str, path: str) -> None:
    """Cheap checks before any worker starts: the files exist, are readable, and their first
    record has a text field."""
    builder, files = corpus_files(field, path)
    for name in files:
        try:
            with open(name, "rb") as f:
                head = f.read(1 << 16)
        except OSError as error:
            raise ValueError(f"{field}: cannot read '{name}' ({error.strerror})") from None
        if builder == "json" and head.strip():
            first = head.split(b"\n", 1)[0]
            try:
                record = json.loads(first)
            except ValueError:
                raise ValueError(f"{field}: '{name}' is not JSON lines (its first line does "
                                 "not parse)") from None
            if not isinstance(record, dict) or TEXT_FIELD not in record:
                raise ValueError(f"{field}: the records of '{name}' have no "
                                 f"'{TEXT_FIELD}' field")
        if builder == "parquet":
            import pyarrow.parquet as pq

            try:
                columns = pq.read_schema(name).names
            except Exception as error:  # pyarrow's errors name the problem
                raise ValueError(f"{field}: '{name}' is not a parquet file ({error})") from None
            if TEXT_FIELD not in columns:
                raise ValueError(f"{field}: '{name}' has no '{TEXT_FIELD}' column "
                                 f"(columns: {columns})")


def local_documents(field: str, path: str) -> Callable[[], Iterable[str]]:
    """A function giving the corpus' documents (texts), streamed from the start each call."""
    builder, files = corpus_files(field, path)

    def documents() -> Iterable[str]:
        from datasets import load_dataset

        stream = load_dataset(builder, data_files=files, split="train", streaming=True)
        return (row[TEXT_FIELD] for row in stream if row[TEXT_FIELD])  # no blank documents

    return documents
