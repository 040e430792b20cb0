"""A loaded batch made ready for the model: what training and validation both do to it."""

from __future__ import annotations

import torch

from titan_hybrid.model.layout import documents_from_bos
from titan_hybrid.parallel.context_parallel import shard_batch


def prepare_batch(input_dict: dict[str, torch.Tensor], labels: torch.Tensor, *,
                  document_masking: bool, bos_id: int, cp_group=None, token_ids: bool = False):
    """(inputs, labels, extra_inputs, extra_kwargs) as torchtitan's trainer passes them on:
    the packed-document layout (`hybrid.document_masking`: `positions` / `seq_idx` in
    extra_kwargs, which reach every pipeline stage), the tokens again as `token_ids` (with
    `token_ids`: hash-routed MoE layers on any pipeline stage choose by them), then this CP
    rank's zigzag shard."""
    # Contiguous: a window sliced from [B, T + 1] tokens has row stride T + 1, and pipeline stages
    # (torch 2.11 / 2.12) refuse inputs whose strides differ from the first step's, so batches
    # from loaders that slice and loaders that do not (validation vs training) must agree.
    inputs, labels = input_dict["input"].contiguous(), labels.contiguous()
    extra_inputs = {k: v for k, v in input_dict.items() if k != "input"}
    extra_kwargs = {}
    if document_masking:
        seq_idx, positions = documents_from_bos(inputs, bos_id)
        extra_kwargs.update(seq_idx=seq_idx, positions=positions)
    if token_ids:
        extra_kwargs["token_ids"] = inputs
    if cp_group is not None:
        inputs, labels, extra_kwargs = shard_batch(inputs, labels, extra_kwargs, cp_group)
    return inputs, labels, extra_inputs, extra_kwargs
