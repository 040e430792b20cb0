"""titan_hybrid's components as torchtitan 0.3 builds them: each a Config whose `build` gets
torchtitan's fixed keyword arguments and makes titan_hybrid's component.

What those arguments lack (the RunConfig, the ParallelPlan that parallelizing returned) comes
from the run's HybridBuild, which HybridTrainer's constructor makes current while torchtitan's
constructor runs (`building`): the configs themselves hold no run objects (torchtitan copies
and serializes them).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass, field
from functools import partial

from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import BaseLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.config import CompileConfig, Configurable

from titan_hybrid.adapters.torchtitan_0_3.config import (
    CheckpointOptions,
    HybridOptimizerSettings,
    ValidatorOptions,
)
from titan_hybrid.adapters.torchtitan_0_3.user_errors import report_user_error
from titan_hybrid.config.sections import CheckpointSection, OptimizerSection, section_from
from titan_hybrid.data.loader import build_global_batch_dataloader, build_text_dataloader
from titan_hybrid.training.loss import hybrid_loss
from titan_hybrid.training.metrics import HybridMetrics
from titan_hybrid.training.optimizer import build_hybrid_optimizers
from titan_hybrid.training.preflight import check_checkpoint
from titan_hybrid.training.validation import HybridValidator

_current_build = contextvars.ContextVar("titan_hybrid_build")


@contextlib.contextmanager
def building(build):
    """Make `build` (a model_spec.HybridBuild) the one the component configs read."""
    token = _current_build.set(build)
    try:
        yield
    finally:
        _current_build.reset(token)


def current_build():
    build = _current_build.get(None)
    if build is None:
        raise RuntimeError("titan_hybrid's components are built by titan_hybrid's trainer "
                           "(torchtitan.train --module titan_hybrid); in a job of your own use "
                           "torchtitan's components with titan_hybrid's model_spec")
    return build


class HybridLoss(BaseLoss):
    """Token cross-entropy + the layers' auxiliary losses (MoE load balancing, DSA / V4
    indexers) + MTP losses (training/loss.py), summed and divided by the step's global
    valid-token count, as torchtitan 0.3's losses are: the loss of a hybrid model whatever its
    pattern, in titan_hybrid's trainer and in a job of the user's own (docs/torchtitan_0_3.md,
    "Using the model from any torchtitan job"), where torchtitan's CrossEntropyLoss takes only logits."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        mtp_loss_coeff: float | None = None
        """The MTP depths' weight; None: the model's (its flavor's `mtp_loss_coeff`), set
        when the trainer updates the model config from the job's."""

    def __init__(self, config: Config, *, compile_config: CompileConfig | None = None):
        coeff = {} if config.mtp_loss_coeff is None else {"mtp_loss_coeff": config.mtp_loss_coeff}
        self.fn = partial(hybrid_loss, **coeff)
        self._maybe_compile(compile_config)


@dataclass(kw_only=True, slots=True)
class HybridDataLoaderConfig(BaseDataLoader.Config):
    """titan_hybrid's layout-independent global batches (data/loader.py): `dataset` is "pydoc"
    or a torchtitan dataset, `dataset_path` a local corpus. Every layout reads the same global
    batch (torchtitan's loaders give each data-parallel rank documents of its own), so a
    user's job on it gives the one-process curve under FSDP too (config_registry exports it as
    HybridDataLoader)."""

    dataset: str = "pydoc"

    def build(self, *, dp_world_size: int, dp_rank: int, tokenizer, local_batch_size: int,
              seq_len: int | None = None, **kwargs):
        build = _current_build.get(None)
        if build is None:  # a user's own job (torchtitan's Trainer): the section's dataset
            return build_text_dataloader(self.dataset, self.dataset_path, tokenizer,
                                         seq_len=seq_len, local_batch_size=local_batch_size,
                                         dp_rank=dp_rank, dp_world_size=dp_world_size)
        # Under PP torchtitan 0.3 fetches one microbatch at a time (local_batch_size is then
        # the microbatch size): the same rows as a whole batch, in consecutive pieces.
        return build_global_batch_dataloader(dp_world_size, dp_rank, tokenizer, build.run.data,
                                             build.run.training,
                                             microbatch_size=local_batch_size)


class HybridOptimizers(Configurable):
    """The `--optimizer.*` section of titan_hybrid's trainer (HybridOptimizerSettings' fields);
    its build makes training/optimizer.py's container, with the run's ParallelPlan."""

    @dataclass(kw_only=True, slots=True)
    class Config(HybridOptimizerSettings, Configurable.Config):
        def build(self, *, model_parts):
            return build_hybrid_optimizers(model_parts, section_from(OptimizerSection, self),
                                           current_build().plan)


def _held_out_documents() -> BaseDataLoader.Config:
    return BaseDataLoader.Config(dataset="pydoc")


@dataclass(kw_only=True, slots=True)
class HybridValidatorConfig(ValidatorOptions):
    """`--validator.*`: titan_hybrid's validator (training/validation.py), with the window
    shape of its own (the TOML jobs' validation.seq_len / local_batch_size)."""

    dataloader: BaseDataLoader.Config = field(default_factory=_held_out_documents)

    def __post_init__(self) -> None:
        """Not torchtitan's assertion on `steps` (a traceback): titan_hybrid's pre-flight
        checks the section, naming the field and the value (training/validation.py)."""

    def build(self, *, dp_world_size, dp_rank, tokenizer, parallel_dims, validation_context,
              metrics_processor, pp_schedule=None, pp_has_first_stage=None,
              pp_has_last_stage=None, **kwargs):
        # torchtitan 0.3 trains without autocast (its mixed precision is FSDP's), so
        # validation runs without it too.
        return HybridValidator(
            run=current_build().run, dp_world_size=dp_world_size, dp_rank=dp_rank,
            tokenizer=tokenizer, parallel_dims=parallel_dims,
            validation_context=validation_context, maybe_enable_amp=contextlib.nullcontext(),
            metrics_processor=metrics_processor, pp_schedule=pp_schedule,
            pp_has_first_stage=pp_has_first_stage, pp_has_last_stage=pp_has_last_stage)


class HybridMetricsProcessor(HybridMetrics, MetricsProcessor):
    """torchtitan 0.3's metrics processor with titan_hybrid's additions (training/metrics.py:
    the exact loss-curve file, the pipeline's loss on every rank, the kinds' statistics)."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass

    def __init__(self, config: Config, *, parallel_dims, **kwargs) -> None:
        MetricsProcessor.__init__(self, config, parallel_dims=parallel_dims, **kwargs)
        self.init_hybrid_metrics(current_build().run, parallel_dims)


@dataclass(kw_only=True, slots=True)
class HybridCheckpointConfig(CheckpointOptions):
    """`--checkpoint.*` with titan_hybrid's field and default (as in a 0.2 job): the last step's
    checkpoint holds the optimizer too, so a finished run can be extended. torchtitan builds
    its own manager from it; HybridTrainer replaces that with titan_hybrid's
    (checkpoint/manager.py), as under 0.2."""

    def __post_init__(self) -> None:
        # 0.3 wants an absolute initial_load_path (0.2 took a relative one), and an HF export
        # model-only (titan_hybrid's manager makes it so whatever this says).
        if self.initial_load_path and "://" not in self.initial_load_path:
            self.initial_load_path = os.path.abspath(self.initial_load_path)
        self.last_save_model_only = self.last_save_model_only or self.last_save_in_hf
        try:  # titan_hybrid's checks first: their messages name the field and the value
            check_checkpoint(section_from(CheckpointSection, self))
        except ValueError as error:
            report_user_error(error)
        try:
            CheckpointManager.Config.__post_init__(self)
        except ValueError as error:
            report_user_error(ValueError(f"checkpoint: {error}"))
