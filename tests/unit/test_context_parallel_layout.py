"""Context parallelism: layouts that cannot be split fail with a ValueError naming the field
before any process group exists; the head / group split and the zigzag are exact."""

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.run_configs import run_from_args
from titan_hybrid.data.zigzag import packed_zigzag_index, zigzag_index
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.parallel.context_parallel import heads_of_rank
from titan_hybrid.parallel.validate import validate_layout

CONFIG = Path(__file__).resolve().parents[2] / "train_configs" / "hybrid.toml"
DEBUG = hybrid_flavors["debug"]  # Mamba 16 heads / 2 groups, GDN 4 value / 2 key heads


def job(*args, model):
    return run_from_args(*args, model=model, config_file=CONFIG)


def cp(degree):
    return ("--parallelism.context_parallel_degree", str(degree))


@pytest.mark.parametrize("args, model_args, world, message", [
    ((*cp(2), "--training.seq_len", "250"), DEBUG, 2,
     r"training.seq_len=250 is not divisible by 4 = 2 \* context_parallel_degree\(2\): "
     "each CP rank holds 2 equal chunks"),
    ((*cp(2), "--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "260"), DEBUG,
     4, r"training.seq_len=260 is not divisible by 8 = 2 \* context_parallel_degree\(2\) \* "
        r"tensor_parallel_degree\(2\) \(sequence parallel\)"),
    ((*cp(8), "--training.seq_len", "256"), DEBUG, 8,
     r"gdn.n_value_heads=4 \(per tensor-parallel rank\) is not divisible by "
     "context_parallel_degree=8"),
    ((*cp(4), "--training.seq_len", "256"), dataclasses.replace(
        DEBUG, gdn=dataclasses.replace(DEBUG.gdn, n_value_heads=12, n_key_heads=3)), 4,
     r"gdn.n_key_heads=3 \(per tensor-parallel rank\) and context_parallel_degree=4: one must "
     "divide the other"),
    (cp(2), hybrid_flavors["debug_moe"], 2,
     "context_parallel_degree=2 with MTP depths in pattern 'M\\*EME/\\*-'"),
])
def test_impossible_context_layouts_are_named(args, model_args, world, message):
    with pytest.raises(ValueError, match=message):
        validate_layout(job(*args, model=model_args), world)


CHUNKWISE = ("--parallelism.context_parallel_linear_mode", "chunkwise")


@pytest.mark.parametrize("args, world, message", [
    (("--parallelism.context_parallel_linear_mode", "ring"), 1,
     "parallelism.context_parallel_linear_mode='ring': must be one of head_a2a, chunkwise"),
    # head_a2a's head rule names the mode that lifts it
    ((*cp(8), "--training.seq_len", "256"), 8,
     r"gdn.n_value_heads=4 .* whole heads \(parallelism.context_parallel_linear_mode "
     r"'chunkwise' has no head-count rule\)"),
    ((*cp(4), *CHUNKWISE, "--training.seq_len", "16"), 4,
     r"training.seq_len=16 with context_parallel_degree=4: chunkwise pieces of 2 tokens are "
     r"shorter than the Mamba2 conv's left context \(3 tokens\)"),
])
def test_linear_mode_rules_are_named(args, world, message):
    with pytest.raises(ValueError, match=message):
        validate_layout(job(*args, model=DEBUG), world)


def test_chunkwise_has_no_head_count_rule():
    validate_layout(job(*cp(8), *CHUNKWISE, "--training.seq_len", "256", model=DEBUG), 8)
    # The trainer tests' flavor: 6 GDN value heads, 3 per TP rank at TP 2.
    odd = hybrid_flavors["debug_odd_heads"]
    tp2 = ("--parallelism.tensor_parallel_degree", "2")
    for args, world, refused in ((cp(4), 4, "gdn.n_value_heads=6"),
                                 ((*cp(2), *tp2), 4, "gdn.n_value_heads=3")):
        validate_layout(job(*args, *CHUNKWISE, model=odd), world)
        with pytest.raises(ValueError, match=refused):
            validate_layout(job(*args, model=odd), world)


def test_supported_context_layouts_pass():
    validate_layout(job(*cp(2), model=DEBUG), 2)
    validate_layout(job(*cp(2), "--parallelism.tensor_parallel_degree", "2", model=DEBUG), 4)
    validate_layout(job(*cp(4), model=DEBUG), 4)  # 4 ranks > Mamba's 2 groups: ranks share one


def test_heads_of_rank_splits_heads_and_the_groups_they_read():
    assert heads_of_rank(8, 4, 2, 1) == (range(4, 8), range(2, 4))
    # Fewer groups than ranks: ranks 2 and 3 both read group 1 (heads 4..7 of 8).
    assert [heads_of_rank(8, 2, 4, r) for r in range(4)] == [
        (range(0, 2), range(0, 1)), (range(2, 4), range(0, 1)),
        (range(4, 6), range(1, 2)), (range(6, 8), range(1, 2))]


def test_zigzag_keeps_chunks_r_and_2cp_minus_1_minus_r():
    assert zigzag_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    # Each packed sequence on its own: lengths 4 and 8 at offsets 0 and 4.
    cu_seqlens = torch.tensor([0, 4, 12])
    assert packed_zigzag_index(cu_seqlens, 2, 0).tolist() == [0, 3, 4, 5, 10, 11]
    assert packed_zigzag_index(cu_seqlens, 2, 1).tolist() == [1, 2, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="packed sequence 1 has length 6"):
        packed_zigzag_index(torch.tensor([0, 4, 10]), 2, 0)
