"""torchtitan 0.3's Trainer with titan_hybrid's model, components, input layout and checks.

`python -m torchtitan.train --module titan_hybrid --config hybrid` builds this trainer from the
config function `hybrid` (titan_hybrid/config_registry.py), and titan_hybrid's launcher builds
it from a TOML job (front_end.py). Its Config adds titan_hybrid's sections to torchtitan's
(`--hybrid.*`, titan_hybrid's `--parallelism.*` fields, the `--optimizer.*` of the TOML jobs); a
value titan_hybrid cannot run stops the parse with one line (`__post_init__`, which tyro runs on
the final config). As under 0.2 (torchtitan_0_2/trainer.py):
- checkpoints: HybridCheckpointManager replaces the CheckpointManager torchtitan builds;
- divergence: a non-finite loss or gradient norm on any rank stops the run, in one line, before
  the optimizer applies the step;
- inputs: packed-document layout and this CP rank's zigzag shard;
- EP-overlap at PP = 1: each microbatch's forward runs with the previous one's backward;
- loss parallelism under TP and bf16 autocast without FSDP, which 0.3's own trainer dropped;
- the end: all ranks meet at a barrier instead of rank 0 sleeping 2 s.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel
from torchtitan.config import TORCH_DTYPE_MAP, TrainingConfig
from torchtitan.tools import utils
from torchtitan.trainer import Trainer

from titan_hybrid.adapters.torchtitan_0_3.components import (
    HybridCheckpointConfig,
    HybridDataLoaderConfig,
    HybridLoss,
    HybridMetricsProcessor,
    HybridOptimizers,
    HybridValidatorConfig,
    building,
)
from titan_hybrid.adapters.torchtitan_0_3.config import (
    HybridActivationCheckpoint,
    HybridOptions,
    HybridParallelismConfig,
    HybridQuantize,
    run_config,
)
from titan_hybrid.adapters.torchtitan_0_3.model_spec import HybridBuild, HybridModelConfig
from titan_hybrid.adapters.torchtitan_0_3.user_errors import report_user_error
from titan_hybrid.checkpoint.manager import HybridCheckpointManager, replaced_without_a_group
from titan_hybrid.compat.process_groups import log_process_groups
from titan_hybrid.compat.torchtitan_0_3 import without_final_sleep
from titan_hybrid.data.tokenizer import resolve_assets_path
from titan_hybrid.parallel.ep_overlap import CombinedOneFOneB
from titan_hybrid.parallel.pipeline import scaled_loss_of
from titan_hybrid.quantize.float8 import float8_scales_step_hook
from titan_hybrid.runtime.errors import reported_at_once
from titan_hybrid.training.batch import prepare_batch
from titan_hybrid.training.divergence import DivergenceGuard
from titan_hybrid.training.preflight import check_run


def _training_defaults() -> TrainingConfig:
    # torchtitan captures the step in a CUDA graph by default; titan_hybrid's layers (custom
    # kernels, host-side routing counts) are not capture-safe.
    return TrainingConfig(disable_cuda_graphs=True)


class _CheckpointManager(HybridCheckpointManager):
    """torchtitan 0.3 loads the checkpoint inside Trainer.train, under torchrun's error
    recorder: a checkpoint that cannot serve this job is reported here, in one line."""

    def load(self, *args, **kwargs):
        with reported_at_once():
            return super().load(*args, **kwargs)


class HybridTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        hybrid: HybridOptions = field(default_factory=HybridOptions)
        hf_assets_path: str = "pydoc_bpe"
        training: TrainingConfig = field(default_factory=_training_defaults)
        parallelism: HybridParallelismConfig = field(default_factory=HybridParallelismConfig)
        optimizer: HybridOptimizers.Config = field(default_factory=HybridOptimizers.Config)
        dataloader: HybridDataLoaderConfig = field(default_factory=HybridDataLoaderConfig)
        loss: HybridLoss.Config = field(default_factory=HybridLoss.Config)
        activation_checkpoint: HybridActivationCheckpoint = field(
            default_factory=HybridActivationCheckpoint)
        validator: HybridValidatorConfig = field(default_factory=HybridValidatorConfig)
        metrics: HybridMetricsProcessor.Config = field(
            default_factory=HybridMetricsProcessor.Config)
        checkpoint: HybridCheckpointConfig = field(default_factory=HybridCheckpointConfig)
        quantize: HybridQuantize = field(default_factory=HybridQuantize)

        def __post_init__(self):
            Trainer.Config.__post_init__(self)
            try:  # the pre-flight checks, on the config as the command line left it
                run = run_config(self)
                # In a torchrun worker; titan_hybrid's launcher checks the layout against the
                # world it is about to start, before WORLD_SIZE exists.
                if "WORLD_SIZE" in os.environ:
                    check_run(run, int(os.environ["WORLD_SIZE"]))
            except ValueError as error:
                report_user_error(error)

    def __init__(self, config: Config) -> None:
        run = run_config(config)
        self.run = run
        self.build = HybridBuild(HybridModelConfig(flavor=run.flavor, args=run.model), run)
        config.model_spec = self.build.model_spec()
        config.loss.mtp_loss_coeff = run.model.mtp_loss_coeff
        config.hf_assets_path = str(resolve_assets_path(config.hf_assets_path))
        with building(self.build), replaced_without_a_group(config.checkpoint), \
                warnings.catch_warnings():
            # torchtitan builds torch.autocast("cpu", float32) for an fp32 single-device run;
            # torch disables it with a warning. fp32 needs no autocast: nothing is lost.
            warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype")
            super().__init__(config)
        self.document_masking = run.hybrid.document_masking
        if run.float8.precompute_float8_dynamic_scale_for_fsdp:
            self.optimizers.register_step_post_hook(float8_scales_step_hook(self.model_parts))
        self.checkpointer = self._hybrid_checkpointer(self.checkpointer)
        self.divergence_guard = DivergenceGuard(self.model_parts,
                                                self.gradient_accumulation_steps)
        # Under PP the overlap runs inside the pipeline schedule (ep_overlap_pipeline.py).
        self.ep_overlap = None
        if run.parallelism.expert_parallel_overlap and not self.parallel_dims.pp_enabled:
            self.ep_overlap = CombinedOneFOneB(self.model_parts[0], self.build.plan.overlap,
                                               self.gradient_accumulation_steps)

    def _hybrid_checkpointer(self, built) -> HybridCheckpointManager:
        """Ours, with the same inputs as the one torchtitan's constructor just built."""
        built.close()
        return _CheckpointManager(
            config=self.config.checkpoint,
            dataloader=self.dataloader,
            model_parts=self.model_parts,
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self},
            sd_adapter=built.sd_adapter if built.enable else None,
            base_folder=self.run.dump_folder,
            model_args=self.run.model,
            training=self.run.training,
            load_layers_by_order=self.run.hybrid.load_layers_by_order,
            resume_with_fresh_optimizer=self.run.checkpoint.resume_with_fresh_optimizer,
            tokenizer_folder=self.config.hf_assets_path,
            layouts=self.build.plan.layouts,
        )

    @property
    def train_context(self):
        return self._train_context

    @train_context.setter
    def train_context(self, spmd_context) -> None:
        """torchtitan 0.3 sets its SPMD context here (and hands it to the validator); around
        it titan_hybrid keeps what 0.2's train context and autocast did: loss parallelism under
        TP (the LM head's logits are vocab-sharded; the backward needs it too), and bf16
        autocast where no FSDP casts the parameters (one device, plain DDP)."""
        dims, training = self.parallel_dims, self.run.training
        parallel_loss = dims.tp_enabled and not self.run.parallelism.disable_loss_parallel
        autocast = (not dims.fsdp_enabled and not dims.tp_enabled and not dims.pp_enabled
                    and training.mixed_precision_param != "float32")

        @contextlib.contextmanager
        def context():
            with contextlib.ExitStack() as stack:
                stack.enter_context(spmd_context())
                if parallel_loss:
                    stack.enter_context(loss_parallel())
                if autocast:
                    stack.enter_context(torch.autocast(
                        utils.device_type, dtype=TORCH_DTYPE_MAP[training.mixed_precision_param]))
                yield

        self._train_context = context

    def train(self) -> None:
        with without_final_sleep():
            super().train()
        if dist.is_initialized():
            dist.barrier()  # what torchtitan's final 2 s sleep on rank 0 stands in for
            log_process_groups()

    def train_step(self, data_iterator) -> None:
        # A divergence is one line and the exit status under `torchtitan.train` too: torchrun's
        # error recorder around Trainer.train would print its traceback.
        with reported_at_once():
            super().train_step(data_iterator)

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        if self.parallel_dims.pp_enabled:  # for the actions that get no loss arguments
            scaled_loss_of(self.pp_schedule).global_valid_tokens = global_valid_tokens
        if self.ep_overlap is not None:
            loss = self._overlapped_forward_backward(input_dict, labels, global_valid_tokens)
        else:
            loss = super().forward_backward_step(input_dict=input_dict, labels=labels,
                                                 global_valid_tokens=global_valid_tokens)
        self.divergence_guard.after_microbatch(loss, self.step)
        return loss

    def _overlapped_forward_backward(self, input_dict, labels, global_valid_tokens):
        """This microbatch's forward, run together with the previous one's backward."""
        inputs, labels, extra_kwargs = self.post_dataloading_process(input_dict, labels)

        def forward():
            with self.train_context():
                pred = self.model_parts[0](inputs, **extra_kwargs)
                return self.loss_fn(pred, labels, global_valid_tokens)[0]

        return self.ep_overlap(forward)

    def post_dataloading_process(self, input_dict, labels):
        cp_group = (self.parallel_dims.get_mesh("cp").get_group()
                    if self.parallel_dims.cp_enabled else None)
        inputs, labels, extra_inputs, extra_kwargs = prepare_batch(
            input_dict, labels, document_masking=self.document_masking,
            bos_id=self.tokenizer.bos_id, cp_group=cp_group,
            token_ids=self.run.model.routes_by_token)
        self.ntokens_seen += labels.numel()  # torchtitan 0.3 counts here, after the CP split
        return inputs, labels, {**extra_inputs, **extra_kwargs}
