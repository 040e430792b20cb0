"""Multimodal (MIMO) support: partitioning of the language model's inputs."""

from titan_hybrid.mimo.partition import PackedSeqParams, PartitionAdapter, shard_language_inputs

__all__ = ["PackedSeqParams", "PartitionAdapter", "shard_language_inputs"]
