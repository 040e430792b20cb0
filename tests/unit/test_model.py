"""HybridModel as a whole, single process: every layer type trains, groups compute bit-for-bit
what the flat pattern computes, meta-device init, argument validation, MTP outputs, causality,
and the FLOPs count.

Bitwise checks use torch.equal (same arithmetic in the same order: no tolerance). Causality
checks run in float64 at atol 1e-12.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from titan_hybrid.model.args import (
    AttentionArgs,
    GDNArgs,
    MambaArgs,
    MLPArgs,
    MoEArgs,
    hybrid_flavors,
)
from titan_hybrid.model.flops import nparams_and_flops_per_token
from titan_hybrid.model.gdn import GatedDeltaNet
from titan_hybrid.model.layout import documents_from_bos, packed_layout
from titan_hybrid.model.mamba import Mamba2Mixer
from titan_hybrid.model.model import HybridModel
from titan_hybrid.model.norms import GatedGroupRMSNorm, HeadGatedRMSNorm, RMSNorm
from titan_hybrid.model.rotary import rotary_tables
from titan_hybrid.training.loss import hybrid_loss, shift_labels

DIM, VOCAB, BATCH, SEQ = 32, 64, 2, 12


def tiny_args(flavor: str = "debug", **changes):
    base = dataclasses.replace(
        hybrid_flavors[flavor], dim=DIM, vocab_size=VOCAB, max_seq_len=64,
        attention=AttentionArgs(n_heads=4, n_kv_heads=2, head_dim=8),
        mlp=MLPArgs(hidden_dim=24),
        mamba=MambaArgs(d_state=4, head_dim=8, n_groups=2, chunk_size=8),
        gdn=GDNArgs(key_head_dim=8, value_head_dim=6, n_key_heads=2, n_value_heads=4),
        moe=MoEArgs(num_experts=4, top_k=2, hidden_dim=12, shared_expert_hidden_dim=10),
    )
    return dataclasses.replace(base, **changes)


def seeded(args, seed):
    """Args whose init draws from `seed` (the model seeds each unit from args.init_seed; the
    global generator is seeded as well in case init draws from it)."""
    torch.manual_seed(seed)
    if hasattr(args, "init_seed"):
        args = dataclasses.replace(args, init_seed=seed)
    return args


def build(args, seed=0, dtype=torch.float32):
    args = seeded(args, seed)
    model = HybridModel(args)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights()
    return model.to(dtype)


def batch(seed=0, seq_len=SEQ):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, seq_len), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, seq_len), generator=gen)
    return tokens, labels


# ------------------------------------------------------------------- every layer type trains


@pytest.mark.parametrize("pattern", ["M", "G", "*", "-", "E", "[M*E]G-"])
def test_layer_forward_backward(pattern):
    args = tiny_args(pattern=pattern)
    model = build(args)
    tokens, labels = batch()
    out = model(tokens)
    logits = out[0] if isinstance(out, tuple) else out
    assert isinstance(out, tuple) == ("E" in pattern)  # (logits, aux) only with MoE
    assert logits.shape == (BATCH, SEQ, VOCAB)
    assert torch.isfinite(logits).all()
    loss = hybrid_loss(out, labels)
    assert torch.isfinite(loss)
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, f"{name} got an all-zero gradient"


# ---------------------------------------------------------------------- groups == flat, bitwise


@pytest.mark.parametrize("grouped, flat", [
    ("[*-][M-][G-]", "*-M-G-"),
    ("[M*E]", "M*E"),
    ("M[*E]-/*-", "M*E-/*-"),
])
def test_group_computes_bitwise_what_flat_computes(grouped, flat):
    model_g = build(tiny_args(pattern=grouped), seed=1)
    model_f = build(tiny_args(pattern=flat), seed=2)
    params_g, params_f = list(model_g.named_parameters()), list(model_f.named_parameters())
    assert len(params_g) == len(params_f)
    differed = 0
    with torch.no_grad():
        for (name_g, p_g), (name_f, p_f) in zip(params_g, params_f):
            # same leaf name and shape: the order really corresponds one-to-one
            assert name_g.rsplit(".", 2)[-2:] == name_f.rsplit(".", 2)[-2:], (name_g, name_f)
            assert p_g.shape == p_f.shape, (name_g, name_f)
            differed += not torch.equal(p_g, p_f)
            p_f.copy_(p_g)
    assert differed > len(params_g) // 2  # different seeds: the copy is what makes them equal

    tokens, labels = batch(seed=4)
    out_g, out_f = model_g(tokens), model_f(tokens)
    assert type(out_g) is type(out_f)
    outs_g = out_g if isinstance(out_g, tuple) else (out_g,)
    outs_f = out_f if isinstance(out_f, tuple) else (out_f,)
    assert len(outs_g) == len(outs_f)
    for a, b in zip(outs_g, outs_f):
        assert torch.equal(a, b)
    hybrid_loss(out_g, labels).backward()
    hybrid_loss(out_f, labels).backward()
    for (name, p_g), (_, p_f) in zip(params_g, params_f):
        assert torch.equal(p_g.grad, p_f.grad), name


def test_grouped_model_nests_layers_by_logical_index():
    model = build(tiny_args(pattern="M[M*]-"))
    assert list(model.layers.keys()) == ["0", "1", "2"]
    assert list(model.layers["1"].layers.keys()) == ["0", "1"]
    assert isinstance(model.layers["1"].layers["0"].mamba, Mamba2Mixer)


# --------------------------------------------------------------------- meta-device init


def _meta_init(args, seed):
    args = seeded(args, seed)
    with torch.device("meta"):
        model = HybridModel(args)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():  # as torchtitan's trainer calls it
        model.init_weights(buffer_device=None)
    return model


def test_meta_device_init():
    args = tiny_args(pattern="M*-G-E/*-")
    model = _meta_init(args, seed=0)
    for name, param in model.named_parameters():
        assert torch.isfinite(param).all(), name
    torch.testing.assert_close(model.rope, rotary_tables(head_dim=8, max_seq_len=64,
                                                         theta=args.attention.rope_theta))
    mambas = [m for m in model.modules() if isinstance(m, Mamba2Mixer)]
    gdns = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    assert mambas and gdns
    for mixer in mambas + gdns:
        assert mixer.A_log.min() >= math.log(1.0) - 1e-6
        assert mixer.A_log.max() <= math.log(16.0) + 1e-6
        assert mixer.A_log.std() > 0
        dt = F.softplus(mixer.dt_bias.double())
        assert dt.min() >= 1e-4 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
    for mixer in mambas:
        assert torch.equal(mixer.D, torch.ones_like(mixer.D))
    norms = [m for m in model.modules()
             if isinstance(m, (RMSNorm, GatedGroupRMSNorm, HeadGatedRMSNorm))]
    assert len(norms) >= 10
    for norm in norms:
        assert torch.equal(norm.weight, torch.ones_like(norm.weight))
    # A plain Linear's weight is not left at its meta garbage / zero.
    assert model.output.weight.std() > 0 and model.tok_embeddings.weight.std() > 0

    # Same seed -> identical weights; built on CPU or on meta makes no difference.
    again = _meta_init(args, seed=0)
    on_cpu = build(args, seed=0)
    other_seed = _meta_init(args, seed=1)
    for name, param in model.state_dict().items():
        assert torch.equal(param, again.state_dict()[name]), name
        assert torch.equal(param, on_cpu.state_dict()[name]), name
    assert not torch.equal(model.output.weight, other_seed.output.weight)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("changes, field", [
    (dict(mamba=MambaArgs(d_state=4, head_dim=8, n_groups=3)), "mamba.n_groups"),
    (dict(mamba=MambaArgs(d_state=4, head_dim=12, n_groups=1)), "mamba.head_dim"),
    (dict(attention=AttentionArgs(n_heads=4, n_kv_heads=3, head_dim=8)), "n_kv_heads"),
    (dict(gdn=GDNArgs(key_head_dim=8, value_head_dim=8, n_key_heads=2, n_value_heads=3)),
     "n_key_heads"),
    (dict(moe=MoEArgs(num_experts=4, top_k=5, hidden_dim=12)), "top_k"),
    (dict(moe=MoEArgs(num_experts=4, top_k=0, hidden_dim=12)), "top_k"),
    (dict(moe=MoEArgs(num_experts=4, top_k=2, hidden_dim=12, score_func="relu")), "score_func"),
    (dict(pattern="M[*-"), "position 1"),
    (dict(pattern="M*X"), "'X' at position 2"),
    (dict(pattern="M[E*]"), "last symbol of a group"),
])
def test_invalid_args_raise_before_allocating(changes, field, monkeypatch):
    args = tiny_args(**{"pattern": "M*G-E", **changes})
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("*", r"\*")):
        args.validate()

    def no_allocation(*a, **k):
        raise AssertionError("a layer was built before the arguments were validated")

    for cls in (nn.Embedding, nn.Linear, nn.Conv1d, RMSNorm):
        monkeypatch.setattr(cls, "__init__", no_allocation)
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("*", r"\*")):
        HybridModel(args)


def test_validation_only_checks_layers_in_the_pattern():
    # Mamba / MoE sizes that could not work, in a pattern with neither: fine.
    args = tiny_args(pattern="*-G", mamba=MambaArgs(head_dim=12, n_groups=3),
                     moe=MoEArgs(num_experts=2, top_k=3))
    args.validate()
    # ...but an MTP depth counts as part of the pattern.
    with pytest.raises(ValueError, match="top_k"):
        dataclasses.replace(args, pattern="*-G/E").validate()


def test_flavors_validate():
    for name, args in hybrid_flavors.items():
        args.validate()


# ------------------------------------------------------------------------------- MTP


def test_debug_moe_flavor_returns_logits_aux_and_mtp():
    args = tiny_args("debug_moe")
    assert args.pattern == "M*EME/*-"
    model = build(args)
    tokens, labels = batch()
    out = model(tokens)
    assert isinstance(out, tuple) and len(out) == 3
    logits, aux, mtp_logits = out
    assert logits.shape == mtp_logits.shape == (BATCH, SEQ, VOCAB)
    assert aux.shape == () and aux > 0
    assert not torch.allclose(logits, mtp_logits)
    loss = hybrid_loss(out, labels, mtp_loss_coeff=args.mtp_loss_coeff)
    loss.backward()
    mtp_params = dict(model.mtp.named_parameters())
    assert mtp_params
    for name, param in mtp_params.items():
        assert param.grad is not None and param.grad.abs().sum() > 0, f"mtp.{name}"
    # The MTP loss alone trains the shared embedding / LM head and the main stack below it.
    model.zero_grad(set_to_none=True)
    mtp_only = F.cross_entropy(model(tokens)[2].flatten(0, 1), shift_labels(labels, 1).flatten(),
                               ignore_index=-100)
    mtp_only.backward()
    for name in ("output.weight", "tok_embeddings.weight", "layers.0.mamba.in_proj.weight",
                 "layers.4.moe.router.gate.weight"):
        assert model.get_parameter(name).grad.abs().sum() > 0, name


@pytest.mark.parametrize("pattern", ["M*G-E/*-/*-", "[M*][G-]"])
def test_model_is_causal(pattern):
    """Changing token p changes no main logit before p, and no MTP depth-k logit before p - k
    (depth k reads the embedding of token t + k)."""
    model = build(tiny_args(pattern=pattern), dtype=torch.float64)
    tokens, _ = batch(seed=5, seq_len=20)  # 20 > Mamba chunk 8
    position = 13
    changed = tokens.clone()
    changed[:, position] = (changed[:, position] + 1) % VOCAB
    with torch.no_grad():
        out, out_changed = model(tokens), model(changed)
    outs = out if isinstance(out, tuple) else (out,)
    outs_changed = out_changed if isinstance(out_changed, tuple) else (out_changed,)
    depths = [(0, outs[0], outs_changed[0])] + [
        (k, a, b) for k, (a, b) in enumerate(zip(outs[2:], outs_changed[2:]), start=1)]
    assert len(depths) == (3 if "/" in pattern else 1)
    for k, a, b in depths:
        first_affected = position - k
        torch.testing.assert_close(a[:, :first_affected], b[:, :first_affected],
                                   atol=1e-12, rtol=0)
        assert not torch.allclose(a[:, first_affected], b[:, first_affected])


# ----------------------------------------------------------------------------- FLOPs


def test_flops_dense_attention_mlp_hand_count():
    args = tiny_args(pattern="*-*-")
    model = build(args)
    a, hidden, seq_len = args.attention, args.mlp.hidden_dim, 16
    attention = DIM + DIM * a.head_dim * (2 * a.n_heads + 2 * a.n_kv_heads)  # norm + q,k,v,o
    mlp = DIM + 3 * DIM * hidden  # norm + fc1 [W; V] + fc2
    non_embedding = 2 * attention + 2 * mlp + DIM + VOCAB * DIM  # + final norm + LM head
    attention_core = 2 * (4 * seq_len * a.head_dim * a.n_heads)  # QK^T and PV, 2 layers, fwd
    nparams, flops = nparams_and_flops_per_token(args, model, seq_len)
    assert nparams == non_embedding + VOCAB * DIM
    assert flops == 6 * non_embedding + 3 * attention_core
    assert args.get_nparams_and_flops(model, seq_len) == (nparams, flops)


def test_flops_moe_counts_only_top_k_experts():
    def count(num_experts):
        moe = MoEArgs(num_experts=num_experts, top_k=2, hidden_dim=12, shared_expert_hidden_dim=10)
        args = tiny_args(pattern="*E", moe=moe)
        return args, nparams_and_flops_per_token(args, build(args), 16)

    args, (nparams, flops) = count(4)
    a, m = args.attention, args.moe
    attention = DIM + DIM * a.head_dim * (2 * a.n_heads + 2 * a.n_kv_heads)
    expert = 3 * DIM * m.hidden_dim
    moe_total = DIM + m.num_experts * DIM + m.num_experts * expert + 3 * DIM * 10
    head = DIM + VOCAB * DIM
    assert nparams == VOCAB * DIM + attention + moe_total + head
    active = attention + (moe_total - (m.num_experts - m.top_k) * expert) + head
    assert flops == 6 * active + 3 * 4 * 16 * a.head_dim * a.n_heads
    # More experts at the same top_k: more parameters, a router slightly larger, same experts run.
    _, (nparams8, flops8) = count(8)
    assert nparams8 == nparams + 4 * expert + 4 * DIM
    assert flops8 == flops + 6 * 4 * DIM


def test_flops_count_a_tied_head_as_a_matmul_and_its_weight_once():
    untied, tied = (tiny_args(pattern="*-", enable_weight_tying=tie) for tie in (False, True))
    nparams, flops = nparams_and_flops_per_token(untied, build(untied), 16)
    assert nparams_and_flops_per_token(tied, build(tied), 16) == (nparams - VOCAB * DIM, flops)


# ------------------------------------------------------------------------------- tied head


def test_a_tied_head_is_the_embedding_and_trains_by_both_uses():
    """enable_weight_tying: after meta-device init the head's weight is the embedding's
    Parameter (to_empty gave each its own), with the head's init; the state dict names it
    once; its gradient is the sum of the two uses' gradients, computed by an untied copy; a
    state dict with a head of its own is refused."""
    args = tiny_args(pattern="M*-", enable_weight_tying=True)
    model = _meta_init(args, seed=3)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.tok_embeddings.weight.std().item() == pytest.approx(DIM ** -0.5, rel=0.1)
    state = model.state_dict()
    assert "output.weight" not in state and "tok_embeddings.weight" in state

    untied = HybridModel(dataclasses.replace(args, enable_weight_tying=False))
    untied.load_state_dict({**state, "output.weight": state["tok_embeddings.weight"]})
    assert untied.output.weight is not untied.tok_embeddings.weight
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    for each in (model, untied):
        each(tokens).square().mean().backward()
    torch.testing.assert_close(model.tok_embeddings.weight.grad,
                               untied.tok_embeddings.weight.grad + untied.output.weight.grad,
                               rtol=1e-6, atol=1e-7)

    copy = HybridModel(args)
    copy.load_state_dict(state)
    assert copy.output.weight is copy.tok_embeddings.weight
    assert torch.equal(copy(tokens), model(tokens))
    with pytest.raises(RuntimeError, match="'output.weight': the model ties its LM head"):
        copy.load_state_dict(untied.state_dict())


# --------------------------------------------------------------------------- packed documents


def test_documents_from_bos_and_packed_layout():
    tokens = torch.tensor([[7, 1, 5, 5, 1, 9], [1, 4, 1, 1, 3, 3]])
    seq_idx, positions = documents_from_bos(tokens, bos_id=1)
    assert seq_idx.tolist() == [[0, 1, 1, 1, 2, 2], [1, 1, 2, 3, 3, 3]]
    assert positions.tolist() == [[0, 0, 1, 2, 0, 1], [0, 1, 0, 0, 1, 2]]
    seq_idx, positions = packed_layout(torch.tensor([0, 3, 4, 8], dtype=torch.int32))
    assert seq_idx.tolist() == [[0, 0, 0, 1, 2, 2, 2, 2]]
    assert positions.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]


@pytest.mark.parametrize("flavor", ["debug", "debug_moe"])
def test_packed_row_gives_each_document_its_own_logits(flavor):
    """Documents packed into one row (THD) give the logits (so the per-token loss) of running
    each document alone: attention, Mamba, GDN and rotary positions all stay in-document."""
    args = tiny_args(flavor, pattern="M*G-E" if flavor == "debug_moe" else "M-*-G-M")
    model = build(args, seed=3, dtype=torch.float64)
    cu_seqlens = torch.tensor([0, 5, 7, 20, 29], dtype=torch.int32)  # 2 tokens < conv width
    tokens = torch.randint(2, VOCAB, (1, 29), generator=torch.Generator().manual_seed(4))
    seq_idx, positions = packed_layout(cu_seqlens)
    packed = model(tokens, positions=positions, seq_idx=seq_idx)
    packed_logits = packed if isinstance(packed, torch.Tensor) else packed[0]
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        alone = model(tokens[:, start:end])
        alone_logits = alone if isinstance(alone, torch.Tensor) else alone[0]
        torch.testing.assert_close(packed_logits[:, start:end], alone_logits,
                                   atol=1e-10, rtol=1e-10)
    # The packing is not a no-op: without it, later documents see earlier ones.
    plain = model(tokens)
    plain_logits = plain if isinstance(plain, torch.Tensor) else plain[0]
    assert not torch.allclose(plain_logits[:, 5:], packed_logits[:, 5:])
