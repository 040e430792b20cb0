"""Folder conversions between Hugging Face checkpoints and titan_hybrid's.

`import_hf(hf_dir, out_dir)`: an HF folder (config.json + safetensors) -> a titan_hybrid
checkpoint (`out_dir/checkpoint/step-0`, model weights only, with checksums, as a save writes
it), the HF config (`out_dir/config.json`, the model's args through `hybrid.model_config`), the
tokenizer files, and a job (`out_dir/job.toml`) that starts from them.

`export_hf(checkpoint, hf_dir, args)`: a titan_hybrid checkpoint (a step folder, or the newest
intact step of a checkpoint folder) -> config.json + safetensors that transformers'
`from_pretrained` loads.

Both hold one copy of the model in memory (built from the args, on CPU, in float32) and move
the tensors through it one at a time: an import copies each safetensors tensor into the
model's parameter (or its rows of a fused one) as it reads it, and an export writes shards of
at most `max_shard_bytes`. Before anything is written, every tensor on each side must have
its place on the other: an HF tensor without a place in the model, or a model tensor without
an HF source, is a ValueError naming it.
"""

from __future__ import annotations

import json
import shutil
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from titan_hybrid.checkpoint import integrity
from titan_hybrid.checkpoint.state import SplitModelWrapper, check_against_checkpoint
from titan_hybrid.hf import safetensors_io
from titan_hybrid.hf.families import (
    CONFIG_FILE,
    check_hf_compatible,
    hf_config,
    hf_format_of,
    model_args_and_config,
)
from titan_hybrid.model.args import HybridModelArgs
from titan_hybrid.model.common import tensor_parallel_layouts
from titan_hybrid.model.model import HybridModel

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MAX_SHARD_BYTES = 2 << 30
CHECKPOINT_STEP = "checkpoint/step-0"
PROGRESS_FROM_BYTES = 256 << 20


class Progress:
    """One line per tenth of the bytes moved; below PROGRESS_FROM_BYTES, the last one only."""

    def __init__(self, what: str, total_bytes: int, print_fn=print) -> None:
        self.what, self.total, self.done, self.print = what, max(total_bytes, 1), 0, print_fn
        self.next_tenth, self.start = 1, time.perf_counter()

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        if self.total < PROGRESS_FROM_BYTES:  # a small checkpoint: the last line only
            if self.done < self.total:
                return
            self.next_tenth = 10
        while self.done * 10 >= self.next_tenth * self.total and self.next_tenth <= 10:
            self.print(f"{self.what}: {self.done / 1e9:.2f} / {self.total / 1e9:.2f} GB "
                       f"({self.next_tenth * 10}%, {time.perf_counter() - self.start:.0f} s)")
            self.next_tenth += 1


def build_model(args: HybridModelArgs) -> HybridModel:
    """The model on CPU in float32 with its buffers set and its weights left uninitialized:
    every one is read next (a conversion checks that each has its source)."""
    with torch.device("meta"):
        model = HybridModel(args)
    model.to_empty(device="cpu")
    model.init_buffers()
    return model


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# ------------------------------------------------------------------------------- reading HF
def _shapes_in(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    return {key: shape for file in sorted(set(files.values()))
            for key, (_, shape) in safetensors_io.tensor_entries(file).items() if key in files}


def check_same_tensors(ours: dict[str, torch.Tensor], theirs: dict[str, tuple[int, ...]],
                       where: str) -> None:
    """ValueError naming every HF tensor without a place in the model, every model tensor
    without an HF source, and every shape that differs."""
    extra = sorted(set(theirs) - set(ours))
    missing = sorted(set(ours) - set(theirs))
    shapes = [f"{key}: {where} {theirs[key]}, model {tuple(ours[key].shape)}"
              for key in sorted(set(ours) & set(theirs))
              if tuple(theirs[key]) != tuple(ours[key].shape)]
    if not (extra or missing or shapes):
        return

    def listing(keys):
        return ", ".join(keys[:8]) + (f" ... ({len(keys)} in all)" if len(keys) > 8 else "")

    lines = [f"{where} does not match the model its config describes:"]
    if extra:
        lines.append(f"  {len(extra)} tensor(s) with no place in the model: {listing(extra)}")
    if missing:
        lines.append(f"  {len(missing)} model tensor(s) it lacks: {listing(missing)}")
    if shapes:
        lines.append(f"  {len(shapes)} shape mismatch(es): {listing(shapes)}")
    raise ValueError("\n".join(lines))


def load_hf_into(model: HybridModel, hf_dir: Path, print_fn=print) -> None:
    """Read an HF folder's tensors into the model, each into its place (safetensors_io)."""
    adapter = hf_format_of(model.model_args).adapter(model.model_args, None)
    files = safetensors_io.folder_files(hf_dir)
    stored = _shapes_in(files)
    adapter.fit_to_file(stored)
    targets = adapter.to_hf(model.state_dict())  # HF name -> the model's tensor (or its rows)
    check_same_tensors(targets, stored, f"'{hf_dir}'")
    progress = Progress("import", sum(_nbytes(t) for t in targets.values()), print_fn)
    for file in sorted(set(files.values())):
        safetensors_io.read_into(file, targets, lambda target: progress.add(_nbytes(target)))
    adapter.from_hf(targets)  # checks what a read cannot land in place (DeepSeek MTP's copies)


# ----------------------------------------------------------------------- titan_hybrid side
def save_checkpoint(model: HybridModel, step_folder: Path) -> None:
    """The model's weights as a titan_hybrid save writes them: fused tensors as components,
    checksums, a `.partial` folder renamed when complete."""
    partial = step_folder.with_name(step_folder.name + integrity.PARTIAL_SUFFIX)
    shutil.rmtree(partial, ignore_errors=True)
    wrapper = SplitModelWrapper(model, tensor_parallel_layouts(model))
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": one process
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(wrapper.state_dict(), checkpoint_id=str(partial))
    integrity.commit(partial, step_folder)


def newest_step(folder: Path) -> Path:
    """`folder` itself when it is a step folder, else its newest intact step."""
    if (folder / ".metadata").is_file():
        problem = integrity.verify(folder)
        if problem is not None:
            raise ValueError(f"checkpoint '{folder}' is damaged: {problem}")
        return folder
    for _, path in integrity.step_folders(folder):
        if integrity.verify(path) is None:
            return path
    raise ValueError(f"checkpoint '{folder}' is neither a checkpoint step folder (no "
                     ".metadata) nor a folder holding an intact step-N")


def load_checkpoint_into(model: HybridModel, step_folder: Path) -> None:
    """The model's weights from a titan_hybrid checkpoint (its other states are left);
    ValueError naming model keys it lacks and model keys it holds for another model."""
    wrapper = SplitModelWrapper(model, tensor_parallel_layouts(model))
    state_dict = wrapper.state_dict()
    metadata = dcp.FileSystemReader(str(step_folder)).read_metadata()
    state_dict = check_against_checkpoint(state_dict, metadata, str(step_folder))
    with warnings.catch_warnings():  # as in save_checkpoint
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state_dict, checkpoint_id=str(step_folder))
    wrapper.load_state_dict(state_dict)


# ------------------------------------------------------------------------------ writing HF
def write_hf(model: HybridModel, hf_dir: Path, *, max_shard_bytes: int = MAX_SHARD_BYTES,
             print_fn=print) -> None:
    """config.json and safetensors shards (with their index when there are several)."""
    args = model.model_args
    config = hf_config(args)
    tensors = hf_format_of(args).adapter(args, None).to_hf(model.state_dict())
    hf_dir.mkdir(parents=True, exist_ok=True)
    shards = list(safetensors_io.shards(tensors, max_shard_bytes))
    progress = Progress("export", sum(_nbytes(t) for t in tensors.values()), print_fn)
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        name = ("model.safetensors" if len(shards) == 1
                else f"model-{number:05d}-of-{len(shards):05d}.safetensors")
        safetensors_io.write(hf_dir / name, shard, metadata={"format": "pt"},
                             done=lambda tensor: progress.add(_nbytes(tensor)))
        weight_map.update(dict.fromkeys(shard, name))
    if len(shards) > 1:
        total = sum(_nbytes(t) for t in tensors.values())
        (hf_dir / safetensors_io.WEIGHTS_INDEX).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (hf_dir / CONFIG_FILE).write_text(json.dumps({**config, "torch_dtype": "float32"},
                                                 indent=2))


def copy_tokenizer(source: Path | None, destination: Path) -> None:
    for name in TOKENIZER_FILES:
        if source is not None and (source / name).is_file():
            shutil.copyfile(source / name, destination / name)


# ------------------------------------------------------------------------------- the commands
@contextmanager
def _stage(out_dir: Path):
    """Write into `<out_dir>.partial`, renamed to out_dir when complete (an interrupted
    conversion leaves no half-written folder under the name asked for)."""
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"output folder '{out_dir}' exists and is not empty")
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    yield partial
    if out_dir.exists():
        out_dir.rmdir()
    partial.rename(out_dir)


JOB_TEMPLATE = """\
# Written by `python -m titan_hybrid.hf import {hf_dir}`: the model of that folder's config.json,
# starting from its weights ({step}). Run: python -m titan_hybrid.launch --job.config_file {job}
[job]
dump_folder = "{out}/run"
description = "{model_type} imported from {hf_dir}"
custom_config_module = "titan_hybrid.torchtitan_plugin"

[experimental]
custom_import = "titan_hybrid.torchtitan_plugin"

[model]
name = "hybrid"
hf_assets_path = "{tokenizer}"

[hybrid]
model_config = "{out}/{config}"

[training]
local_batch_size = 1
seq_len = {seq_len}
steps = 100
dataset = "pydoc"  # titan_hybrid's packaged corpus: set dataset / dataset_path to your data

[checkpoint]
enable = true
initial_load_path = "{out}/{step}"
"""


def import_hf(hf_dir: str | Path, out_dir: str | Path, print_fn=print) -> Path:
    """HF folder -> out_dir (checkpoint, config.json, tokenizer, job.toml); the job's path."""
    hf_dir, out_dir = Path(hf_dir).resolve(), Path(out_dir).resolve()
    args, config = model_args_and_config(hf_dir, "HF_DIR")
    check_hf_compatible(args)
    model = build_model(args)
    load_hf_into(model, hf_dir, print_fn)
    with _stage(out_dir) as partial:
        (partial / "checkpoint").mkdir()
        save_checkpoint(model, partial / CHECKPOINT_STEP)
        (partial / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        copy_tokenizer(hf_dir, partial)
        has_tokenizer = (hf_dir / "tokenizer.json").is_file()
        (partial / "job.toml").write_text(JOB_TEMPLATE.format(
            hf_dir=hf_dir, out=out_dir, step=CHECKPOINT_STEP, job=out_dir / "job.toml",
            model_type=config.get("model_type"), config=CONFIG_FILE,
            tokenizer=out_dir if has_tokenizer else "titan_hybrid/assets/pydoc_bpe",
            seq_len=min(args.max_seq_len, 2048)))
    print_fn(f"import: {out_dir} (checkpoint {CHECKPOINT_STEP}, job {out_dir / 'job.toml'})")
    return out_dir / "job.toml"


def export_hf(checkpoint: str | Path, hf_dir: str | Path, args: HybridModelArgs, *,
              tokenizer: str | Path | None = None, max_shard_bytes: int = MAX_SHARD_BYTES,
              print_fn=print) -> Path:
    """titan_hybrid checkpoint -> HF folder (config.json, safetensors, tokenizer files)."""
    checkpoint, hf_dir = Path(checkpoint).resolve(), Path(hf_dir).resolve()
    check_hf_compatible(args)
    step = newest_step(checkpoint)
    model = build_model(args)
    load_checkpoint_into(model, step)
    with _stage(hf_dir) as partial:
        write_hf(model, partial, max_shard_bytes=max_shard_bytes, print_fn=print_fn)
        copy_tokenizer(Path(tokenizer) if tokenizer else None, partial)
    print_fn(f"export: {hf_dir} (from {step})")
    return hf_dir
