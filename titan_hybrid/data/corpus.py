"""The default training text: the CPython reference documentation that ships with every Python.

`pydoc_data.topics` holds the language reference and library topics as plain text (about 465K
characters). It is real English + code prose, available offline, and identical for a given
Python version, which makes it a good default for CPU development runs.
"""

from __future__ import annotations

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
TOKENIZER_DIR = ASSETS_DIR / "pydoc_bpe"
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"


def pydoc_documents() -> list[str]:
    """One document per help topic, in a fixed (sorted) order."""
    from pydoc_data.topics import topics

    return [topics[name].strip() for name in sorted(topics) if topics[name].strip()]
