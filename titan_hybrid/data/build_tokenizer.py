"""Build the default byte-level BPE tokenizer from the embedded pydoc corpus.

    python -m titan_hybrid.data.build_tokenizer [--vocab-size 2048] [--out DIR]

The result is committed under titan_hybrid/assets/pydoc_bpe/; a test rebuilds it and checks the
bytes are identical, so the committed file always matches this script.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from titan_hybrid.data.corpus import BOS_TOKEN, EOS_TOKEN, TOKENIZER_DIR, pydoc_documents

DEFAULT_VOCAB_SIZE = 2048


def build_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(pydoc_documents(), trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return tokenizer


def write_tokenizer(out_dir: Path, vocab_size: int = DEFAULT_VOCAB_SIZE) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(vocab_size).save(str(out_dir / "tokenizer.json"))
    config = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1 << 20,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--out", type=Path, default=TOKENIZER_DIR)
    args = parser.parse_args()
    write_tokenizer(args.out, args.vocab_size)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
