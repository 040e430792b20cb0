"""Worker for test_tensor_parallel.py, run under torchrun: builds the same model on one device
and under TP (+SP, + optional FSDP) and compares logical weights, logits and every gradient.

Prints one line `RESULT {json}` on rank 0.
"""

from __future__ import annotations

import argparse
import copy
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import titan_hybrid.torchtitan_plugin  # noqa: F401  (TrainSpec, dataset; CPU runtime)
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.common import tensor_parallel_layouts
from titan_hybrid.model.model import HybridModel
from titan_hybrid.parallel.data_parallel import apply_data_parallel
from titan_hybrid.parallel.init import full_tensor_materializer
from titan_hybrid.parallel.tensor_parallel import (
    apply_tensor_parallel,
    deinterleave_from_tp,
)


def logical(model: torch.nn.Module, name: str, tensor: torch.Tensor, tp: int) -> torch.Tensor:
    """Full logical value of a (possibly sharded, possibly interleaved) parameter or grad."""
    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return deinterleave_from_tp(full, tensor_parallel_layouts(model)[name], tp)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--pattern", default="")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--sequence-parallel", type=int, default=1)
    options = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    args = copy.deepcopy(hybrid_flavors[options.flavor])
    args.pattern = options.pattern or args.pattern
    args.max_seq_len = 64

    reference = HybridModel(args)
    reference.init_weights()

    if options.dp > 1:
        mesh = init_device_mesh("cpu", (options.dp, options.tp), mesh_dim_names=("dp", "tp"))
        tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    else:
        tp_mesh = init_device_mesh("cpu", (options.tp,), mesh_dim_names=("tp",))
        dp_mesh = None
    with torch.device("meta"):
        model = HybridModel(args, init_materializer=full_tensor_materializer)
    layouts = tensor_parallel_layouts(model)
    partial = apply_tensor_parallel(model, tp_mesh, layouts,
                                    sequence_parallel=bool(options.sequence_parallel),
                                    loss_parallel=False)
    # What the plan reports as partial over the TP group: replicated parameters only, among
    # them GDN's norm shared by all heads; with sequence parallelism every replicated one.
    assert set(partial.values()) <= {"tp"}
    assert all(layouts[name].shard_dim is None for name in partial), partial
    assert all(name in partial for name, layout in layouts.items() if layout.partial_grad)
    if options.sequence_parallel:
        assert set(partial) == {name for name, layout in layouts.items()
                                if layout.shard_dim is None
                                and not name.startswith(("tok_embeddings", "output"))}
    if dp_mesh is not None:
        apply_data_parallel(model, dp_mesh, strategy="optim_grads_params",
                            param_dtype=torch.float32, reduce_dtype=torch.float32)
    model.to_empty(device="cpu")
    model.init_weights()

    # The same global batch everywhere; data-parallel ranks each take their rows.
    tokens = torch.randint(0, args.vocab_size, (2 * options.dp, 32),
                           generator=torch.Generator().manual_seed(1))
    dp_rank = dp_mesh.get_local_rank() if dp_mesh is not None else 0
    rows = slice(2 * dp_rank, 2 * dp_rank + 2)

    def loss_of(out, labels):
        # Main logits, aux loss and every MTP depth's logits all reach the loss.
        logits_list = [out] if not isinstance(out, tuple) else [out[0], *out[2:]]
        aux = out[1] if isinstance(out, tuple) else 0.0
        ce = sum(torch.nn.functional.cross_entropy(l.flatten(0, 1), labels.flatten(),
                                                   reduction="sum") for l in logits_list)
        return ce / tokens.numel() + aux

    # The reference takes each data-parallel rank's rows as one microbatch (the MoE balance
    # loss is per microbatch), accumulating gradients as data parallelism sums them.
    for r in range(options.dp):
        ref_out = reference(tokens[2 * r:2 * r + 2])
        loss_of(ref_out, tokens[2 * r:2 * r + 2]).backward()
        if r == dp_rank:
            ref_logits = (ref_out[0] if isinstance(ref_out, tuple) else ref_out).detach()
    # Tensor parallelism must not write the parameter registry: inside the forward, every
    # module's registered parameters are the very DTensor Parameters registered before it.
    registered = {name: param for name, param in model.named_parameters()}
    rewritten = set()

    def check_registry(module, *_):
        for name, param in module.named_parameters(prefix=names[module], recurse=False):
            if registered[name] is not param:
                rewritten.add(name)

    names = {module: name for name, module in model.named_modules()}
    hooks = [hook for module in model.modules()
             for hook in (module.register_forward_pre_hook(check_registry),
                          module.register_forward_hook(check_registry))]
    out = model(tokens[rows])
    loss_of(out, tokens[rows]).backward()
    for hook in hooks:
        hook.remove()

    logits = out[0] if isinstance(out, tuple) else out
    result = {"logits": (logits - ref_logits).abs().max().item(),
              "weights": {}, "grads": {}, "local_shapes": {},
              "rewritten_parameters": sorted(rewritten)}
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        result["weights"][name] = (logical(model, name, param.detach(), options.tp)
                                   - ref_params[name].detach()).abs().max().item()
        grad = logical(model, name, param.grad, options.tp)
        result["grads"][name] = ((grad - ref_params[name].grad).abs().max()
                                 / ref_params[name].grad.abs().max().clamp(min=1e-30)).item()
        local = param.to_local() if isinstance(param, DTensor) else param
        result["local_shapes"][name] = [list(local.shape), list(param.shape)]
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
