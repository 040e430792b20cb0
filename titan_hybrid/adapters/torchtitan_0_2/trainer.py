"""torchtitan 0.2's Trainer with titan_hybrid's checkpoints, divergence guard and input layout.

- checkpoints: HybridCheckpointManager (checkpoint/manager.py) replaces the CheckpointManager
  torchtitan's constructor builds: verified, crash-consistent saves with fallback on load;
- divergence: after each step's last microbatch, a non-finite loss or gradient norm on any rank
  stops the run before the optimizer applies it (divergence.py);
- inputs: packed-document layout (`hybrid.document_masking`) and this CP rank's zigzag shard;
- EP-overlap at PP = 1: each microbatch's forward runs with the previous one's backward;
- the end: all ranks meet at a barrier instead of rank 0 sleeping 2 s (compat.torchtitan).

The TrainSpec is this run's own HybridBuild (train_spec.py), so the ParallelPlan it keeps is
this run's: the checkpointer and the EP-overlap schedule take it from there.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.distributed as dist
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.protocols.train_spec import TrainSpec
from torchtitan.train import Trainer

from titan_hybrid.adapters.torchtitan_0_2.train_spec import HybridBuild
from titan_hybrid.checkpoint.manager import HybridCheckpointManager, replaced_without_a_group
from titan_hybrid.compat.process_groups import log_process_groups
from titan_hybrid.compat.torchtitan_0_2 import without_final_sleep
from titan_hybrid.data.tokenizer import resolve_assets_path
from titan_hybrid.parallel.ep_overlap import CombinedOneFOneB
from titan_hybrid.parallel.pipeline import scaled_loss_of
from titan_hybrid.quantize.float8 import float8_scales_step_hook
from titan_hybrid.training.batch import prepare_batch
from titan_hybrid.training.divergence import DivergenceGuard
from titan_hybrid.training.run_config import RunConfig


class HybridTrainer(Trainer):
    ep_overlap: CombinedOneFOneB | None = None

    # torchtitan's constructor assigns the TrainSpec registered under `model.name` to
    # `self.train_spec`; this trainer uses its own build of that spec instead.
    @property
    def train_spec(self) -> TrainSpec:
        return self._train_spec

    @train_spec.setter
    def train_spec(self, registered: TrainSpec) -> None:
        # run_config has made sure that `model.name` is "hybrid".
        self._train_spec = self.build.train_spec()

    def __init__(self, job_config, run: RunConfig | None = None) -> None:
        """`run`: the job's RunConfig, checked by the pre-flight check (preflight.check_run,
        which validated the layout too); without it the build makes and checks it."""
        self.build = HybridBuild(run)
        # titan_hybrid converts the model itself, with the layer kinds' high-precision modules
        # (parallelize_hybrid, quantize/float8.py); torchtitan's converter would swap them too.
        job_config = dataclasses.replace(
            job_config, model=dataclasses.replace(job_config.model, converters=[]))
        with replaced_without_a_group(job_config.checkpoint), warnings.catch_warnings():
            # torchtitan builds torch.autocast("cpu", float32) for an fp32 single-device run;
            # torch disables it with a warning. fp32 needs no autocast: nothing is lost.
            warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype")
            super().__init__(job_config)
        run = self.run = self.build.run
        if run.float8.precompute_float8_dynamic_scale_for_fsdp:
            self.optimizers.register_step_post_hook(float8_scales_step_hook(self.model_parts))
        self.document_masking = run.hybrid.document_masking
        self.checkpointer = self._hybrid_checkpointer(self.checkpointer)
        self.divergence_guard = DivergenceGuard(self.model_parts,
                                                self.gradient_accumulation_steps)
        # Under PP the overlap runs inside the pipeline schedule (ep_overlap_pipeline.py).
        if run.parallelism.expert_parallel_overlap and not self.parallel_dims.pp_enabled:
            self.ep_overlap = CombinedOneFOneB(self.model_parts[0], self.build.plan.overlap,
                                               self.gradient_accumulation_steps)

    def train(self) -> None:
        with without_final_sleep():
            super().train()
        if dist.is_initialized():
            dist.barrier()  # what torchtitan's final 2 s sleep on rank 0 stands in for
            log_process_groups()

    def _hybrid_checkpointer(self, built: CheckpointManager) -> HybridCheckpointManager:
        """Ours, with the same inputs as the one torchtitan's constructor just built."""
        built.close()
        job_config = self.job_config
        return HybridCheckpointManager(
            dataloader=self.dataloader,
            model_parts=self.model_parts,
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self},
            checkpoint_config=job_config.checkpoint,
            sd_adapter=built.sd_adapter if built.enable else None,
            base_folder=self.run.dump_folder,
            model_args=self.run.model,
            training=self.run.training,
            load_layers_by_order=self.run.hybrid.load_layers_by_order,
            resume_with_fresh_optimizer=self.run.checkpoint.resume_with_fresh_optimizer,
            tokenizer_folder=str(resolve_assets_path(self.run.data.tokenizer_path)),
            layouts=self.build.plan.layouts,
        )

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        loss = self._forward_backward(input_dict, labels, global_valid_tokens)
        self.divergence_guard.after_microbatch(loss, self.step)
        return loss

    def _forward_backward(self, input_dict, labels, global_valid_tokens) -> torch.Tensor:
        if self.ep_overlap is not None:
            return self._overlapped_forward_backward(input_dict, labels, global_valid_tokens)
        if not self.parallel_dims.pp_enabled:
            return super().forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens)
        # Pipeline microbatch losses are divided by the token count before their backward
        # (titan_hybrid.parallel.pipeline); torchtitan divides their sum once more.
        scaled_loss_of(self.pp_schedule).global_valid_tokens = global_valid_tokens
        loss = super().forward_backward_step(
            input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens)
        return loss * global_valid_tokens if self.pp_has_last_stage else loss

    def _overlapped_forward_backward(self, input_dict, labels, global_valid_tokens):
        """This microbatch's forward, run together with the previous one's backward."""
        inputs, labels, extra_inputs, extra_kwargs = self.post_dataloading_process(
            input_dict, labels)

        def forward():
            with self.train_context(), self.maybe_enable_amp:
                pred = self.model_parts[0](inputs, **extra_inputs, **extra_kwargs)
                return self.loss_fn(pred, labels) / global_valid_tokens

        return self.ep_overlap(forward)

    def post_dataloading_process(self, input_dict, labels):
        cp_group = (self.parallel_dims.get_mesh("cp").get_group()
                    if self.parallel_dims.cp_enabled else None)
        return prepare_batch(input_dict, labels, document_masking=self.document_masking,
                             bos_id=self.tokenizer.bos_id, cp_group=cp_group,
                             token_ids=self.run.model.routes_by_token)
