"""The default training text: the CPython reference documentation topics, shipped as a snapshot.

`pydoc_data.topics` holds the language reference and library help topics as plain text (about
465K characters of English prose and code). CPython regenerates that module for every release,
so the project ships a snapshot (taken from Python 3.11.7 by `snapshot_pydoc_topics`) to keep
the corpus, the tokenizer built from it, and every loss curve identical on any Python.

Train / validation split, by document: in the fixed sorted order of `pydoc_documents()`, every
10th document starting with the first (indices 0, 10, 20, ...) is held out for validation
(`--validation.enable`) and never reaches the training stream, whether or not validation is
enabled, so training curves do not depend on it. A training document whose text equals a
held-out one is dropped too (the snapshot's topics "else" and "if" share their text, and "else"
is held out). Of the snapshot's 79 documents 8 are held out, about 9.7K of 129K tokens (7.6%),
and 70 train; every 20th would leave 4 documents, too few windows for a global batch at the
usual sequence lengths. The tokenizer was built from all documents: the held-out
text is unseen by the model, not by the BPE merges.
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


VALIDATION_EVERY = 10


def is_validation_document(index: int) -> bool:
    """Whether document `index` of `pydoc_documents()` is held out (see the module docstring)."""
    return index % VALIDATION_EVERY == 0


def pydoc_split(split: str) -> tuple[str, ...]:
    """The "train" or "validation" documents, in corpus order."""
    if split not in ("train", "validation"):
        raise ValueError(f"pydoc split '{split}' is not one of ('train', 'validation')")
    docs = pydoc_documents()
    held_out = tuple(doc for index, doc in enumerate(docs) if is_validation_document(index))
    if split == "validation":
        return held_out
    held_out_texts = set(held_out)
    return tuple(doc for doc in docs if doc not in held_out_texts)


def snapshot_pydoc_topics(path: Path = SNAPSHOT) -> None:
    """Write this Python's pydoc topics as the snapshot (deterministic bytes: mtime 0)."""
    from pydoc_data.topics import topics

    payload = json.dumps(dict(sorted(topics.items())), ensure_ascii=False).encode()
    path.write_bytes(gzip.compress(payload, mtime=0))
