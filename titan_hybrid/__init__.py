"""titan_hybrid: hybrid Mamba2 / attention / MoE / gated-DeltaNet models on torchtitan.

Importing the package or any library module changes nothing global. The entry points do:
`titan_hybrid.train` / `titan_hybrid.launch` (titan_hybrid's trainer), and
`titan_hybrid.torchtitan_plugin`, which torchtitan's own trainer imports through
`--experimental.custom_import` (registers the TrainSpec "hybrid" and the pydoc dataset, and on
machines without an accelerator applies the CPU runtime, titan_hybrid.runtime.cpu).

From a TOML job to a stepping trainer, in order:
 1. launch.py (run_train.sh) parses the job with job_config.py (torchtitan's JobConfig plus
    `[hybrid]` and our `[parallelism]` / `[checkpoint]` fields) and checks all of it in one
    process (job_checks.py; the layout in parallel/validate.py), then starts torchrun workers.
 2. train.py, in each worker: torchtitan_plugin.activate(), the job parsed and checked again
    (the check resolves the run's model args), the kernel packages probed once
    (ops/kernels.py), then trainer.HybridTrainer.
 3. HybridTrainer is torchtitan's Trainer, built from this run's TrainSpec, a
    train_spec.HybridBuild that holds what the builders share (job, model args, plan):
    tokenizer (tokenizer.py), global-batch data loader (data/loader.py), the model args
    (model/args.py; the pattern parsed by pattern.py from model/symbols.py) and HybridModel on
    the meta device (model/model.py: one layer per pattern symbol, each kind from
    model/layer_kinds.py).
 4. parallel/parallelize.py (or parallel/pipeline.py, one call per pipeline stage) applies
    TP -> CP -> EP -> activation checkpointing -> compile -> data parallelism and returns the
    ParallelPlan (parallel/plan.py); parallel/init.py initialises the weights the same way
    under every layout.
 5. optimizer.py (with the plan), loss.py, metrics.py (kind_statistics.py collects the kinds'
    statistics), validation.py, and checkpoint/manager.py (verified saves; fused tensors split
    by the plan's layouts in checkpoint/split.py and state.py, HF formats by hf_*.py).
 6. Each step: batch.py lays out the tokens (packed documents, this CP rank's zigzag shard), the
    layers run their ops (ops/: GPU kernels through custom ops, or the torch paths), the loss
    and backward, divergence.py's check, then the optimizer step, metrics and checkpoints.
"""
