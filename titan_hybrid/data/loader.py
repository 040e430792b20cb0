"""Layout-independent text batches: every data-parallel layout sees the same global batches.

torchtitan's loader gives each data-parallel rank its own shard of the documents, so the global
batch depends on the data-parallel degree. Comparing loss curves across parallel layouts (and
resuming under a different layout) needs the opposite: one global stream of fixed-length windows,
cut into slabs of `dp_world_size * local_batch_size` windows, of which rank r takes windows
[r*b, (r+1)*b). A training step of global batch G then always consumes windows
[step*G, (step+1)*G), whatever the split between data-parallel ranks and gradient accumulation.

Every rank reads and tokenizes the whole stream (cheap next to a training step) so the loader
state is the same on every rank: a global position that DCP saves once and any layout reloads.

Validation batches come from the same loader (finite, restarted for every validation pass):
the held-out pydoc documents (data/corpus.py; the training stream never contains them) or the
validation split of a torchtitan dataset, see `validation_dataset_name`.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import datasets
import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.hf_datasets import DatasetConfig, text_datasets
from torchtitan.tools.logging import logger

from titan_hybrid.config.sections import DataSection, TrainingSection, ValidationSection
from titan_hybrid.data.corpus import pydoc_split
from titan_hybrid.data.local_files import check_corpus, is_local_path, local_documents

PYDOC_DATASET = "pydoc"
# torchtitan's default validation dataset (a download); a pydoc run reads pydoc's held-out
# part instead unless the job names a path.
TORCHTITAN_VALIDATION_DATASET = "c4_validation"
_STATE_KEY = "global_text_position"


def _load_pydoc(path: str) -> datasets.Dataset:
    """The training documents as the Hugging Face dataset torchtitan's loaders shard by rank."""
    del path  # the corpus ships with Python; the field exists only for torchtitan's interface
    return datasets.Dataset.from_list([{"text": text} for text in pydoc_split("train")])


def register_pydoc_dataset() -> None:
    """Make "pydoc" usable by torchtitan's own loader too (e.g. for llama3 baselines)."""
    text_datasets.DATASETS.setdefault(
        PYDOC_DATASET,
        DatasetConfig(path="pydoc_data.topics", loader=_load_pydoc,
                      sample_processor=lambda sample: sample["text"]),
    )


class GlobalBatchTextLoader(BaseDataLoader):
    """Yields `({"input": [b, seq_len]}, labels [b, seq_len])` for one data-parallel rank."""

    def __init__(
        self,
        *,
        documents: Callable[[], Iterable[Any]],
        text_of: Callable[[Any], str],
        tokenizer: BaseTokenizer,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_world_size: int,
        infinite: bool = True,
        name: str = "",
        microbatch_size: int | None = None,
    ) -> None:
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_world_size={dp_world_size})")
        self._documents = documents
        self._text_of = text_of
        self._tokenizer = tokenizer
        self._seq_len = seq_len
        self._local_batch_size = local_batch_size
        self._dp_rank = dp_rank
        self._dp_world_size = dp_world_size
        self._infinite = infinite
        self._name = name
        # What one iteration yields: the rank's whole share of a slab, or (torchtitan 0.3's
        # pipeline schedules take one microbatch per fetch) that share in consecutive pieces.
        self._yield_size = microbatch_size or local_batch_size
        # Global position, identical on every rank: documents consumed in the current pass,
        # tokens read but not yet windowed, and the pass number.
        self.restart()

    def restart(self) -> None:
        """Back to the first document: each validation pass evaluates the same windows."""
        self._position = {"documents": 0, "token_buffer": [], "epoch": 0}
        self.__dict__.pop("_saved", None)

    def skip_batches(self, count: int) -> None:
        """Move past `count` batches of every rank (one slab of dp x local_batch windows each),
        as if they had been read: a run resumed from model weights alone continues the data
        where the run that wrote them was."""
        windows = self._windows()
        for _ in range(count * self._dp_world_size * self._local_batch_size):
            next(windows)
        self._saved = pickle.dumps(self._position)

    def _windows(self) -> Iterator[list[int]]:
        """Global stream of (seq_len + 1)-token windows from the saved position onwards."""
        window_len = self._seq_len + 1
        pos = self._position
        while True:
            buffer = list(pos["token_buffer"])
            for index, sample in enumerate(self._documents()):
                if index < pos["documents"]:
                    continue
                buffer.extend(self._tokenizer.encode(self._text_of(sample), add_bos=True,
                                                     add_eos=True))
                pos["documents"] = index + 1
                while len(buffer) >= window_len:
                    window, buffer = buffer[:window_len], buffer[window_len:]
                    pos["token_buffer"] = buffer
                    yield window
                pos["token_buffer"] = buffer
            if not self._infinite:
                return
            logger.info(f"Dataset {self._name} is being re-looped (epoch {pos['epoch'] + 1})")
            pos["documents"], pos["epoch"] = 0, pos["epoch"] + 1
            pos["token_buffer"] = buffer

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        slab_size = self._dp_world_size * self._local_batch_size
        mine = slice(self._dp_rank * self._local_batch_size,
                     (self._dp_rank + 1) * self._local_batch_size)
        windows = self._windows()
        while True:
            slab = []
            for _ in range(slab_size):
                window = next(windows, None)
                if window is None:
                    return  # a partial slab would make ranks disagree on the step count
                slab.append(window)
            # Snapshot after the whole slab: state_dict() between batches is a slab boundary.
            self._saved = pickle.dumps(self._position)
            tokens = torch.tensor(slab[mine], dtype=torch.long)
            for piece in tokens.split(self._yield_size):
                yield {"input": piece[:, :-1]}, piece[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        # Same key and bytes on every rank: DCP stores one copy that any layout can reload.
        return {_STATE_KEY: getattr(self, "_saved", pickle.dumps(self._position))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if _STATE_KEY not in state_dict:
            raise ValueError(
                f"dataloader state has keys {sorted(state_dict)}, expected '{_STATE_KEY}': "
                "the checkpoint was not written by titan_hybrid's GlobalBatchTextLoader"
            )
        self._position = pickle.loads(state_dict[_STATE_KEY])
        self._saved = state_dict[_STATE_KEY]


def validate_dataset_config(data: DataSection) -> None:
    """Cheap checks that must fail before any model is built."""
    name = data.dataset.lower()
    if name != PYDOC_DATASET and name not in text_datasets.DATASETS:
        raise ValueError(
            f"training.dataset '{data.dataset}' is unknown: use '{PYDOC_DATASET}' "
            f"or one of torchtitan's datasets {sorted(text_datasets.DATASETS)}"
        )
    # A hub name ("allenai/c4") cannot be checked offline; an explicit local path can.
    path = data.dataset_path
    if is_local_path(path):
        check_corpus("training.dataset_path", path)
    elif path and path.startswith((".", "/", "~")):
        raise ValueError(f"training.dataset_path '{path}' does not exist")


def _dataset_source(name: str, path: str | None, pydoc_part: str,
                    field: str) -> tuple[Callable[[], Iterable[Any]], Callable]:
    """(documents, their text) of a local corpus at `path` (any dataset name: the files are
    the data), of the pydoc corpus, or of a torchtitan dataset."""
    if is_local_path(path):
        return local_documents(field, path), (lambda text: text)
    if name == PYDOC_DATASET:
        documents = pydoc_split(pydoc_part)
        return (lambda: documents), (lambda text: text)
    config = text_datasets.DATASETS[name]
    dataset = config.loader(path or config.path)
    return (lambda: iter(dataset)), config.sample_processor


def build_global_batch_dataloader(
    dp_world_size: int,
    dp_rank: int,
    tokenizer: BaseTokenizer,
    data: DataSection,
    training: TrainingSection,
    infinite: bool = True,
    microbatch_size: int | None = None,
) -> GlobalBatchTextLoader:
    """The training loader of one data-parallel rank, in batches of the training section's
    shape; with `microbatch_size` each batch comes in pieces of that many rows."""
    validate_dataset_config(data)
    return _loader(data.dataset.lower(), data.dataset_path, "train", training,
                   tokenizer, dp_rank, dp_world_size, infinite, microbatch_size)


def build_text_dataloader(dataset: str, dataset_path: str | None, tokenizer: BaseTokenizer, *,
                          seq_len: int, local_batch_size: int, dp_rank: int,
                          dp_world_size: int) -> GlobalBatchTextLoader:
    """The training loader of one data-parallel rank for a job without titan_hybrid's
    sections (a user's own torchtitan 0.3 job): the dataset and the batch shape given."""
    section = SimpleNamespace(seq_len=seq_len, local_batch_size=local_batch_size)
    return _loader(dataset.lower(), dataset_path, "train", section, tokenizer, dp_rank,
                   dp_world_size, infinite=True)


def _loader(name: str, path: str | None, pydoc_part: str, section, tokenizer: BaseTokenizer,
            dp_rank: int, dp_world_size: int, infinite: bool,
            microbatch_size: int | None = None) -> GlobalBatchTextLoader:
    """A loader of dataset `name` with the batch shape of a job section ([training] or
    [validation]: its seq_len and local_batch_size)."""
    section_name = "training" if pydoc_part == "train" else "validation"
    documents, text_of = _dataset_source(name, path, pydoc_part, f"{section_name}.dataset_path")
    return GlobalBatchTextLoader(
        documents=documents,
        text_of=text_of,
        tokenizer=tokenizer,
        seq_len=section.seq_len,
        local_batch_size=section.local_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        infinite=infinite,
        name=name,
        microbatch_size=microbatch_size,
    )


def validation_dataset_name(validation: ValidationSection, data: DataSection) -> str:
    """The dataset `--validation.enable` reads: the held-out pydoc documents when
    validation.dataset is "pydoc", or when a pydoc training run leaves validation.dataset at
    torchtitan's default ("c4_validation", a download) without a validation.dataset_path;
    otherwise validation.dataset, read like torchtitan reads it (its own documents)."""
    name = validation.dataset.lower()
    if (name == TORCHTITAN_VALIDATION_DATASET and not validation.dataset_path
            and data.dataset.lower() == PYDOC_DATASET):
        return PYDOC_DATASET
    return name


def build_validation_dataloader(dp_world_size: int, dp_rank: int, tokenizer: BaseTokenizer,
                                validation: ValidationSection,
                                data: DataSection) -> GlobalBatchTextLoader:
    """One pass over the validation set in global batches of `validation.local_batch_size`
    windows per data-parallel rank; call `restart()` before each pass."""
    return _loader(validation_dataset_name(validation, data), validation.dataset_path,
                   "validation",
                   validation, tokenizer, dp_rank, dp_world_size, infinite=False)
