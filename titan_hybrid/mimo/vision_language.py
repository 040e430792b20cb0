"""A small vision-language model on the hybrid LM: how a multimodal front end hands its
full-length input to a context / sequence parallel language model.

Vision features (from any encoder; the tests use random "stub" features) are projected to the
LM width and written over the embeddings of the image placeholder tokens. The combined
sequence-first embeddings go through `PartitionAdapter.shard`, and the hybrid LM (without its
own embedding, like a later pipeline stage) runs on this rank's part. The front end runs full
length on every rank, so its gradients are partial per rank: sum them over the CP and TP
groups (with sequence parallelism), as data parallelism over the CP ranks does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_hybrid.mimo.partition import PackedSeqParams, PartitionAdapter
from titan_hybrid.model.args import HybridModelArgs
from titan_hybrid.model.layout import packed_layout
from titan_hybrid.model.model import HybridModel


class VisionLanguageModel(nn.Module):
    def __init__(self, lm_args: HybridModelArgs, *, vision_dim: int, image_token_id: int,
                 **language_model_options) -> None:
        """`language_model_options`: HybridModel's keywords (its init materializer)."""
        super().__init__()
        if lm_args.has_aux_loss:
            kinds = ", ".join(kind.title for kind in lm_args.kinds() if kind.has_aux_loss)
            raise ValueError(f"VisionLanguageModel: pattern '{lm_args.pattern}' has layers with "
                             f"an auxiliary loss ({kinds}); this example feeds the LM hidden "
                             "states only (no aux loss input) and reads logits alone")
        if lm_args.hc_mult:
            raise ValueError(f"VisionLanguageModel: hc_mult={lm_args.hc_mult}: this example's "
                             "front end feeds the LM one stream of hidden states, which "
                             "hyper-connections would read as several")
        if lm_args.enable_weight_tying:
            raise ValueError("VisionLanguageModel: enable_weight_tying=True: this example's "
                             "front end owns the embedding, so the LM head cannot share it")
        self.image_token_id = image_token_id
        self.tok_embeddings = nn.Embedding(lm_args.vocab_size, lm_args.dim)
        self.vision_projection = nn.Linear(vision_dim, lm_args.dim, bias=False)
        self.language_model = HybridModel(lm_args, **language_model_options)
        self.language_model.tok_embeddings = None  # the front end embeds, full length

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        self.language_model.init_weights()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            nn.init.normal_(self.tok_embeddings.weight)
            nn.init.normal_(self.vision_projection.weight,
                            std=self.vision_projection.in_features ** -0.5)

    def embed(self, tokens_BT: torch.Tensor, vision_features: torch.Tensor) -> torch.Tensor:
        """[S, B, H]: token embeddings with the projected vision features, in order, at the
        image placeholder tokens."""
        h = self.tok_embeddings(tokens_BT)
        image = (tokens_BT == self.image_token_id).unsqueeze(-1)
        if int(image.sum()) != vision_features.shape[0]:
            raise ValueError(f"{int(image.sum())} image tokens but {vision_features.shape[0]} "
                             "vision feature rows: one row per image token")
        h = h.masked_scatter(image, self.vision_projection(vision_features).to(h.dtype))
        return h.transpose(0, 1)

    def forward(self, tokens_BT: torch.Tensor, vision_features: torch.Tensor,
                labels_BT: torch.Tensor, loss_mask_BT: torch.Tensor,
                adapter: PartitionAdapter,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        """This rank's summed cross-entropy over its masked tokens (sum it over the CP group
        and divide by loss_mask.sum() for the mean)."""
        batch, seq_len = tokens_BT.shape
        if packed_seq_params is None:
            seq_idx = None
            positions = torch.arange(seq_len, device=tokens_BT.device).expand(batch, -1)
        else:
            bounds = packed_seq_params.cu_seqlens_q_padded
            seq_idx, positions = packed_layout(
                packed_seq_params.cu_seqlens_q if bounds is None else bounds)
        embeddings, labels, loss_mask, _ = adapter.shard(
            self.embed(tokens_BT, vision_features), labels_BT, loss_mask_BT,
            packed_seq_params)

        # The LM's layers see whole CP-local sequences (SP gathers inside the TP regions), so
        # positions and documents are CP-sharded like the labels, never SP-scattered.
        def cp_local(per_token_BT):
            return adapter.shard(None, per_token_BT, per_token_BT, packed_seq_params)[1]

        logits = self.language_model(
            embeddings.transpose(0, 1), positions=cp_local(positions),
            seq_idx=None if seq_idx is None else cp_local(seq_idx))
        losses = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                 reduction="none")
        return (losses * loss_mask.flatten().to(losses.dtype)).sum()
