"""Loader throughput on a local corpus: stream, tokenize (BOS / EOS) and pack a >= 100 MB
jsonl folder with the training loader alone (titan_hybrid/data/local_files.py + loader.py).

    .venv/bin/python bench/local_corpus.py [--megabytes 100]

The corpus is the packaged pydoc documents, repeated with a distinct header per copy until
the size is reached, in 4 files. Reported: tokens/s of the loader alone (one process, one
rank, the default tokenizer), and the same for the packaged pydoc corpus held in memory as the
baseline (no file reading, no `datasets`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from titan_hybrid.adapters.torchtitan_0_2.job_config import parse_job, run_config
from titan_hybrid.data.corpus import pydoc_split
from titan_hybrid.data.loader import build_global_batch_dataloader
from titan_hybrid.data.tokenizer import build_hybrid_tokenizer

REPO = Path(__file__).resolve().parent.parent


def write_corpus(folder: Path, megabytes: int) -> int:
    documents = pydoc_split("train")
    target, written, copy = megabytes * 1_000_000, 0, 0
    files = [open(folder / f"part{i}.jsonl", "w") for i in range(4)]
    try:
        while written < target:
            for index, text in enumerate(documents):
                line = json.dumps({"text": f"[copy {copy} document {index}]\n{text}"}) + "\n"
                files[index % 4].write(line)
                written += len(line)
            copy += 1
    finally:
        for f in files:
            f.close()
    return written


def tokens_per_second(job_args: list[str], limit_s: float | None = None) -> tuple[float, int]:
    config = run_config(parse_job([
        "--job.config_file", str(REPO / "train_configs" / "hybrid.toml"),
        "--training.seq_len", "2048", "--training.local_batch_size", "8", *job_args]))
    tokenizer = build_hybrid_tokenizer(config.data, vocab_size=config.model.vocab_size,
                                       flavor=config.flavor)
    loader = build_global_batch_dataloader(1, 0, tokenizer, config.data, config.training,
                                           infinite=False)
    tokens, start = 0, time.perf_counter()
    for inputs, _ in loader:
        tokens += inputs["input"].numel()
        if limit_s is not None and time.perf_counter() - start > limit_s:
            break
    return tokens / (time.perf_counter() - start), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=100)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_corpus_") as folder:
        size = write_corpus(Path(folder), options.megabytes)
        start = time.perf_counter()
        local_rate, local_tokens = tokens_per_second(["--training.dataset_path", folder])
        local_s = time.perf_counter() - start
    baseline_rate, _ = tokens_per_second([], limit_s=20.0)
    print(f"local jsonl corpus: {size / 1e6:.0f} MB, {local_tokens / 1e6:.1f}M tokens streamed, "
          f"tokenized and packed in {local_s:.1f} s = {local_rate / 1e3:.0f}k tokens/s")
    print(f"baseline (packaged pydoc corpus in memory): {baseline_rate / 1e3:.0f}k tokens/s; "
          f"local / baseline = {local_rate / baseline_rate:.2f}")


if __name__ == "__main__":
    main()
