"""Worker for test_vision_language.py, run under torchrun: the vision-language example on one
device and partitioned by PartitionAdapter over a (cp, tp) mesh (context parallel and/or
tensor + sequence parallel), plain or packed (THD) rows. Compares the loss and the gradients
of the front end (token embedding, vision projection) and, without TP, of every LM parameter.

Prints one line `RESULT {json}` on rank 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import titan_hybrid.torchtitan_plugin  # noqa: F401  (TrainSpec, dataset; CPU runtime)
from titan_hybrid.mimo import PackedSeqParams, PartitionAdapter
from titan_hybrid.mimo.vision_language import VisionLanguageModel
from titan_hybrid.model.args import AttentionArgs, GDNArgs, MambaArgs, MLPArgs, hybrid_flavors
from titan_hybrid.model.common import tensor_parallel_layouts
from titan_hybrid.parallel.context_parallel import apply_context_parallel
from titan_hybrid.parallel.init import full_tensor_materializer
from titan_hybrid.parallel.tensor_parallel import apply_tensor_parallel

IMAGE_TOKEN, VISION_DIM, SEQ = 3, 10, 32


def build(args, tp_mesh):
    if tp_mesh is None:
        model = VisionLanguageModel(args, vision_dim=VISION_DIM, image_token_id=IMAGE_TOKEN)
        model.init_weights()
        return model
    with torch.device("meta"):
        model = VisionLanguageModel(args, vision_dim=VISION_DIM, image_token_id=IMAGE_TOKEN,
                                    init_materializer=full_tensor_materializer)
    apply_tensor_parallel(model.language_model, tp_mesh,
                          tensor_parallel_layouts(model.language_model), sequence_parallel=True,
                          loss_parallel=False)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--packed", type=int, default=0)
    options = parser.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (options.cp, options.tp), mesh_dim_names=("cp", "tp"))
    args = dataclasses.replace(
        hybrid_flavors["debug"], dim=32, vocab_size=64, max_seq_len=64, pattern="M*G-",
        attention=AttentionArgs(n_heads=4, n_kv_heads=2, head_dim=8),
        mlp=MLPArgs(hidden_dim=24),
        mamba=MambaArgs(d_state=4, head_dim=8, n_groups=2, chunk_size=8),
        gdn=GDNArgs(key_head_dim=8, value_head_dim=6, n_key_heads=2, n_value_heads=4))
    reference = build(args, None)
    model = build(args, mesh["tp"] if options.tp > 1 else None)
    if options.cp > 1:
        apply_context_parallel(model.language_model, mesh.get_group("cp"))

    # Two rows: text, an image of 5 placeholder tokens, text. Loss on text tokens only.
    generator = torch.Generator().manual_seed(7)
    batch = 1 if options.packed else 2
    tokens = torch.randint(4, 64, (batch, SEQ), generator=generator)
    tokens[:, 6:11] = IMAGE_TOKEN
    vision = torch.randn(batch * 5, VISION_DIM, generator=generator)
    labels = torch.randint(0, 64, (batch, SEQ), generator=generator)
    loss_mask = (tokens != IMAGE_TOKEN).float()
    packed = None
    if options.packed:  # one row of three documents: 8, 16 and 8 tokens
        packed = PackedSeqParams(cu_seqlens_q=torch.tensor([0, 8, 24, 32], dtype=torch.int32),
                                 cu_seqlens_kv=torch.tensor([0, 8, 24, 32], dtype=torch.int32))

    want = reference(tokens, vision, labels, loss_mask, PartitionAdapter(), packed)
    want.backward()
    adapter = PartitionAdapter(cp_group=mesh.get_group("cp") if options.cp > 1 else None,
                               tp_group=mesh.get_group("tp") if options.tp > 1 else None,
                               sequence_parallel=options.tp > 1)
    got = model(tokens, vision, labels, loss_mask, adapter, packed)
    got.backward()

    total = got.detach().clone()
    if options.cp > 1:
        dist.all_reduce(total, group=mesh.get_group("cp"))
    # The front end ran full length everywhere; each rank's gradient covers its own tokens.
    checked = {"tok_embeddings.weight": None, "vision_projection.weight": None}
    if options.tp == 1:
        checked.update({name: None for name, _ in model.language_model.named_parameters(
            prefix="language_model")})
    params = dict(model.named_parameters())
    reference_params = dict(reference.named_parameters())
    grad_errors = {}
    for name in checked:
        grad = params[name].grad.clone()
        dist.all_reduce(grad)
        want_grad = reference_params[name].grad
        grad_errors[name] = ((grad - want_grad).abs().max() / want_grad.abs().max()).item()
    report = {"loss": total.item(), "want": want.item(),
              "grads": max(grad_errors.values()), "checked": len(grad_errors),
              "worst": max(grad_errors, key=grad_errors.get)}
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(reports), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
