"""Tokenizer builder: torchtitan's HuggingFace tokenizer, with the packaged default resolved."""

from __future__ import annotations

from pathlib import Path

from torchtitan.components.tokenizer import HuggingFaceTokenizer

from titan_hybrid.config.sections import DataSection
from titan_hybrid.data.corpus import ASSETS_DIR


def resolve_assets_path(path: str) -> Path:
    """A path as given, else relative to the package's assets (so the default tokenizer
    `titan_hybrid/assets/pydoc_bpe` is found from any working directory)."""
    candidates = [Path(path), ASSETS_DIR.parent.parent / path, ASSETS_DIR / path]
    for candidate in candidates:
        if (candidate / "tokenizer.json").is_file():
            return candidate
    raise ValueError(f"model.hf_assets_path '{path}' holds no tokenizer.json (looked in "
                     f"{', '.join(str(c) for c in candidates)})")


def build_hybrid_tokenizer(data: DataSection, *, vocab_size: int,
                           flavor: str) -> HuggingFaceTokenizer:
    """The job's tokenizer; ValueError if the model (of `flavor`, embedding `vocab_size`
    tokens) cannot embed its tokens."""
    tokenizer = HuggingFaceTokenizer(tokenizer_path=str(resolve_assets_path(data.tokenizer_path)))
    if tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(
            f"model.hf_assets_path '{data.tokenizer_path}' has a tokenizer of "
            f"{tokenizer.get_vocab_size()} tokens, more than flavor '{flavor}' "
            f"embeds (vocab_size={vocab_size})")
    return tokenizer
