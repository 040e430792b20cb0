"""Worker for test_expert_parallel.py, run under torchrun with 2 ranks: the same MoE model on
one device and under EP=2 x FSDP (ZeRO-3 or ZeRO-2), trained for one step of 2 microbatches per
rank with and without the EP-overlap schedule. Compares logits and every gradient.

Prints one line `RESULT {json}` on rank 0.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import titan_hybrid.torchtitan_plugin  # noqa: F401  (TrainSpec, dataset; CPU runtime)
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.model import HybridModel
from titan_hybrid.parallel.data_parallel import apply_data_parallel
from titan_hybrid.parallel.ep_overlap import CombinedOneFOneB, install_overlap_hooks
from titan_hybrid.parallel.expert_parallel import apply_expert_parallel
from titan_hybrid.parallel.init import full_tensor_materializer

MICROBATCHES, ROWS, SEQ = 2, 2, 32


def loss_of(out, labels: torch.Tensor) -> torch.Tensor:
    logits_list = [out[0], *out[2:]]
    ce = sum(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                               reduction="sum") for logits in logits_list)
    return ce / (labels.numel() * MICROBATCHES * dist.get_world_size()) + out[1]


def build_parallel(args, *, strategy: str, activation_checkpoint: bool, overlap: bool):
    dense_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    sparse_mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("efsdp", "ep"))
    with torch.device("meta"):
        model = HybridModel(args, init_materializer=full_tensor_materializer)
    dispatchers = apply_expert_parallel(model, sparse_mesh["ep"])
    if activation_checkpoint:
        for key, layer in list(model.layers.items()):
            model.layers[key] = checkpoint_wrapper(layer)
    apply_data_parallel(model, dense_mesh, strategy=strategy, param_dtype=torch.float32,
                        reduce_dtype=torch.float32, expert_mesh=sparse_mesh["efsdp"])
    coordinator = install_overlap_hooks([model], dispatchers.values()) if overlap else None
    model.to_empty(device="cpu")
    model.init_weights()
    set_choice_biases(model)
    return model, coordinator


@torch.no_grad()
def set_choice_biases(model) -> None:
    """Each MoE layer's choice bias, if it has one, distinct per expert (init gives zeros)."""
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.linspace(-0.05, 0.05, buffer.numel()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pattern", default="")
    parser.add_argument("--strategy", default="optim_grads_params")
    parser.add_argument("--activation-checkpoint", type=int, default=0)
    # Nemotron 3's experts and router: squared ReLU, sigmoid scores with a choice bias (set
    # to distinct values), group-limited, scaled; and Nemotron 3 Super's latent experts.
    parser.add_argument("--nemotron-3-moe", action="store_true")
    parser.add_argument("--latent-dim", type=int, default=0)
    options = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    args = copy.deepcopy(hybrid_flavors["debug_moe"])
    args.pattern = options.pattern or args.pattern
    if options.nemotron_3_moe:
        args.moe = dataclasses.replace(
            args.moe, activation="relu2", score_func="sigmoid", score_correction_bias=True,
            n_group=2, topk_group=1, routed_scaling_factor=2.5)
    args.moe = dataclasses.replace(args.moe, latent_dim=options.latent_dim)
    args.max_seq_len = SEQ

    # Rank r's microbatch m is row block 2r + m of one global batch.
    tokens = torch.randint(0, args.vocab_size, (2 * MICROBATCHES * ROWS, SEQ),
                           generator=torch.Generator().manual_seed(1))
    blocks = tokens.split(ROWS)

    reference = HybridModel(args)
    reference.init_weights()
    set_choice_biases(reference)
    for block in blocks:
        loss_of(reference(block), block).backward()
    ref_logits = reference(blocks[MICROBATCHES * rank])[0].detach()

    results = {}
    for overlap in (False, True):
        model, coordinator = build_parallel(
            args, strategy=options.strategy,
            activation_checkpoint=bool(options.activation_checkpoint), overlap=overlap)
        mine = blocks[MICROBATCHES * rank:MICROBATCHES * (rank + 1)]
        if overlap:
            schedule = CombinedOneFOneB(model, coordinator, MICROBATCHES)
            losses = [schedule(lambda block=block: loss_of(model(block), block)).item()
                      for block in mine]
        else:
            losses = []
            for block in mine:
                loss = loss_of(model(block), block)
                loss.backward()
                losses.append(loss.item())
        grads = {name: param.grad.full_tensor() for name, param in model.named_parameters()
                 if isinstance(param.grad, DTensor)}
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        assert not missing, f"parameters without gradient: {missing}"
        with torch.no_grad():
            logits = model(mine[0])[0]
        results[overlap] = (losses, logits, grads)

    ref_params = dict(reference.named_parameters())
    (losses_off, logits_off, grads_off), (losses_on, logits_on, grads_on) = (results[False],
                                                                              results[True])

    def name_of(name: str) -> str:  # drop FSDP / checkpoint wrapper prefixes
        return name.replace("_checkpoint_wrapped_module.", "")

    report = {
        "logits_vs_reference": (logits_off - ref_logits).abs().max().item(),
        "losses_equal": losses_off == losses_on,
        "logits_equal": torch.equal(logits_off, logits_on),
        "grads_vs_reference": {},
        "grads_on_vs_off": {},
    }
    for name, grad in grads_off.items():
        ref_grad = ref_params[name_of(name)].grad
        scale = ref_grad.abs().max().clamp(min=1e-30)
        report["grads_vs_reference"][name] = ((grad - ref_grad).abs().max() / scale).item()
        report["grads_on_vs_off"][name] = ((grads_on[name] - grad).abs().max() / scale).item()
    if rank == 0:
        print("RESULT " + json.dumps(report), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
