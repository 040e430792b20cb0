"""torchtitan's CheckpointManager, made safe to operate.

Same folders (`<dump>/<checkpoint.folder>/step-N`), same state, same options; in addition:
- saves are crash-consistent and carry checksums (integrity.py: written as `step-N.partial`,
  renamed when complete);
- at start-up the newest INTACT checkpoint is resumed: a damaged newer one is reported with its
  path and the reason, and skipped; if none is intact the run stops with a clear message;
- `keep_latest_k` counts intact checkpoints only, so a damaged newer save never pushes the last
  intact one out;
- a model-only checkpoint (a final save with `last_save_model_only`, an export) is refused as a
  resume point with a message naming `checkpoint.resume_with_fresh_optimizer`; with that flag
  the weights load, the optimizer starts fresh, and the step, LR schedule and data position
  continue from the checkpoint's step;
- every load is checked against the model (keys and shapes, state.py) and can read another
  pattern's checkpoint layer by layer (`hybrid.load_layers_by_order`);
- a Hugging Face export also writes config.json and the tokenizer files, so `transformers`
  (`AutoModelForCausalLM`, `AutoTokenizer`) loads the folder as it is;
- `checkpoint.async_mode`: DCP writes `step-N.partial` in the background; when it is written,
  the save's own thread commits it (each rank checksums its own files, then the gather of the
  checksums, fsync, rename, keep_latest_k), on the save's process group. A crash before that
  leaves the `.partial` folder, and the previous checkpoint stays the newest. The training
  thread runs no collective for it: it waits for the commit only where torchtitan waits for the
  save (before the next save, and at the end).
  In `async` mode the copy to host memory (staging) also runs in the background, into buffers
  kept from one save to the next; the train step waits for it before the optimizer changes
  the weights (torchtitan's `maybe_wait_for_staging`), so it overlaps forward and backward.
  On CUDA the copies go into pinned buffers on a stream of their own, and that wait is the
  compute stream's, on an event after the copies (compat.dcp.background_stager).
- process groups: one gloo group, `checkpoint_background_saves`, in the async modes only (a
  background save's collectives must not interleave with the training thread's); none
  otherwise. torchtitan's constructor would make an unnamed one; this one makes it itself, once.

Besides the public `load` / `save` / `close` / `dcp_save` / `dcp_load`, this overrides hooks that
torchtitan keeps private, under the public names that the installed torchtitan's fence gives
them (titan_hybrid.compat.torchtitan_hooks: `save_last_step`, `find_load_step`,
`purge_stale_checkpoints`, `wait_for_background_save`, ...), and feeds its `purge_queue`. The
same class runs under torchtitan 0.2 and 0.3; only the fence differs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import threading
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchtitan.components.checkpoint import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    TRAIN_STATE,
    AsyncMode,
)
from torchtitan.tools.logging import logger

from titan_hybrid.checkpoint import integrity
from titan_hybrid.checkpoint.split import check_writable
from titan_hybrid.checkpoint.state import (
    NON_MODEL_PREFIXES,
    SplitModelWrapper,
    check_against_checkpoint,
    map_layers_by_order,
)
from titan_hybrid.compat.dcp import (
    background_stager,
    files_written_by,
    wait_before_the_optimizer,
)
from titan_hybrid.compat.torchtitan_hooks import CheckpointManagerHooks
from titan_hybrid.config.sections import TrainingSection
from titan_hybrid.model.args import HybridModelArgs
from titan_hybrid.model.common import TPLayout
from titan_hybrid.runtime.cluster import restart_count
from titan_hybrid.runtime.errors import JobError

FRESH_OPTIMIZER_FLAG = "--checkpoint.resume_with_fresh_optimizer"
BACKGROUND_SAVES_GROUP = "checkpoint_background_saves"


class BackgroundCommit:
    """Commits a background save once written: a done-callback of the save's future, so it runs
    on the save's own thread (or at once, if the write has finished already) with the save's
    process group. Every rank's future completes only after DCP's last collective of the save,
    which tells all ranks of its success or failure alike, so every rank commits, or none does.
    `done` is set when it has finished either way."""

    def __init__(self, partial: Path, final: Path, group, manager: HybridCheckpointManager):
        self.partial, self.final, self.group, self.manager = partial, final, group, manager
        self.done = threading.Event()

    def __call__(self, future) -> None:
        try:
            if future.exception() is not None:
                return  # torchtitan's wait re-raises it on the training thread
            rank = dist.get_rank() if dist.is_initialized() else 0
            own = {name: integrity.file_entry(self.partial / name)
                   for name in files_written_by(self.partial, rank)}
            integrity.commit(self.partial, self.final, own, group=self.group)
            self.manager.verified.add(str(self.final))
            self.manager.purge_stale_checkpoints()
        except Exception as error:  # noqa: BLE001  (on a thread: report it, keep the .partial)
            logger.error(f"Committing the checkpoint {self.final} failed: {error!r}; it stays "
                         f"{self.partial.name} and the previous checkpoint the newest")
        finally:
            self.done.set()


@contextlib.contextmanager
def replaced_without_a_group(checkpoint_config):
    """Around torchtitan's Trainer constructor, whose CheckpointManager titan_hybrid replaces at
    once (HybridCheckpointManager): that one is built as a synchronous one, so that it makes no
    gloo group of its own for background saves (a full mesh of TCP connections at every rank,
    which nothing would use)."""
    mode = checkpoint_config.async_mode
    checkpoint_config.async_mode = AsyncMode.DISABLED.value
    try:
        yield
    finally:
        checkpoint_config.async_mode = mode


def holds_training_state(metadata) -> bool:
    return any(key.startswith("optimizer.") for key in metadata.state_dict_metadata)


class HybridCheckpointManager(CheckpointManagerHooks):
    def __init__(self, *, model_args: HybridModelArgs, training: TrainingSection,
                 load_layers_by_order: bool, resume_with_fresh_optimizer: bool,
                 tokenizer_folder: str | None, layouts: dict[str, TPLayout], **kwargs) -> None:
        """`model_args`: the run's model; `training`: its batch shape (a fresh optimizer's
        resume counts the tokens seen); the two flags are the job's `hybrid.` and
        `checkpoint.` options. `layouts`: the run's ParallelPlan.layouts (fused tensors are
        saved as components). `kwargs`: torchtitan's CheckpointManager's (its config under
        `config` in 0.3, `checkpoint_config` in 0.2)."""
        config_key = "config" if "config" in kwargs else "checkpoint_config"
        background = AsyncMode(kwargs[config_key].async_mode.lower())
        # torchtitan's constructor would make the background saves' group, unnamed: it is made
        # below instead, named, so the run's log of its groups says what it is for.
        kwargs[config_key] = dataclasses.replace(kwargs[config_key],
                                                 async_mode=AsyncMode.DISABLED.value)
        super().__init__(**kwargs)
        self.training = training
        self.model_args = model_args
        self.tokenizer_folder = tokenizer_folder
        self.by_order = load_layers_by_order
        self.fresh_optimizer = resume_with_fresh_optimizer
        self.verified: set[str] = set()
        self.commit: BackgroundCommit | None = None  # the latest background save's
        if not self.enable:
            return
        self.states[MODEL] = SplitModelWrapper(self.states[MODEL].model, layouts)
        self.async_mode = background
        if background != AsyncMode.DISABLED:
            self.pg = (dist.new_group(backend="gloo", group_desc=BACKGROUND_SAVES_GROUP)
                       if dist.is_initialized() else None)
            # The train step waits for each save's staging before the optimizer step.
            self.enable_background_staging()
        if background == AsyncMode.ASYNC:
            # torchtitan stages `async` saves on the training thread, into buffers allocated
            # anew each time (most of what a save blocked). A stager of our own copies in a
            # background thread into buffers it keeps; torchtitan's train step waits for it
            # (maybe_wait_for_staging) before the optimizer step.
            self.stager = background_stager()

    # ---- saving -------------------------------------------------------------------------

    def dcp_save(self, state_dict, checkpoint_id: str, async_mode, enable_garbage_collection=False,
                 to_hf: bool = False):
        final = Path(checkpoint_id)
        partial = final.with_name(final.name + integrity.PARTIAL_SUFFIX)
        if to_hf:  # a piece DCP's HF writer would drop is an error, never a silent loss
            check_writable(self.sd_adapter.to_hf(state_dict))
        if integrity.is_rank0():
            shutil.rmtree(partial, ignore_errors=True)
        integrity.barrier()
        if async_mode == AsyncMode.ASYNC and self.stager is not None:
            response = dcp.async_save(state_dict, checkpoint_id=str(partial),
                                      process_group=self.pg, async_stager=self.stager)
            self.staging_started(wait_before_the_optimizer(self.stager,
                                                           response.staging_completion))
            result = response.upload_completion
        else:
            result = super().dcp_save(state_dict, str(partial), async_mode,
                                      enable_garbage_collection, to_hf)
        if async_mode != "disabled":  # checkpoint.async_mode (a str enum): still being written
            self.commit = BackgroundCommit(partial, final, self.pg, self)
            # async: a Future; async_with_pinned_mem: a response holding the write's future.
            getattr(result, "upload_completion", result).add_done_callback(self.commit)
            return result
        if to_hf:
            integrity.barrier()  # every rank's consolidated files are written
            if integrity.is_rank0():
                self._complete_hf_export(partial)
        integrity.commit(partial, final)
        self.verified.add(str(final))
        return result

    def wait_for_background_save(self) -> None:
        """Wait for the background save and its commit (torchtitan waits here before the next
        save). Until the commit it is a `.partial` folder, which a crash leaves behind and the
        next start removes: the previous checkpoint stays the newest intact one."""
        super().wait_for_background_save()
        if self.commit is not None:
            self.commit.done.wait()
            self.commit = None

    def close(self) -> None:
        if getattr(self, "enable", False) and getattr(self, "commit", None) is not None:
            self.wait_for_background_save()
        super().close()

    def _complete_hf_export(self, folder: Path) -> None:
        # torchtitan writes per-rank shards under sharded/, then consolidates them next to it.
        shutil.rmtree(folder / "sharded", ignore_errors=True)
        (folder / "config.json").write_text(json.dumps(self.sd_adapter.hf_config(), indent=2))
        if self.tokenizer_folder:
            for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                source = Path(self.tokenizer_folder) / name
                if source.is_file():
                    shutil.copyfile(source, folder / name)

    def save_last_step(self, step: int) -> None:
        # torchtitan asserts that an HF export is model-only instead of deciding it, and
        # applies export_dtype to model-only saves alone: either one makes the save model-only.
        saved = self.last_save_model_only
        self.last_save_model_only = (saved or self.last_save_in_hf
                                     or self.export_dtype != torch.float32)
        try:
            super().save_last_step(step)
        finally:
            self.last_save_model_only = saved
        self.purge_stale_checkpoints()  # torchtitan skips it at the last step

    def purge_stale_checkpoints(self) -> None:
        """Keep the newest `keep_latest_k` intact checkpoints; damaged ones do not count and are
        set aside before their deletion is queued (a later save may re-create their step)."""
        if self.keep_latest_k <= 0 or not integrity.is_rank0():
            return
        kept = 0
        for _, path in integrity.step_folders(Path(self.folder)):
            problem = integrity.structural_problem(path)
            if problem is None and kept < self.keep_latest_k:
                kept += 1
                continue
            if problem is not None:
                logger.warning(f"Removing damaged checkpoint {path} ({problem})")
                path = integrity.set_aside_damaged(path)
            self.purge_queue.put(str(path))

    # ---- loading ------------------------------------------------------------------------

    def load(self, step: int = -1) -> bool:
        if not self.enable:
            return False
        for path in integrity.discard_leftovers(Path(self.folder)):
            logger.warning(f"Removed {path}: left by an interrupted save or a fallback")
        if step >= 0:  # checkpoint.load_step: exactly that one, or a clear error
            named = Path(self.step_folder(step))
            if not integrity.agree(named.is_dir() if integrity.is_rank0() else None):
                raise JobError(f"checkpoint.load_step={step} but '{named}' does not exist")
        loaded = super().load(step)
        if restart_count():  # torchrun's agent restarted the workers (MAX_RESTARTS)
            resumed = self.states[TRAIN_STATE].step
            logger.warning(f"restart {restart_count()}: resumed from step {resumed}" if loaded
                           else f"restart {restart_count()}: no checkpoint yet, starting over")
        return loaded

    def find_load_step(self, folder: str = "") -> int:
        """The newest intact `step-N` (verified against its checksums), or -1 if none exists.
        Damaged newer ones are reported and set aside once an intact one is found."""
        if folder and folder != self.folder:
            return super().find_load_step(folder)  # torchft's per-replica folders
        listed = integrity.step_folders(Path(self.folder)) if integrity.is_rank0() else None
        candidates = integrity.agree(listed)
        damaged = []
        for step, path in candidates:
            problem = integrity.verify(path)
            if problem is None:
                self.verified.add(str(path))
                for bad, reason in damaged:
                    logger.warning(f"Checkpoint {bad} is damaged ({reason}); resuming from "
                                   f"{path} instead")
                    if integrity.is_rank0():
                        integrity.set_aside_damaged(bad)
                integrity.barrier()
                return step
            damaged.append((path, problem))
        if damaged:
            listing = "; ".join(f"{path.name}: {reason}" for path, reason in damaged)
            raise JobError(f"no intact checkpoint in checkpoint.folder '{self.folder}' "
                           f"({listing}); move the folder away to start afresh")
        return -1

    def dcp_load(self, state_dict, checkpoint_id: str, from_hf: bool, from_quantized: bool):
        if from_hf:
            metadata = self.sd_adapter.get_hf_storage_reader(checkpoint_id).read_metadata()
            self.sd_adapter.fit_to_file({key: tuple(entry.size) for key, entry
                                         in metadata.state_dict_metadata.items()})
            check_against_checkpoint(self.sd_adapter.to_hf(state_dict), metadata, checkpoint_id,
                                     hint=self._layers_hint())
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        path = Path(checkpoint_id)
        if str(path) not in self.verified:  # named by load_step or initial_load_path
            problem = integrity.verify(path)
            if problem is not None:
                raise JobError(f"checkpoint '{checkpoint_id}' is damaged: {problem}")
        if (path / integrity.HF_INDEX_FILE).exists() and not (path / ".metadata").exists():
            raise JobError(
                f"checkpoint '{checkpoint_id}' is a Hugging Face export (model weights only) "
                "and cannot resume training; load it into a new run with "
                "--checkpoint.initial_load_path and --checkpoint.initial_load_in_hf, or remove "
                "it to resume from an older checkpoint")
        metadata = dcp.FileSystemReader(checkpoint_id).read_metadata()
        resume_fresh = False
        if any(key in state_dict for key in ("optimizer", TRAIN_STATE)) \
                and not holds_training_state(metadata):
            if not self.fresh_optimizer:
                raise JobError(
                    f"checkpoint '{checkpoint_id}' holds model weights only (torchtitan's "
                    "checkpoint.last_save_model_only writes the last step that way), so the "
                    "optimizer cannot resume; continue from these weights with a fresh optimizer "
                    f"using {FRESH_OPTIMIZER_FLAG}, or resume an older full checkpoint exactly "
                    "with --checkpoint.load_step N")
            state_dict = {k: v for k, v in state_dict.items() if not k.startswith(
                NON_MODEL_PREFIXES) and k not in ("optimizer", LR_SCHEDULER, DATALOADER,
                                                  TRAIN_STATE)}
            resume_fresh = True
        if self.by_order:
            state_dict, renames, fresh = map_layers_by_order(state_dict,
                                                             metadata.state_dict_metadata)
            self.states[MODEL].pending_renames = renames
            if fresh:
                logger.info(f"Layers by order: {fresh} layers keep their fresh init")
        state_dict = check_against_checkpoint(state_dict, metadata, checkpoint_id,
                                              allow_unexpected=self.by_order,
                                              hint=self._layers_hint())
        super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        if resume_fresh:
            step = integrity.STEP_FOLDER.match(path.name)
            self._continue_at(int(step.group(1)) if step else 0)

    def _layers_hint(self) -> str:
        return ("" if self.by_order else
                "; to read a checkpoint of another pattern layer by layer of each kind, add "
                "--hybrid.load_layers_by_order")

    def _continue_at(self, step: int) -> None:
        """After a model-only load: the run continues at `step` + 1 with a fresh optimizer, the
        LR schedule and the data where the run that wrote the weights was."""
        trainer = self.states[TRAIN_STATE]
        trainer.step = step
        batches = step * trainer.gradient_accumulation_steps
        trainer.ntokens_seen = batches * self.training.local_batch_size \
            * self.training.seq_len  # per rank, as the trainer counts them
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()"
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(step):
                self.states[LR_SCHEDULER].step()
        self.states[DATALOADER].skip_batches(batches)
        logger.warning(f"Resuming model weights of step {step} with a fresh optimizer "
                       f"({FRESH_OPTIMIZER_FLAG}): training continues at step {step + 1}")
