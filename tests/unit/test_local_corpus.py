"""Local corpora (titan_hybrid/data/local_files.py): jsonl / parquet / text files or folders,
read offline by Hugging Face `datasets`, packed with BOS / EOS, resumed exactly."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.run_configs import run_from_args
from titan_hybrid.data.loader import build_global_batch_dataloader, validate_dataset_config
from titan_hybrid.data.local_files import check_corpus
from titan_hybrid.data.tokenizer import build_hybrid_tokenizer

CONFIG = "train_configs/hybrid.toml"
TEXTS = [f"Document {i}: " + "the quick brown fox jumps over the lazy dog " * (i % 7 + 1)
         for i in range(60)]


def write_corpus(folder, kind: str):
    folder.mkdir(parents=True, exist_ok=True)
    halves = (TEXTS[:30], TEXTS[30:])
    for part, texts in enumerate(halves):
        path = folder / f"part{part}.{kind}"
        if kind == "jsonl":
            path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n"
                                    for i, t in enumerate(texts)))
        elif kind == "txt":
            path.write_text("\n".join(texts) + "\n\n")  # a blank line is no document
        else:
            pq.write_table(pa.table({"text": texts}), path)
    return folder


def job(path, *extra):
    return run_from_args("--training.dataset_path", str(path), "--training.seq_len", "32",
                         "--training.local_batch_size", "2", *extra)


def expected_windows(tokenizer, seq_len):
    stream = []
    for text in TEXTS:
        stream += tokenizer.encode(text, add_bos=True, add_eos=True)
    return [stream[i:i + seq_len + 1] for i in range(0, len(stream) - seq_len, seq_len + 1)]


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "txt"])
def test_a_local_folder_is_read_in_order_and_packed_with_bos_eos(tmp_path, kind):
    config = job(write_corpus(tmp_path / "corpus", kind))
    validate_dataset_config(config.data)
    tokenizer = build_hybrid_tokenizer(config.data, vocab_size=config.model.vocab_size,
                                       flavor=config.flavor)
    loader = build_global_batch_dataloader(1, 0, tokenizer, config.data, config.training,
                                           infinite=False)
    windows = [row.tolist() + [label[-1].item()]
               for inputs, labels in loader for row, label in zip(inputs["input"], labels)]
    assert windows == expected_windows(tokenizer, 32)[:len(windows)]
    assert len(windows) >= len(expected_windows(tokenizer, 32)) - 1  # the last slab may drop


def test_a_single_file_and_the_resumed_position_match_the_uninterrupted_batches(tmp_path):
    write_corpus(tmp_path / "corpus", "jsonl")
    config = job(tmp_path / "corpus" / "part0.jsonl")
    tokenizer = build_hybrid_tokenizer(config.data, vocab_size=config.model.vocab_size,
                                       flavor=config.flavor)
    straight = build_global_batch_dataloader(2, 1, tokenizer, config.data, config.training)
    batches = [batch[1] for _, batch in zip(range(12), straight)]
    first = build_global_batch_dataloader(2, 1, tokenizer, config.data, config.training)
    list(zip(range(5), first))  # the run that stops: 5 batches drawn
    state = first.state_dict()
    resumed = build_global_batch_dataloader(2, 1, tokenizer, config.data, config.training)
    resumed.load_state_dict(state)
    # mid-epoch and across the re-loop of this small file: the same batches as without a stop
    compared = 0
    for expected, (_, labels) in zip(batches[5:], resumed):
        assert labels.equal(expected)
        compared += 1
    assert compared == 7


@pytest.mark.parametrize("setup, message", [
    (lambda p: p, "holds no corpus file"),
    (lambda p: (p / "a.jsonl").write_text('{"body": "x"}\n') and p, "have no 'text' field"),
    (lambda p: (p / "a.jsonl").write_text("not json\n") and p, "is not JSON lines"),
    (lambda p: ((p / "a.txt").write_text("x\n"), (p / "b.jsonl").write_text('{"text": 1}\n'))
     and p, "mixes formats (json, text)"),
    (lambda p: (p / "a.parquet").write_text("garbage") and p, "is not a parquet file"),
])
def test_bad_corpora_are_one_clear_line(tmp_path, setup, message):
    folder = tmp_path / "corpus"
    folder.mkdir()
    path = setup(folder)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_corpus("training.dataset_path", str(path))


def test_an_unreadable_file_is_one_clear_line(tmp_path):
    # A file that even root cannot read (tests run as root, so permission bits do not stop
    # them): /proc/self/mem is a regular file whose read at offset 0 fails with EIO.
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"text": "fine"}\n')
    (folder / "b.jsonl").symlink_to("/proc/self/mem")
    with pytest.raises(ValueError, match=r"training.dataset_path: cannot read '.*/b.jsonl' "
                                         r"\(Input/output error\)"):
        check_corpus("training.dataset_path", str(folder))


def test_a_missing_path_is_one_clear_line(tmp_path):
    with pytest.raises(ValueError, match="training.dataset_path '.*/nowhere' does not exist"):
        validate_dataset_config(job(tmp_path / "nowhere").data)
