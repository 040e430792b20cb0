"""The default training text: the CPython reference documentation topics, shipped as a snapshot.

`pydoc_data.topics` holds the language reference and library help topics as plain text (about
465K characters of English prose and code). CPython regenerates that module for every release,
so the project ships a snapshot (taken from Python 3.11.7 by `snapshot_pydoc_topics`) to keep
the corpus, the tokenizer built from it, and every loss curve identical on any Python.
"""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
TOKENIZER_DIR = ASSETS_DIR / "pydoc_bpe"
SNAPSHOT = ASSETS_DIR / "pydoc_topics.json.gz"
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"


@functools.cache
def pydoc_documents() -> tuple[str, ...]:
    """One document per help topic, in a fixed (sorted) order."""
    topics = json.loads(gzip.decompress(SNAPSHOT.read_bytes()))
    return tuple(topics[name].strip() for name in sorted(topics) if topics[name].strip())


def snapshot_pydoc_topics(path: Path = SNAPSHOT) -> None:
    """Write this Python's pydoc topics as the snapshot (deterministic bytes: mtime 0)."""
    from pydoc_data.topics import topics

    payload = json.dumps(dict(sorted(topics.items())), ensure_ascii=False).encode()
    path.write_bytes(gzip.compress(payload, mtime=0))
