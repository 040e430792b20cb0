"""Entry point: `python -m titan_hybrid.train --job.config_file train_configs/hybrid.toml`.

Same command line and the same Trainer as `python -m torchtitan.train`, with two additions:
the job is validated against the world size and the model before any process group, mesh or
model exists, and on CPU the process leaves with os._exit once training is done (see below).
"""

import copy
import os
import sys

import titan_hybrid  # noqa: F401  (registers the TrainSpec; CPU patches precede the trainer)
from titan_hybrid.runtime import cpu


def validate_job(config) -> None:
    """User errors in the job, raised as ValueError before any heavy work."""
    from titan_hybrid.model.args import hybrid_flavors
    from titan_hybrid.parallel.validate import validate_layout

    if config.model.name != "hybrid":
        return
    model_args = copy.deepcopy(hybrid_flavors[config.model.flavor])
    model_args.update_from_config(config)
    validate_layout(config, model_args, int(os.environ.get("WORLD_SIZE", "1")))
    if config.checkpoint.initial_load_in_hf or config.checkpoint.last_save_in_hf:
        from titan_hybrid.checkpoint.hf_nemotron_h import check_nemotron_h_compatible

        check_nemotron_h_compatible(model_args)


def hybrid_trainer_class():
    """torchtitan's Trainer whose checkpoints store fused tensors as logical components."""
    from torchtitan.components.checkpoint import MODEL
    from torchtitan.train import Trainer

    from titan_hybrid.checkpoint.state import (
        SplitModelWrapper,
        check_against_checkpoint,
        map_layers_by_order,
    )
    from titan_hybrid.model.layout import documents_from_bos
    from titan_hybrid.parallel.context_parallel import shard_batch
    from titan_hybrid.parallel.ep_overlap import CombinedOneFOneB
    from titan_hybrid.parallel.validate import expert_parallel_overlap

    def checked_dcp_load(dcp_load, model_wrapper, by_order: bool, sd_adapter):
        def load(state_dict, checkpoint_id, from_hf, from_quantized):
            if from_hf:
                metadata = sd_adapter.get_hf_storage_reader(checkpoint_id).read_metadata()
                check_against_checkpoint(sd_adapter.to_hf(state_dict), metadata, checkpoint_id)
            else:
                import torch.distributed.checkpoint as dcp
                from torchtitan.tools.logging import logger

                metadata = dcp.FileSystemReader(checkpoint_id).read_metadata()
                if by_order:
                    state_dict, renames, fresh = map_layers_by_order(
                        state_dict, metadata.state_dict_metadata)
                    model_wrapper.pending_renames = renames
                    if fresh:
                        logger.info(f"Layers by order: {fresh} layers keep their fresh init")
                state_dict = check_against_checkpoint(state_dict, metadata, checkpoint_id,
                                                      allow_unexpected=by_order)
            return dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)

        return load

    def dcp_save_with_hf_config(dcp_save, model_args):
        """An HF save also writes the config.json that `transformers` needs to read it."""
        def save(state_dict, checkpoint_id, *args, to_hf=False, **kwargs):
            result = dcp_save(state_dict, checkpoint_id, *args, to_hf=to_hf, **kwargs)
            import torch.distributed as dist

            if to_hf and (not dist.is_initialized() or dist.get_rank() == 0):
                import json

                from titan_hybrid.checkpoint.hf_nemotron_h import nemotron_h_config

                with open(os.path.join(checkpoint_id, "config.json"), "w") as f:
                    json.dump(nemotron_h_config(model_args), f, indent=2)
            return result

        return save

    class HybridTrainer(Trainer):
        ep_overlap = None  # CombinedOneFOneB with --parallelism.expert_parallel_overlap

        def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
            if self.ep_overlap is not None:
                return self.overlapped_forward_backward(input_dict, labels, global_valid_tokens)
            if not self.parallel_dims.pp_enabled:
                return super().forward_backward_step(
                    input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens)
            # Pipeline microbatch losses are divided by the token count before their backward
            # (titan_hybrid.parallel.pipeline); torchtitan divides their sum once more.
            self.pp_schedule.scaled_loss.global_valid_tokens = global_valid_tokens
            loss = super().forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens)
            return loss * global_valid_tokens if self.pp_has_last_stage else loss

        def overlapped_forward_backward(self, input_dict, labels, global_valid_tokens):
            """This microbatch's forward, run together with the previous one's backward."""
            inputs, labels, extra_inputs, extra_kwargs = self.post_dataloading_process(
                input_dict, labels)

            def forward():
                with self.train_context(), self.maybe_enable_amp:
                    pred = self.model_parts[0](inputs, **extra_inputs, **extra_kwargs)
                    return self.loss_fn(pred, labels) / global_valid_tokens

            return self.ep_overlap(forward)

        def post_dataloading_process(self, input_dict, labels):
            """Packed-document layout (hybrid.document_masking), then this CP rank's shard.
            `positions` / `seq_idx` go in extra_kwargs, which reach every pipeline stage."""
            inputs = input_dict["input"]
            extra_inputs = {k: v for k, v in input_dict.items() if k != "input"}
            extra_kwargs = {}
            if self.document_masking:
                seq_idx, positions = documents_from_bos(inputs, self.tokenizer.bos_id)
                extra_kwargs.update(seq_idx=seq_idx, positions=positions)
            if self.parallel_dims.cp_enabled:
                inputs, labels, extra_kwargs = shard_batch(
                    inputs, labels, extra_kwargs, self.parallel_dims.get_mesh("cp").get_group())
            return inputs, labels, extra_inputs, extra_kwargs

        def __init__(self, job_config):
            self.document_masking = getattr(getattr(job_config, "hybrid", None),
                                            "document_masking", False)
            super().__init__(job_config)
            # Under PP the overlap runs inside the pipeline schedule (ep_overlap_pipeline.py).
            if expert_parallel_overlap(job_config) and not self.parallel_dims.pp_enabled:
                self.ep_overlap = CombinedOneFOneB(self.model_parts[0],
                                                   self.gradient_accumulation_steps)
            if job_config.model.name == "hybrid":
                wrapper = SplitModelWrapper(self.model_parts)
                self.checkpointer.states[MODEL] = wrapper
                by_order = getattr(getattr(job_config, "hybrid", None), "load_layers_by_order",
                                   False)
                sd_adapter = getattr(self.checkpointer, "sd_adapter", None)  # None: disabled
                self.checkpointer.dcp_load = checked_dcp_load(
                    self.checkpointer.dcp_load, wrapper, by_order, sd_adapter)
                self.checkpointer.dcp_save = dcp_save_with_hf_config(
                    self.checkpointer.dcp_save, self.model_args)

    return HybridTrainer


def main() -> None:
    import torchtitan.train as torchtitan_train
    from torchtitan.config import ConfigManager

    # torchtitan's main() parses the command line itself; check the parsed job first.
    validate_job(ConfigManager().parse_args(sys.argv[1:]))
    torchtitan_train.main(hybrid_trainer_class())
    if cpu.accelerator_available():
        return
    # gloo's C++ teardown intermittently aborts at interpreter exit ("terminate called without
    # an active exception"), turning a finished run into a failed torchrun. The process group is
    # already destroyed here, so skip the interpreter's teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
