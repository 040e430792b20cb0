"""torchtitan 0.3's ModelSpec for hybrid models, and the run's builders behind it.

`model_spec(flavor, **overrides)` is the public entry for a torchtitan 0.3 job of a user's own
(docs/torchtitan_0_3.md, "Using the model from any torchtitan job"): put it in a
`Trainer.Config` with torchtitan's components. titan_hybrid's own trainer (trainer.py) uses the same spec, built from
the run's RunConfig.

Under a stock trainer the spec's functions receive torchtitan's config sections only; the
RunConfig is then built from those at the first call (`HybridBuild.run_for`), with titan_hybrid's
defaults for what the sections do not say.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Annotated

import tyro
from torch import nn
from torchtitan.protocols import BaseModel
from torchtitan.protocols.model_spec import ModelSpec

from titan_hybrid.adapters.torchtitan_0_3.components import HybridLoss
from titan_hybrid.adapters.torchtitan_0_3.config import run_from_parts
from titan_hybrid.compat.torchtitan_0_3 import pipeline_module_splitter, pipeline_schedule_builder
from titan_hybrid.hf.families import hybrid_state_dict_adapter, model_args_from_hf
from titan_hybrid.model.args import HybridModelArgs, resolve_model_args
from titan_hybrid.model.model import HybridModel
from titan_hybrid.parallel.init import full_tensor_materializer
from titan_hybrid.parallel.parallelize import parallelize_hybrid
from titan_hybrid.parallel.pipeline import pipeline_hybrid
from titan_hybrid.parallel.plan import ParallelPlan
from titan_hybrid.parallel.validate import validate_layout
from titan_hybrid.runtime.errors import report_and_exit
from titan_hybrid.training.preflight import check_parallelism
from titan_hybrid.training.run_config import RunConfig


class TitanHybridModel(HybridModel):
    """HybridModel as torchtitan 0.3's trainer handles a model: its layers are plain
    nn.Modules, not torchtitan Modules (whose protocol its check enforces), and its weights are
    initialised by its own `init_weights`."""

    def verify_module_protocol(self) -> None:
        """Nothing to verify: titan_hybrid's layers are plain nn.Modules by design."""


@dataclass(kw_only=True, slots=True)
class HybridModelConfig(BaseModel.Config):
    """The model config a ModelSpec carries: a flavor with overrides of its fields (the
    pattern, dims, sections). The run's sequence length and seed are applied when torchtitan
    calls `update_from_config`."""

    flavor: str = "debug"
    overrides: Annotated[dict, tyro.conf.Suppress] = field(default_factory=dict)
    args: Annotated[HybridModelArgs | None, tyro.conf.Suppress] = None
    """The run's resolved model args (set by update_from_config, or by titan_hybrid's trainer,
    which resolved them before)."""

    def update_from_config(self, *, config, **kwargs) -> None:
        if self.args is None or self.args.max_seq_len != config.training.seq_len:
            self.args = self.resolve(seq_len=config.training.seq_len, seed=config.debug.seed)
        self.fit_loss(config.loss)
        self.fit_backend(config.parallelism)

    @staticmethod
    def fit_backend(parallelism) -> None:
        """titan_hybrid's parallel code runs on 0.3's `partial_dtensor` and `spmd_types`
        backends (on the latter FSDP shards over "dp_shard", parallelize.shard_dimension), not
        on `full_dtensor`, which hands the model DTensor inputs, nor spmd_types with context
        parallelism, whose FSDP dimension would span the CP ranks (DESIGN.md, "torchtitan
        0.3's SPMD backends"). One line on every rank, before the model is built."""
        backend = getattr(parallelism, "spmd_backend", "partial_dtensor")
        if backend == "full_dtensor" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            report_and_exit(ValueError(
                "parallelism.spmd_backend='full_dtensor': titan_hybrid's layers take plain "
                "tensors, not full_dtensor's DTensor inputs; use 'spmd_types' (0.3's default) "
                "or 'partial_dtensor'"))
        if backend == "spmd_types" and parallelism.context_parallel_degree > 1:
            report_and_exit(ValueError(
                f"parallelism.context_parallel_degree={parallelism.context_parallel_degree} "
                "with parallelism.spmd_backend='spmd_types': titan_hybrid's context "
                "parallelism runs on 'partial_dtensor' (set it in your config)"))

    def fit_loss(self, loss_config) -> None:
        """The job's loss must take this model's outputs: a tuple (logits, aux_loss,
        *mtp_logits) when the pattern has MoE / indexer layers or MTP depths, which only
        HybridLoss takes (given the model's MTP weight unless the job set one). torchtitan 0.3
        calls this on every rank after its process groups exist, the first point where the
        model and the loss meet: a mismatch is one line and the exit status there, not the
        loss's AttributeError at step 1."""
        if isinstance(loss_config, HybridLoss.Config):
            if loss_config.mtp_loss_coeff is None:
                loss_config.mtp_loss_coeff = self.args.mtp_loss_coeff
            return
        terms = [term for term, present in (
            ("an auxiliary loss (MoE / indexer layers)", self.args.has_aux_loss),
            ("MTP logits", self.args.parsed_pattern.mtp_depths > 0)) if present]
        if terms:
            report_and_exit(ValueError(
                f"loss: {type(loss_config).__qualname__.removesuffix('.Config')} takes logits, "
                f"but model_spec('{self.flavor}') with pattern '{self.args.pattern}' also "
                f"returns {' and '.join(terms)}; set loss=HybridLoss.Config() (from "
                "titan_hybrid.config_registry import HybridLoss)"))

    def resolve(self, *, seq_len: int, seed: int | None) -> HybridModelArgs:
        model_config = self.overrides.get("model_config", "")  # an HF folder's model
        args = resolve_model_args(self.flavor, pattern=self.overrides.get("pattern", ""),
                                  seq_len=seq_len, seed=seed,
                                  base=model_args_from_hf(model_config) if model_config else None)
        others = {k: v for k, v in self.overrides.items() if k not in ("pattern", "model_config")}
        if others:
            args = dataclasses.replace(args, **others)
            args.validate()
        return args

    def build(self, **kwargs) -> TitanHybridModel:
        return TitanHybridModel(self.args, init_materializer=full_tensor_materializer)

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        return self.args.get_nparams_and_flops(model, seq_len)


class HybridBuild:
    """One run's ModelSpec functions and what they share: the RunConfig and the ParallelPlan
    that parallelizing returned (the optimizer and checkpointer take it)."""

    def __init__(self, model_config: HybridModelConfig, run: RunConfig | None = None) -> None:
        self.model_config = model_config
        self.run = run
        self.layout_checked = run is not None
        self.plan = ParallelPlan()

    def run_for(self, *, training, parallelism, compile_config, ac_config,
                dump_folder) -> RunConfig:
        """The run's RunConfig: titan_hybrid's trainer's, else built from a stock trainer's
        sections at the first call."""
        if self.run is None:
            self.run = run_from_parts(
                self.model_config.args, flavor=self.model_config.flavor,
                dump_folder=dump_folder, training=training, parallelism=parallelism,
                compile_config=compile_config, ac_config=ac_config)
        return self.run

    def checked_run(self, *, parallel_dims, training, parallelism, compile_config, ac_config,
                    dump_folder) -> RunConfig:
        """The run, its layout (and the parallelism fields titan_hybrid refuses) checked once
        against the world (a stock trainer's job is not checked before it reaches the model
        spec)."""
        run = self.run_for(training=training, parallelism=parallelism,
                           compile_config=compile_config, ac_config=ac_config,
                           dump_folder=dump_folder)
        if not self.layout_checked:
            validate_layout(run, parallel_dims.world_size)
            check_parallelism(run.parallelism)  # what the layout leaves: fields not honoured
            self.layout_checked = True
        return run

    def parallelize(self, model: nn.Module, *, parallel_dims, **sections) -> nn.Module:
        run = self.checked_run(parallel_dims=parallel_dims, **sections)
        self.plan = parallelize_hybrid(model, parallel_dims, run)
        return model

    def pipeline(self, model: nn.Module, *, parallel_dims, device, loss_fn, model_config,
                 parallelize_fn, **sections):
        """0.3's `pipelining_fn`: this rank's stages, each parallelized like a whole model
        (titan_hybrid.parallel.pipeline). The schedule's loss is 0.3's loss function without
        its division, which titan_hybrid's GlobalTokenScaledLoss does (the EP-overlap's
        actions call it without 0.3's loss arguments)."""
        run = self.checked_run(parallel_dims=parallel_dims, **sections)
        (schedule, parts, has_first, has_last), self.plan = pipeline_hybrid(
            model, parallel_dims, run, device, lambda pred, labels: loss_fn(pred, labels)[0],
            split_module=pipeline_module_splitter(parallel_dims),
            build_schedule=pipeline_schedule_builder(sections["parallelism"],
                                                     sections["training"].local_batch_size))
        return schedule, parts, has_first, has_last

    def state_dict_adapter(self, model_config: HybridModelConfig, hf_assets_path):
        return hybrid_state_dict_adapter(model_config.args, hf_assets_path)

    def model_spec(self) -> ModelSpec:
        return ModelSpec(
            name="hybrid",
            flavor=self.model_config.flavor,
            model=self.model_config,
            parallelize_fn=self.parallelize,
            pipelining_fn=self.pipeline,
            post_optimizer_build_fn=None,
            state_dict_adapter=self.state_dict_adapter,
        )


def model_spec(flavor: str = "debug", **overrides) -> ModelSpec:
    """The ModelSpec of a hybrid flavor for a torchtitan 0.3 job, with `overrides` of its
    model args (`pattern="M*M-E"`, `dim=512`, ...). Checked here: an unknown flavor or field,
    or shapes that cannot work, raise ValueError."""
    config = HybridModelConfig(flavor=flavor, overrides=dict(overrides))
    config.resolve(seq_len=1, seed=None)  # the flavor, the fields and the pattern exist
    return HybridBuild(config).model_spec()
