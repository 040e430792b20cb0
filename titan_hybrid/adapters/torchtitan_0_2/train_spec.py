"""The torchtitan 0.2 TrainSpec "hybrid": what `--model.name hybrid` builds.

torchtitan's trainer calls a TrainSpec's builders one after another, hands each the job,
and keeps no link between them: tokenizer, dataloader, `model_args[flavor]` (to which it
applies the job), the model, metrics, loss, `parallelize_fn` (per stage under PP:
`pipelining_fn`), the model's `init_weights`, the optimizers, the checkpoint's adapter and
the validator. Here the builders are the methods of one `HybridBuild` per run, which resolves
once what they share and hands it to them as arguments:
- the RunConfig (training/run_config.py), built from the job once, at the first builder (or
  given by titan_hybrid.train, which built and checked it before any process group), with the
  run's model args: the object the trainer builds the model from (torchtitan's
  `update_from_config` on it changes nothing);
- the layout, validated once (in the pre-flight check when titan_hybrid.train runs the job,
  else at the first parallelize);
- the ParallelPlan that parallelizing returned: the optimizer takes it, HybridTrainer's
  checkpointer and EP-overlap schedule read `build.plan`.
The model is built with the layout-independent init materializer, which needs nothing from
the plan.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torchtitan.components.lr_scheduler import LRSchedulersContainer, build_lr_schedulers
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.config import JobConfig
from torchtitan.config import Optimizer as OptimizerConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.pipeline_parallel import (
    build_pipeline_schedule,
    pipeline_module_split,
)
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

from titan_hybrid.adapters.torchtitan_0_2.job_config import run_config
from titan_hybrid.data.loader import build_global_batch_dataloader
from titan_hybrid.data.tokenizer import build_hybrid_tokenizer
from titan_hybrid.hf.families import hybrid_state_dict_adapter
from titan_hybrid.model.args import HybridModelArgs, hybrid_flavors
from titan_hybrid.model.model import HybridModel
from titan_hybrid.parallel.init import full_tensor_materializer
from titan_hybrid.parallel.parallelize import parallelize_hybrid
from titan_hybrid.parallel.pipeline import pipeline_hybrid
from titan_hybrid.parallel.plan import ParallelPlan
from titan_hybrid.parallel.validate import validate_layout
from titan_hybrid.training.loss import build_hybrid_loss
from titan_hybrid.training.metrics import HybridMetrics
from titan_hybrid.training.optimizer import build_hybrid_optimizers
from titan_hybrid.training.run_config import RunConfig
from titan_hybrid.training.validation import HybridValidator

TRAIN_SPEC_NAME = "hybrid"


class _RunFlavors(dict):
    """The TrainSpec's `model_args`: torchtitan reads `[flavor]` once per run and applies the
    job to what it gets; it gets the run's own args (resolved by the first builder)."""

    def __init__(self, build: HybridBuild) -> None:
        super().__init__(hybrid_flavors)
        self.build = build

    def __getitem__(self, flavor: str) -> HybridModelArgs:
        assert self.build.run is not None, "the tokenizer builder resolves the run first"
        return self.build.run.model


class StepOnlyLRSchedulers(LRSchedulersContainer):
    """torchtitan 0.2's LR schedulers with torchtitan 0.3's checkpoint state: the step alone
    (`last_epoch`). torchtitan's schedules are pure functions of it and of the optimizer's base
    learning rate, so a checkpoint written under either torchtitan resumes under the other; the
    other keys of an older 0.2 checkpoint are not read."""

    def __init__(self, built: LRSchedulersContainer) -> None:
        self.schedulers = built.schedulers  # what torchtitan's builder made

    def state_dict(self) -> dict:
        return {"last_epoch": self.schedulers[0].last_epoch}

    def load_state_dict(self, state_dict: dict) -> None:
        step = state_dict["last_epoch"]
        for scheduler in self.schedulers:
            rates = [base * rate(step)
                     for base, rate in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
            scheduler.load_state_dict({**scheduler.state_dict(), "last_epoch": step,
                                       "_step_count": step + 1, "_last_lr": rates})


class HybridMetricsProcessor(HybridMetrics, MetricsProcessor):
    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims, run: RunConfig,
                 tag: str | None = None) -> None:
        MetricsProcessor.__init__(self, job_config, parallel_dims, tag)
        self.init_hybrid_metrics(run, parallel_dims)


class HybridBuild:
    """One run's builders, in torchtitan's calling order, and what they share."""

    def __init__(self, run: RunConfig | None = None) -> None:
        """`run`: the run's configuration when the caller has built and checked it
        (titan_hybrid.train's pre-flight check, which validates the layout)."""
        self.run = run
        self.layout_checked = run is not None
        self.plan = ParallelPlan()

    def resolved(self, job_config: JobConfig) -> RunConfig:
        """The run's configuration (built from the job at the first builder)."""
        if self.run is None:
            self.run = run_config(job_config)
        return self.run

    def _check_layout_once(self, parallel_dims: ParallelDims) -> None:
        if not self.layout_checked:
            validate_layout(self.run, parallel_dims.world_size)
            self.layout_checked = True

    def tokenizer(self, job_config: JobConfig):
        run = self.resolved(job_config)
        return build_hybrid_tokenizer(run.data, vocab_size=run.model.vocab_size,
                                      flavor=run.flavor)

    def dataloader(self, *, job_config: JobConfig, **kwargs):
        run = self.resolved(job_config)
        return build_global_batch_dataloader(data=run.data, training=run.training, **kwargs)

    def model(self, model_args: HybridModelArgs) -> HybridModel:
        return HybridModel(model_args, init_materializer=full_tensor_materializer)

    def metrics(self, job_config: JobConfig, parallel_dims: ParallelDims, model_args=None,
                tag: str | None = None):
        return HybridMetricsProcessor(job_config, parallel_dims, self.resolved(job_config),
                                      tag)

    def loss(self, job_config: JobConfig, **kwargs):
        run = self.resolved(job_config)
        return build_hybrid_loss(run.compile, mtp_loss_coeff=run.model.mtp_loss_coeff)

    def parallelize(self, model: nn.Module, parallel_dims: ParallelDims,
                    job_config: JobConfig) -> nn.Module:
        run = self.resolved(job_config)
        self._check_layout_once(parallel_dims)
        self.plan = parallelize_hybrid(model, parallel_dims, run)
        return model

    def pipeline(self, model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig,
                 device: torch.device, model_args: HybridModelArgs, parallelize_fn, loss_fn):
        # `parallelize_fn` is this build's own `parallelize`: the stages are parallelized by
        # pipeline_hybrid, which gathers their plans into one.
        run = self.resolved(job_config)
        self._check_layout_once(parallel_dims)
        result, self.plan = pipeline_hybrid(
            model, parallel_dims, run, device, loss_fn, split_module=pipeline_module_split,
            build_schedule=partial(build_pipeline_schedule, job_config))
        return result

    def optimizers(self, model_parts: list[nn.Module], optimizer_config: OptimizerConfig,
                   parallel_dims: ParallelDims, ft_manager=None):
        return build_hybrid_optimizers(model_parts, self.run.optimizer, self.plan)

    def lr_schedulers(self, optimizers, lr_scheduler_config, training_steps: int):
        return StepOnlyLRSchedulers(build_lr_schedulers(optimizers, lr_scheduler_config,
                                                        training_steps))

    def validator(self, *, job_config: JobConfig, loss_fn=None, **kwargs):
        return HybridValidator(run=self.resolved(job_config), **kwargs)

    def train_spec(self) -> TrainSpec:
        return TrainSpec(
            model_cls=self.model,
            model_args=_RunFlavors(self),
            parallelize_fn=self.parallelize,
            pipelining_fn=self.pipeline,
            build_optimizers_fn=self.optimizers,
            build_lr_schedulers_fn=self.lr_schedulers,
            build_dataloader_fn=self.dataloader,
            build_tokenizer_fn=self.tokenizer,
            build_loss_fn=self.loss,
            build_metrics_processor_fn=self.metrics,
            build_validator_fn=self.validator,
            state_dict_adapter=hybrid_state_dict_adapter,  # Nemotron-H's or DeepSeek's, by kinds
        )


def register_hybrid_train_spec() -> None:
    """Make `--model.name hybrid` known to torchtitan's own trainer
    (titan_hybrid.torchtitan_plugin): one run per process, so one build. HybridTrainer makes
    its own."""
    register_train_spec(TRAIN_SPEC_NAME, HybridBuild().train_spec())
