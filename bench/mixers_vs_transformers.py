"""Our SSD scan, Mamba2 mixer and gated delta rule against transformers' pure-PyTorch paths.

    .venv/bin/python bench/mixers_vs_transformers.py [--seq-lens 512 2048 8192]
        [--gdn-seq-lens 512 2048] [--repeats 5] [--threads N] [--no-memory]

Compared, forward + backward on CPU in fp32 (issue 7, item 1):
  * SSD scan: `titan_hybrid.ops.ssd.mamba_chunk_scan_combined` vs the torch fallback of
    `mamba2_chunk_scan` in transformers' NemotronH (used when mamba_ssm is absent).
  * Mamba2 mixer: `titan_hybrid.model.mamba.Mamba2Mixer` vs `NemotronHMamba2Mixer` (training
    mode, no cache: its torch path). Both hold the same parameter names and the same
    [z | x | B | C | dt] in_proj layout, so the state dict copies across unchanged. NemotronH
    clamps dt below at config.time_step_min; it is set to 0 (a no-op after softplus) so the
    two compute the same function (ours applies no clamp).
  Shapes: hidden 512, 16 heads of head_dim 64 (expand 2), state 64, 4 groups, chunk 128, batch 2.
  * Gated delta rule: `titan_hybrid.ops.gated_delta.chunk_gated_delta_rule` vs transformers'
    Qwen3-Next `torch_chunk_gated_delta_rule` (its fla fallback), B=2, H=8, K=V=128, chunk 64,
    q/k L2-normalised in the kernel.
  * Kimi delta attention (issue 37, `K`): `titan_hybrid.ops.kda.chunk_kda` vs transformers'
    Kimi Linear `chunk_kimi_delta_attention` (its fla fallback), the gated delta rule's shapes
    with a log-decay per key channel.
  * LFM2's gated short convolution layer (issue 58, `S`): `titan_hybrid.model.short_conv.ShortConv`
    vs transformers' `Lfm2ShortConv` (training, no cache: its torch conv1d), same weights
    (its `conv.*` is our `conv1d.*`), hidden 512, conv width 3.
  * Mamba1 mixer (issue 59, `M` with `m_layers = "mamba1"`): `titan_hybrid.model.mamba1.
    Mamba1Mixer` (its chunked selective scan, ops/selective_scan.py) vs transformers'
    `MambaMixer` (training, no cache: its torch path, a sequential scan over the tokens), same
    weights (same parameter names), hidden 512, expand 2, state 16, dt rank 32, conv width 4;
    and (`mamba1_vs_mamba2`) the same Mamba1 mixer vs our Mamba2 mixer of the shapes above at
    about the same parameter count (1.69M against 1.85M): what the per-channel state costs.
  * Mamba-3 mixer (issue 60, `M` with `m_layers = "mamba3"`): `titan_hybrid.model.mamba3.
    Mamba3Mixer` (its chunked torch path, ops/mamba3_scan.py) at half our Mamba2 mixer's state
    (32) and about its parameters, vs that Mamba2 mixer: SISO with 4 B / C groups
    (`mamba3_siso_vs_mamba2`), MIMO of rank 4 with one group (`mamba3_mimo_vs_mamba2`).
  Baselines are named "transformers NemotronH torch path" / "transformers Qwen3-Next torch path".
  * MLA / DSA layers (issue 17): `titan_hybrid.model.mla.MultiLatentAttention` vs
    transformers' `DeepseekV3Attention` (SDPA), and `model.dsa.DeepSeekSparseAttention` (indexer
    untrained, as transformers' never trains) vs `DeepseekV32Attention` (eager: it needs the
    dense additive mask); same weights (same parameter names). Hidden 512, 8 heads, q_lora_rank
    256, kv_lora_rank 128, qk_nope 64, qk_rope 32, v 64; DSA: 8 indexer heads of 64, top-256.
    The DSA indexer's parameters get no gradient in either, so they are not compared.
  * DeepSeek-V4 sliding-window attention layer (issue 27, `W`):
    `titan_hybrid.model.deepseek_v4.SlidingWindowAttention` vs transformers'
    `DeepseekV4Attention` (layer type "sliding_attention"; eager, the only backend it has:
    dense [T, T] additive mask from create_sliding_window_causal_mask); same weights (same
    parameter names). Hidden 512, 8 heads of 128 (32 rotary), q_lora_rank 256, 4 output
    groups of rank 128, window 128.
  * DeepSeek-V4 compressed sparse attention layer (issue 27, `C`):
    `titan_hybrid.model.deepseek_v4_csa.CompressedSparseAttention` (indexer untrained, as
    transformers' never trains) vs `DeepseekV4Attention` (layer type
    "compressed_sparse_attention": overlapping blocks of 4, its indexer's top-k rows joined to
    the window's keys by its block bias); the same shapes, 8 indexer heads of 64, top-128. The
    indexer's parameters get no gradient in either, so they are not compared.
  * DeepSeek-V4 heavily compressed attention layer (issue 27, `H`):
    `titan_hybrid.model.deepseek_v4_hca.HeavilyCompressedAttention` vs `DeepseekV4Attention`
    (layer type "heavily_compressed_attention": its DeepseekV4HCACompressor's rows joined to
    the window's keys by its block bias); the same shapes, blocks of 128 tokens, the "compress"
    rotary table (theta 160000) for the whole layer.

Method: same inputs and weights for both; one warm-up step each (its outputs and input/weight
gradients, for a fixed random cotangent, give the agreement column: max|ours - theirs| /
max|theirs| over the output and over all gradients); then `--repeats` rounds, each timing one
fwd+bwd of both implementations back to back (order alternating), best time kept (at T >= 8192
at most 3 rounds). tokens/s = batch * T / best time; the ratio is ours / theirs (> 1: faster),
shown from the best times and as the median over rounds of theirs / ours within a round (the
paired figure, which the targets use: a burst of load from other tenants hits both of a pair).
Peak memory: each (op, impl, T) runs once in a fresh subprocess, which warms up at T = 128,
builds its inputs, resets the peak RSS (Linux VmHWM, the figure ru_maxrss reports) through
/proc/self/clear_refs, and records how far one fwd+bwd raises it above the RSS before the step:
activations, autograd buffers and gradients, not weights or inputs (torch has no CPU allocator
statistics). The probe runs with glibc's mmap threshold fixed at 64 KiB, so freed tensors leave
RSS at once rather than staying cached in the heap. Ratio ours / theirs (< 1: ours uses less).
Targets (issue 7, for the SSD scan, the Mamba2 mixer and the gated delta rule): at T = 2048,
ours >= 2x their tokens/s and lower peak memory. MLA / DSA / V4 (W, C, H) and the short conv have
no target: measured only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(REPO_ROOT))

import torch
import torch.nn.functional as F
import transformers
from transformers import DeepseekV3Config, NemotronHConfig
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)
from transformers.models.deepseek_v4 import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4Attention,
    DeepseekV4RotaryEmbedding,
)
from transformers.models.deepseek_v32 import DeepseekV32Config
from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Attention
from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention
from transformers.models.lfm2 import Lfm2Config
from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv
from transformers.models.mamba import MambaConfig
from transformers.models.mamba.modeling_mamba import MambaMixer
from transformers.models.nemotron_h.modeling_nemotron_h import (
    NemotronHMamba2Mixer,
    mamba2_chunk_scan,
)
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
from transformers.utils import logging as hf_logging

from bench.peak_rss import fmt_mib, in_fresh_process, rss_growth
from titan_hybrid.model.args import DSAArgs, MambaArgs, MLAArgs
from titan_hybrid.model.common import inverse_softplus
from titan_hybrid.model.deepseek_v4 import DeepseekV4AttentionArgs, SlidingWindowAttention
from titan_hybrid.model.deepseek_v4_csa import (
    CompressedSparseAttention,
    DeepseekV4SparseAttentionArgs,
)
from titan_hybrid.model.deepseek_v4_hca import (
    DeepseekV4CompressedAttentionArgs,
    HeavilyCompressedAttention,
)
from titan_hybrid.model.dsa import DeepSeekSparseAttention
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.mamba import Mamba2Mixer
from titan_hybrid.model.mamba1 import Mamba1Args, Mamba1Mixer
from titan_hybrid.model.mamba3 import Mamba3Args, Mamba3Mixer
from titan_hybrid.model.mla import MultiLatentAttention
from titan_hybrid.model.short_conv import ShortConv, ShortConvArgs
from titan_hybrid.ops.gated_delta import chunk_gated_delta_rule
from titan_hybrid.ops.kda import chunk_kda
from titan_hybrid.ops.ssd import mamba_chunk_scan_combined

hf_logging.set_verbosity_error()  # silence "falling back to its reference PyTorch implementation"

DIM, HEADS, HEAD_DIM, STATE, GROUPS, CHUNK, BATCH = 512, 16, 64, 64, 4, 128, 2
GDN_HEADS, GDN_DIM = 8, 128
OPS = {  # op -> (label, baseline)
    "ssd": ("SSD scan", "transformers NemotronH torch path (mamba2_chunk_scan)"),
    "mixer": ("Mamba2 mixer", "transformers NemotronH torch path (NemotronHMamba2Mixer)"),
    "gdn": ("gated delta rule",
            "transformers Qwen3-Next torch path (torch_chunk_gated_delta_rule)"),
    "kda": ("Kimi delta attention (KDA) rule",
            "transformers Kimi Linear torch path (chunk_kimi_delta_attention)"),
    "mla": ("MLA layer", "transformers DeepseekV3Attention (sdpa)"),
    "dsa": ("DSA layer", "transformers DeepseekV32Attention (eager, dense mask)"),
    "v4": ("DeepSeek-V4 sliding-window attention layer",
           "transformers DeepseekV4Attention (eager, dense mask)"),
    "v4_hca": ("DeepSeek-V4 heavily compressed attention layer",
               "transformers DeepseekV4Attention HCA (eager, dense mask)"),
    "v4_csa": ("DeepSeek-V4 compressed sparse attention layer",
               "transformers DeepseekV4Attention CSA (eager, dense mask)"),
    "short_conv": ("LFM2 gated short convolution layer",
                   "transformers Lfm2ShortConv torch path (conv1d)"),
    "mamba1": ("Mamba1 mixer", "transformers MambaMixer torch path (sequential scan)"),
    "mamba1_vs_mamba2": ("Mamba1 mixer", "our Mamba2 mixer (SSD chunked scan), ~equal params"),
    "mamba3_siso_vs_mamba2": ("Mamba-3 SISO mixer, half the state",
                              "our Mamba2 mixer (SSD chunked scan), ~equal params"),
    "mamba3_mimo_vs_mamba2": ("Mamba-3 MIMO (rank 4) mixer, half the state",
                              "our Mamba2 mixer (SSD chunked scan), ~equal params"),
}
# two different layers: no agreement column
UNRELATED = ("mamba1_vs_mamba2", "mamba3_siso_vs_mamba2", "mamba3_mimo_vs_mamba2")
# Mamba-3 at half our Mamba2's state (32) and about its parameters: SISO with Mamba2's 4 B / C
# groups, MIMO with one group and rank 4 (mamba_ssm's default rank, its chunk of 64 / R)
MAMBA3_CASES = {
    "mamba3_siso_vs_mamba2": Mamba3Args(d_state=STATE // 2, head_dim=HEAD_DIM, n_groups=GROUPS,
                                        chunk_size=64),
    "mamba3_mimo_vs_mamba2": Mamba3Args(d_state=STATE // 2, head_dim=HEAD_DIM, n_groups=1,
                                        mimo=True, mimo_rank=4, chunk_size=16),
}
TARGET_OPS = ("ssd", "mixer", "gdn")  # issue 7's targets
MLA_SHAPES = dict(n_heads=8, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64,
                  qk_rope_head_dim=32, v_head_dim=64)


def _deepseek_case(op: str, T: int, batch: int, x: torch.Tensor, seed: int) -> dict:
    """Our MLA / DSA layer and transformers' on the same weights, as make_case returns them."""
    torch.manual_seed(seed)
    if op == "mla":
        ours = MultiLatentAttention(dim=DIM, args=MLAArgs(**MLA_SHAPES))
        config = DeepseekV3Config(attn_implementation="sdpa", **_hf_fields(MLAArgs(**MLA_SHAPES)))
        theirs, mask = DeepseekV3Attention(config, layer_idx=0), None  # sdpa: causal
    else:
        args = DSAArgs(**MLA_SHAPES, index_n_heads=8, index_head_dim=64, index_topk=256)
        ours = DeepSeekSparseAttention(dim=DIM, args=args)
        config = DeepseekV32Config(attn_implementation="eager", index_n_heads=8,
                                   index_head_dim=64, index_topk=256, **_hf_fields(args))
        theirs = DeepseekV32Attention(config, layer_idx=0)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None].expand(batch, 1, T, T)
    with torch.no_grad():
        ours.init_weights(init_std=0.02, out_std=0.02)
    theirs.load_state_dict(ours.state_dict())
    rotary = DeepseekV3RotaryEmbedding(config)(x, torch.arange(T)[None].expand(batch, T))
    layout = TokenLayout(positions=None, seq_idx=None)

    def ours_fn():
        out = ours(x, layout)
        return out[0] if isinstance(out, tuple) else out

    def leaves(module):  # the indexer gets no gradient in either (untrained)
        return [x] + [p for name, p in sorted(module.named_parameters()) if "indexer" not in name]
    return {"ours": (ours_fn, leaves(ours)),
            "theirs": (lambda: theirs(x, rotary, mask)[0], leaves(theirs))}


V4_SHAPES = dict(n_heads=8, head_dim=128, rope_head_dim=32, q_lora_rank=256, o_groups=4,
                 o_lora_rank=128, sliding_window=128)


def _deepseek_v4_case(op: str, T: int, batch: int, x: torch.Tensor, seed: int) -> dict:
    """Our V4 sliding-window (op "v4"), compressed sparse ("v4_csa") or heavily compressed
    ("v4_hca") layer and transformers', with the mask and rotary tables its model builds, as
    make_case returns them."""
    torch.manual_seed(seed)
    if op == "v4":
        args = DeepseekV4AttentionArgs(**V4_SHAPES)
        ours = SlidingWindowAttention(dim=DIM, args=args)
        layer_type, rope_type = "sliding_attention", "main"
    elif op == "v4_csa":
        args = DeepseekV4SparseAttentionArgs(**V4_SHAPES, compress_ratio=4, index_n_heads=8,
                                             index_head_dim=64, index_topk=128)
        ours = CompressedSparseAttention(dim=DIM, args=args)
        layer_type, rope_type = "compressed_sparse_attention", "compress"
    else:
        args = DeepseekV4CompressedAttentionArgs(**V4_SHAPES, compress_ratio=128)
        ours = HeavilyCompressedAttention(dim=DIM, args=args)
        layer_type, rope_type = "heavily_compressed_attention", "compress"
    with torch.no_grad():
        ours.init_weights(init_std=0.02, out_std=0.02)
        ours.sinks.normal_()  # zeros at init: give the sink a part to play
        if op != "v4":  # zeros at init: let the positions in a block weigh differently
            ours.compressor.position_bias.normal_()
    config = DeepseekV4Config(
        hidden_size=DIM, num_attention_heads=args.n_heads, head_dim=args.head_dim,
        q_lora_rank=args.q_lora_rank, o_groups=args.o_groups, o_lora_rank=args.o_lora_rank,
        sliding_window=args.sliding_window, partial_rotary_factor=args.rope_head_dim / args.head_dim,
        rope_theta=args.rope_theta, compress_rope_theta=args.rope_theta,
        compress_rates={"compressed_sparse_attention": 4,
                        "heavily_compressed_attention": getattr(args, "compress_ratio", 128)},
        index_n_heads=getattr(args, "index_n_heads", 64),
        index_head_dim=getattr(args, "index_head_dim", 128),
        index_topk=getattr(args, "index_topk", 512),
        rms_norm_eps=args.norm_eps, num_hidden_layers=1, layer_types=[layer_type],
        mlp_layer_types=["moe"], attn_implementation="eager")
    theirs = DeepseekV4Attention(config, layer_idx=0)
    theirs.load_state_dict(ours.state_dict())
    position_ids = torch.arange(T)[None].expand(batch, T)
    mask = create_sliding_window_causal_mask(config=config, inputs_embeds=x, attention_mask=None,
                                             cache=None, position_ids=position_ids)
    rotary = {rope_type: DeepseekV4RotaryEmbedding(config)(x, position_ids, layer_type=rope_type)}
    layout = TokenLayout(positions=None, seq_idx=None)

    def ours_fn():
        out = ours(x, layout)
        return out[0] if isinstance(out, tuple) else out

    def leaves(module):  # C's indexer gets no gradient in either (untrained)
        return [x] + [p for name, p in sorted(module.named_parameters()) if "indexer" not in name]
    return {"ours": (ours_fn, leaves(ours)),
            "theirs": (lambda: theirs(x, rotary, position_ids, mask)[0], leaves(theirs))}


def _hf_fields(args: MLAArgs) -> dict:
    return dict(hidden_size=DIM, num_attention_heads=args.n_heads,
                num_key_value_heads=args.n_heads, q_lora_rank=args.q_lora_rank,
                kv_lora_rank=args.kv_lora_rank, qk_nope_head_dim=args.qk_nope_head_dim,
                qk_rope_head_dim=args.qk_rope_head_dim, v_head_dim=args.v_head_dim,
                rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta})


def our_mamba2_mixer(seed: int) -> Mamba2Mixer:
    torch.manual_seed(seed)
    mixer = Mamba2Mixer(dim=DIM, args=MambaArgs(d_state=STATE, head_dim=HEAD_DIM,
                                                n_groups=GROUPS, expand=2, conv_width=4,
                                                chunk_size=CHUNK), norm_eps=1e-5)
    with torch.no_grad():
        mixer.init_weights(init_std=0.02, out_std=0.02)
    return mixer


def make_case(op: str, T: int, batch: int = BATCH, seed: int = 0):
    """{"ours": (forward_fn, leaves), "theirs": (forward_fn, leaves)} on the same inputs and
    weights; `leaves` (inputs, then parameters) line up one to one between the two."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, shift=0.0):
        return torch.randn(*shape, generator=gen) * scale + shift

    if op == "ssd":
        x, dt = rnd(batch, T, HEADS, HEAD_DIM), rnd(batch, T, HEADS, scale=0.5)
        B, C = rnd(batch, T, GROUPS, STATE, scale=0.5), rnd(batch, T, GROUPS, STATE, scale=0.5)
        A_log = torch.empty(HEADS).uniform_(1, 16, generator=gen).log()  # Mamba2's init
        dt0 = torch.empty(HEADS).uniform_(math.log(1e-3), math.log(0.1), generator=gen).exp()
        leaves = [t.requires_grad_() for t in (x, dt, B, C, A_log, inverse_softplus(dt0),
                                                torch.ones(HEADS))]

        def scan_fn(scan):
            x, dt, B, C, A_log, dt_bias, D = leaves
            return lambda: scan(x, dt, -torch.exp(A_log), B, C, CHUNK, D=D, dt_bias=dt_bias,
                                dt_softplus=True)
        return {"ours": (scan_fn(mamba_chunk_scan_combined), leaves),
                "theirs": (scan_fn(mamba2_chunk_scan), leaves)}
    if op in ("mamba1", "mamba1_vs_mamba2"):
        torch.manual_seed(seed)
        ours = Mamba1Mixer(dim=DIM, args=Mamba1Args(d_state=16, expand=2, conv_width=4))
        with torch.no_grad():
            ours.init_weights(init_std=0.02, out_std=0.02)
        if op == "mamba1":
            theirs = MambaMixer(MambaConfig(hidden_size=DIM, state_size=16, expand=2,
                                            conv_kernel=4, time_step_rank=32), layer_idx=0)
            theirs.load_state_dict(ours.state_dict())  # transformers' names, one to one
        else:
            theirs = our_mamba2_mixer(seed)
        x = rnd(batch, T, DIM).requires_grad_()
        return {name: (lambda m=m: m(x), [x] + [p for _, p in sorted(m.named_parameters())])
                for name, m in (("ours", ours.train()), ("theirs", theirs.train()))}
    if op in MAMBA3_CASES:
        torch.manual_seed(seed)
        ours = Mamba3Mixer(dim=DIM, args=MAMBA3_CASES[op])
        with torch.no_grad():
            ours.init_weights(init_std=0.02, out_std=0.02)
        theirs = our_mamba2_mixer(seed)
        x = rnd(batch, T, DIM).requires_grad_()
        return {name: (lambda m=m: m(x), [x] + [p for _, p in sorted(m.named_parameters())])
                for name, m in (("ours", ours.train()), ("theirs", theirs.train()))}
    if op == "mixer":
        ours = our_mamba2_mixer(seed)
        config = NemotronHConfig(
            hidden_size=DIM, mamba_num_heads=HEADS, mamba_head_dim=HEAD_DIM, ssm_state_size=STATE,
            n_groups=GROUPS, expand=2, conv_kernel=4, chunk_size=CHUNK, use_conv_bias=True,
            use_bias=False, layer_norm_epsilon=1e-5, time_step_min=0.0,
            layers_block_type=["mamba"], num_hidden_layers=1)
        theirs = NemotronHMamba2Mixer(config, layer_idx=0)
        theirs.load_state_dict(ours.state_dict())  # same names, shapes and [z|x|B|C|dt] layout
        x = rnd(batch, T, DIM).requires_grad_()
        return {name: (lambda m=m: m(x), [x] + [p for _, p in sorted(m.named_parameters())])
                for name, m in (("ours", ours.train()), ("theirs", theirs.train()))}
    if op == "gdn":
        shape = (batch, T, GDN_HEADS, GDN_DIM)
        q, k, v = rnd(*shape), rnd(*shape), rnd(*shape)
        g = F.logsigmoid(rnd(batch, T, GDN_HEADS, shift=3.0))  # log-decay <= 0, mean ~ -0.07
        beta = torch.sigmoid(rnd(batch, T, GDN_HEADS))
        leaves = [t.requires_grad_() for t in (q, k, v, g, beta)]

        def gdn_fn(rule):
            return lambda: rule(*leaves, use_qk_l2norm_in_kernel=True)[0]
        return {"ours": (gdn_fn(chunk_gated_delta_rule), leaves),
                "theirs": (gdn_fn(torch_chunk_gated_delta_rule), leaves)}
    if op == "kda":  # the gated delta rule's shapes, with a log-decay per key channel
        shape = (batch, T, GDN_HEADS, GDN_DIM)
        q, k, v = rnd(*shape), rnd(*shape), rnd(*shape)
        g = F.logsigmoid(rnd(*shape, shift=3.0))
        beta = torch.sigmoid(rnd(batch, T, GDN_HEADS))
        leaves = [t.requires_grad_() for t in (q, k, v, g, beta)]

        def kda_fn(rule):
            return lambda: rule(*leaves, use_qk_l2norm_in_kernel=True)[0]
        return {"ours": (kda_fn(chunk_kda), leaves),
                "theirs": (kda_fn(chunk_kimi_delta_attention), leaves)}
    if op == "short_conv":
        torch.manual_seed(seed)
        ours = ShortConv(dim=DIM, args=ShortConvArgs(conv_width=3))
        with torch.no_grad():
            ours.init_weights(init_std=0.02, out_std=0.02)
        theirs = Lfm2ShortConv(Lfm2Config(hidden_size=DIM, conv_L_cache=3, num_hidden_layers=1),
                               layer_idx=0)
        theirs.load_state_dict({name.replace("conv1d.", "conv."): value
                                for name, value in ours.state_dict().items()})
        x = rnd(batch, T, DIM).requires_grad_()
        return {"ours": (lambda: ours(x), [x, ours.in_proj.weight, ours.conv1d.weight,
                                           ours.out_proj.weight]),
                "theirs": (lambda: theirs(x), [x, theirs.in_proj.weight, theirs.conv.weight,
                                               theirs.out_proj.weight])}
    if op in ("mla", "dsa"):
        return _deepseek_case(op, T, batch, rnd(batch, T, DIM).requires_grad_(), seed)
    if op in ("v4", "v4_csa", "v4_hca"):
        return _deepseek_v4_case(op, T, batch, rnd(batch, T, DIM).requires_grad_(), seed)
    raise ValueError(op)


def fwd_bwd(fn, leaves, cotangent=None):
    out = fn()
    if cotangent is None:
        cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    return out.detach(), torch.autograd.grad(out, leaves, cotangent), cotangent


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def compare(op: str, T: int, repeats: int, batch: int = BATCH) -> dict:
    """Warm-up + agreement check, then interleaved best-of-`repeats` fwd+bwd timings."""
    case = make_case(op, T, batch)
    ours_out, ours_grads, cot = fwd_bwd(*case["ours"])
    theirs_out, theirs_grads, _ = fwd_bwd(*case["theirs"], cot)
    result = ({"err_out": math.nan, "err_grad": math.nan} if op in UNRELATED else
              {"err_out": rel_err(ours_out, theirs_out),
               "err_grad": max(rel_err(a, b) for a, b in zip(ours_grads, theirs_grads))})
    del ours_out, ours_grads, theirs_out, theirs_grads
    times = {"ours": [], "theirs": []}
    for r in range(repeats):
        for impl in (("ours", "theirs") if r % 2 == 0 else ("theirs", "ours")):
            start = time.perf_counter()
            fwd_bwd(*case[impl], cot)
            times[impl].append(time.perf_counter() - start)
    for impl, ts in times.items():
        result[f"{impl}_tok_s"] = batch * T / min(ts)
        result[f"{impl}_spread"] = statistics.median(ts) / min(ts)  # > ~1.2: a noisy machine
    # Both ran back to back in each round, so a burst of load from other tenants hits the pair;
    # the median of the per-round ratios is the figure least moved by such bursts.
    result["paired_speedup"] = statistics.median(
        theirs / ours for ours, theirs in zip(times["ours"], times["theirs"]))
    return result


def peak_memory_probe(op: str, impl: str, T: int) -> dict:
    """Run in a fresh process: peak-RSS growth (bytes) of one fwd+bwd step."""
    fwd_bwd(*make_case(op, CHUNK)[impl])  # one-time allocations (thread pools, kernels)
    fn, leaves = make_case(op, T)[impl]
    return rss_growth(lambda: fwd_bwd(fn, leaves))


def peak_memory(op: str, impl: str, T: int) -> dict:
    return in_fresh_process(__file__, ["--probe", op, impl, str(T),
                                       "--threads", str(torch.get_num_threads())])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048, 8192],
                        help="sequence lengths for the SSD scan and the Mamba2 mixer")
    parser.add_argument("--gdn-seq-lens", type=int, nargs="+", default=[512, 2048],
                        help="sequence lengths for the gated delta rule and KDA")
    parser.add_argument("--mla-seq-lens", type=int, nargs="+", default=[512, 2048],
                        help="sequence lengths for the MLA, DSA and V4 layers")
    parser.add_argument("--conv-seq-lens", type=int, nargs="+", default=[512, 2048],
                        help="sequence lengths for the short convolution and Mamba1 layers")
    parser.add_argument("--ops", nargs="+", choices=list(OPS), default=list(OPS),
                        help="which comparisons to run (default: all)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory probes")
    parser.add_argument("--probe", nargs=3, metavar=("OP", "IMPL", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.probe:
        op, impl, T = args.probe
        print(json.dumps(peak_memory_probe(op, impl, int(T))))
        return

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs; fp32, forward + backward")
    rows = []
    for op, seq_lens in (("ssd", args.seq_lens), ("mixer", args.seq_lens),
                         ("gdn", args.gdn_seq_lens), ("kda", args.gdn_seq_lens),
                         ("mla", args.mla_seq_lens),
                         ("dsa", args.mla_seq_lens), ("v4", args.mla_seq_lens),
                         ("v4_csa", args.mla_seq_lens), ("v4_hca", args.mla_seq_lens),
                         ("short_conv", args.conv_seq_lens), ("mamba1", args.conv_seq_lens),
                         ("mamba1_vs_mamba2", args.conv_seq_lens),
                         ("mamba3_siso_vs_mamba2", args.conv_seq_lens),
                         ("mamba3_mimo_vs_mamba2", args.conv_seq_lens)):
        if op not in args.ops:
            continue
        for T in seq_lens:
            res = compare(op, T, min(args.repeats, 3) if T >= 8192 else args.repeats)
            if not args.no_memory:
                res["ours_mem"] = peak_memory(op, "ours", T)
                res["theirs_mem"] = peak_memory(op, "theirs", T)
            rows.append((op, T, res))
            print(f"  done {OPS[op][0]} T={T}; median/best time: ours {res['ours_spread']:.2f}, "
                  f"baseline {res['theirs_spread']:.2f}", file=sys.stderr, flush=True)

    head = ("| T | ours tok/s | baseline tok/s | speed ours/base (best; paired median) | "
            "ours peak MiB | baseline peak MiB | memory ours/base | max rel err out / grads |")
    for op, (label, baseline) in OPS.items():
        if op not in args.ops:
            continue
        print(f"\n{label} vs {baseline}, batch {BATCH}\n\n{head}\n" + "| --- " * 8 + "|")
        for row_op, T, r in rows:
            if row_op != op:
                continue
            mem = r.get("ours_mem"), r.get("theirs_mem")
            mem_ratio = f"{mem[0]['bytes'] / mem[1]['bytes']:.2f}" if mem[0] else "-"
            print(f"| {T} | {r['ours_tok_s']:,.0f} | {r['theirs_tok_s']:,.0f} | "
                  f"{r['ours_tok_s'] / r['theirs_tok_s']:.2f}x; {r['paired_speedup']:.2f}x | "
                  f"{fmt_mib(mem[0])} | "
                  f"{fmt_mib(mem[1])} | {mem_ratio} | {r['err_out']:.1e} / {r['err_grad']:.1e} |")
    print("\nPeak MiB: growth of peak RSS during one fwd+bwd in a fresh process "
          "('+': lower bound).\nTargets at T=2048: speed >= 2.00x and memory ratio < 1.")
    for op, T, r in rows:
        if T == 2048 and op in TARGET_OPS:
            speed = r["paired_speedup"]
            mem = (r["ours_mem"]["bytes"] / r["theirs_mem"]["bytes"]) if "ours_mem" in r else None
            print(f"  {OPS[op][0]}: speed (paired median) {speed:.2f}x "
                  f"({'met' if speed >= 2 else 'NOT met'}), "
                  + ("memory not measured" if mem is None else
                     f"memory {mem:.2f} ({'met' if mem < 1 else 'NOT met'})"))


if __name__ == "__main__":
    main()
