"""The torchtitan TrainSpec "hybrid": what `--model.name hybrid` builds."""

from __future__ import annotations

from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

from titan_hybrid.checkpoint.hf_formats import hybrid_state_dict_adapter
from titan_hybrid.data.loader import build_global_batch_dataloader
from titan_hybrid.loss import build_hybrid_loss
from titan_hybrid.metrics import build_hybrid_metrics_processor
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.model import HybridModel
from titan_hybrid.optimizer import build_hybrid_optimizers
from titan_hybrid.parallel.parallelize import parallelize_hybrid
from titan_hybrid.parallel.pipeline import pipeline_hybrid
from titan_hybrid.tokenizer import build_hybrid_tokenizer
from titan_hybrid.validation import build_hybrid_validator

TRAIN_SPEC_NAME = "hybrid"


def hybrid_train_spec() -> TrainSpec:
    return TrainSpec(
        model_cls=HybridModel,
        model_args=hybrid_flavors,
        parallelize_fn=parallelize_hybrid,
        pipelining_fn=pipeline_hybrid,
        build_optimizers_fn=build_hybrid_optimizers,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_global_batch_dataloader,
        build_tokenizer_fn=build_hybrid_tokenizer,
        build_loss_fn=build_hybrid_loss,
        build_metrics_processor_fn=build_hybrid_metrics_processor,
        build_validator_fn=build_hybrid_validator,
        state_dict_adapter=hybrid_state_dict_adapter,  # Nemotron-H's or DeepSeek's, by kinds
    )


def register_hybrid_train_spec() -> None:
    """Make `--model.name hybrid` known to torchtitan (titan_hybrid.torchtitan_plugin)."""
    register_train_spec(TRAIN_SPEC_NAME, hybrid_train_spec())
