"""Manifold-constrained hyper-connections (model/hyper_connections.py) against transformers'
DeepSeek-V4 modules (DeepseekV4HyperConnection, DeepseekV4HyperHead) and a float64
step-by-step reference: the forward and every gradient; and the model with N streams."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4HyperConnection,
    DeepseekV4HyperHead,
)

from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.hyper_connections import HyperConnection, HyperHead
from titan_hybrid.model.model import HybridModel

B, T, N, D = 2, 5, 4, 8
EPS, NORM_EPS, ITERS = 1e-6, 1e-6, 20


def _filled(module: torch.nn.Module, seed: int, dtype=torch.float64) -> torch.nn.Module:
    """The module with random (not init) values, so every weight matters."""
    generator = torch.Generator().manual_seed(seed)
    module.to(dtype)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator,
                                        dtype=torch.float64) * 0.5)
    return module


def _streams(seed: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(B, T, N, D, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64).to(dtype).requires_grad_()


# transformers computes the mHC weights in fp32 whatever the module's dtype (`.float()`), so
# the comparison with its modules runs in fp32, where both compute the same operations; the
# float64 reference below checks the math at float64 precision.
FP32 = dict(rtol=1e-5, atol=1e-6)


def _theirs_config() -> DeepseekV4Config:
    return DeepseekV4Config(hidden_size=D, hc_mult=N, hc_sinkhorn_iters=ITERS, hc_eps=EPS,
                            rms_norm_eps=NORM_EPS)


def _grads(outputs, inputs) -> list[torch.Tensor]:
    weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i),
                           dtype=o.dtype) for i, o in enumerate(outputs)]
    loss = sum((o * w).sum() for o, w in zip(outputs, weights))
    return torch.autograd.grad(loss, inputs)


def test_a_hyper_connection_is_transformers_deepseek_v4_one_forward_and_backward():
    ours = _filled(HyperConnection(D, N, sinkhorn_iters=ITERS, eps=EPS, norm_eps=NORM_EPS), 0,
                   torch.float32)
    theirs = _filled(DeepseekV4HyperConnection(_theirs_config()), 0, torch.float32)
    assert [name for name, _ in ours.named_parameters()] == ["fn", "base", "scale"]
    assert [p.shape for p in ours.parameters()] == [p.shape for p in theirs.parameters()]
    h, out = _streams(1, torch.float32), _streams(2, torch.float32)[:, :, 0].detach()
    out.requires_grad_()
    x, post, comb = ours(h)
    their_post, their_comb, their_x = theirs(h)
    # Their decoder layer writes a block's output back so (modeling_deepseek_v4.py).
    theirs_next = (their_post[..., None] * out[:, :, None, :]
                   + their_comb.transpose(-1, -2) @ h)
    ours_next = HyperConnection.combine(h, out, post, comb)
    for a, b in ((x, their_x), (post, their_post), (comb, their_comb), (ours_next, theirs_next)):
        torch.testing.assert_close(a, b, **FP32)
    our_grads = _grads((x, ours_next), (h, out, *ours.parameters()))
    their_grads = _grads((their_x, theirs_next), (h, out, *theirs.parameters()))
    for a, b in zip(our_grads, their_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_hyper_head_is_transformers_deepseek_v4_one_forward_and_backward():
    ours = _filled(HyperHead(D, N, eps=EPS, norm_eps=NORM_EPS), 3, torch.float32)
    theirs = _filled(DeepseekV4HyperHead(_theirs_config()), 3, torch.float32)
    assert [name for name, _ in ours.named_parameters()] == ["hc_fn", "hc_base", "hc_scale"]
    h = _streams(4, torch.float32)
    torch.testing.assert_close(ours(h), theirs(h), **FP32)
    for a, b in zip(_grads((ours(h),), (h, *ours.parameters())),
                    _grads((theirs(h),), (h, *theirs.parameters())), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _reference_layer(h, out, fn, base, scale):
    """One mHC layer written out element by element (float64): each token's normed flattened
    streams, its N pre / N post / N x N comb logits, the Sinkhorn loop over rows and columns,
    the collapsed input and the new streams."""
    new, inputs = torch.empty_like(h), torch.empty(B, T, D, dtype=h.dtype)
    for b in range(B):
        for t in range(T):
            flat = h[b, t].reshape(-1)
            flat = flat / torch.sqrt((flat * flat).mean() + NORM_EPS)
            logits = [sum(fn[r, c] * flat[c] for c in range(N * D)) for r in range((2 + N) * N)]
            pre = [torch.sigmoid(logits[k] * scale[0] + base[k]) + EPS for k in range(N)]
            post = [2 * torch.sigmoid(logits[N + k] * scale[1] + base[N + k]) for k in range(N)]
            raw = [[logits[2 * N + i * N + j] * scale[2] + base[2 * N + i * N + j]
                    for j in range(N)] for i in range(N)]
            comb = [[torch.exp(raw[i][j]) / sum(torch.exp(raw[i][m]) for m in range(N)) + EPS
                     for j in range(N)] for i in range(N)]
            for step in range(2 * ITERS - 1):  # columns first, then rows, ..., columns last
                if step % 2 == 0:
                    sums = [sum(comb[i][j] for i in range(N)) + EPS for j in range(N)]
                    comb = [[comb[i][j] / sums[j] for j in range(N)] for i in range(N)]
                else:
                    sums = [sum(comb[i][j] for j in range(N)) + EPS for i in range(N)]
                    comb = [[comb[i][j] / sums[i] for j in range(N)] for i in range(N)]
            inputs[b, t] = sum(pre[k] * h[b, t, k] for k in range(N))
            for k in range(N):
                new[b, t, k] = post[k] * out[b, t] + sum(comb[j][k] * h[b, t, j]
                                                         for j in range(N))
    return inputs, new


def test_a_hyper_connection_matches_its_float64_step_by_step_reference_and_gradients():
    ours = _filled(HyperConnection(D, N, sinkhorn_iters=ITERS, eps=EPS, norm_eps=NORM_EPS), 5)
    h, out = _streams(6), _streams(7)[:, :, 0].detach().requires_grad_()
    x, post, comb = ours(h)
    ours_outputs = (x, HyperConnection.combine(h, out, post, comb))
    reference = _reference_layer(h, out, ours.fn, ours.base, ours.scale)
    for a, b in zip(ours_outputs, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    inputs = (h, out, *ours.parameters())
    for a, b in zip(_grads(ours_outputs, inputs), _grads(reference, inputs), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("flavor", ["debug", "debug_moe"])
def test_a_model_with_four_streams_has_a_hyper_connection_per_layer_and_trains(flavor):
    """Every physical layer (the MTP depth's too) reads and writes the 4 streams through its
    own hyper-connection; the hyper heads and V4's MTP projections are there; every parameter
    gets a gradient, and a few SGD steps lower the loss."""
    args = dataclasses.replace(hybrid_flavors[flavor], hc_mult=N, dim=64, vocab_size=128)
    torch.manual_seed(0)
    model = HybridModel(args)
    model.init_weights()
    names = {name for name, _ in model.named_parameters()}
    pattern = args.parsed_pattern
    layers = pattern.num_physical_layers + pattern.mtp_depths * len(pattern.mtp)
    assert sum(name.endswith("hyper_connection.fn") for name in names) == layers
    assert {"hc_head.hc_fn", "hc_head.hc_base", "hc_head.hc_scale"} <= names
    if args.parsed_pattern.mtp_depths:
        assert {"mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.hc_head.hc_fn"} <= names
        assert not any("eh_proj" in name for name in names)
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(4):
        out = model(tokens)
        logits, aux_loss, *mtp_logits = out if isinstance(out, tuple) else (out, 0.0)
        loss = aux_loss
        for ahead, head_logits in enumerate([logits, *mtp_logits], start=1):
            loss = loss + torch.nn.functional.cross_entropy(
                head_logits[:, :-ahead].flatten(0, 1), tokens[:, ahead:].flatten())
        optimizer.zero_grad()
        loss.backward()
        if not losses:
            assert all(p.grad is not None for name, p in model.named_parameters()
                       if "hyper_connection" in name or "hc_head" in name)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_the_flops_count_the_hyper_connections_as_torchs_flop_counter_does():
    """Per token: the projection is a matmul weight (2 FLOPs per parameter forward) and the
    streams' mix a matmul of 2 N^2 D; torch's counter sees both (not the elementwise collapse
    and write-back, which mixing_flops adds); MFU's count grows by exactly these, x3."""
    from torch.utils.flop_counter import FlopCounterMode

    from titan_hybrid.model.hyper_connections import mixing_flops

    layer = HyperConnection(D, N, sinkhorn_iters=ITERS, eps=EPS, norm_eps=NORM_EPS)
    layer.init_weights(init_std=0.02)
    h, out = torch.randn(B, T, N, D), torch.randn(B, T, D)
    with FlopCounterMode(display=False) as counter:
        HyperConnection.combine(h, out, *layer(h)[1:])
    assert counter.get_total_flops() == B * T * (2 * layer.fn.numel() + 2 * N * N * D)
    args = dataclasses.replace(hybrid_flavors["debug"], dim=64, vocab_size=128)
    with torch.device("meta"):
        plain, streams = HybridModel(args), HybridModel(dataclasses.replace(args, hc_mult=N))
    added = sum(p.numel() for p in streams.parameters()) - sum(p.numel() for p in plain.parameters())
    layers = args.parsed_pattern.num_physical_layers
    assert (streams.model_args.get_nparams_and_flops(streams, 64)[1]
            - args.get_nparams_and_flops(plain, 64)[1]
            == 6 * added + 3 * (layers * mixing_flops(64, N) + 2 * N * 64))


def test_a_job_that_hyper_connections_cannot_run_is_one_line_naming_the_field():
    from tests.run_configs import run_from_args
    from titan_hybrid.parallel.validate import validate_layout

    with pytest.raises(ValueError, match=r"^hc_mult=-1 must be >= 0"):
        run_from_args("--hybrid.hc_mult", "-1")
    run = run_from_args("--hybrid.hc_mult", "4", "--model.flavor", "debug_moe",
                        "--parallelism.expert_parallel_degree", "2",
                        "--parallelism.expert_parallel_overlap",
                        "--training.global_batch_size", "32")
    assert run.model.hc_mult == 4
    validate_layout(run, 2)  # EP overlap runs hyper-connections (tests/distributed/)
    from titan_hybrid.mimo.vision_language import VisionLanguageModel

    with pytest.raises(ValueError, match=r"^VisionLanguageModel: hc_mult=4: this example's "
                                         r"front end feeds the LM one stream"):
        VisionLanguageModel(dataclasses.replace(hybrid_flavors["debug"], hc_mult=4),
                            vision_dim=8, image_token_id=3)


def test_fp8_converts_the_model_around_the_hyper_connections_and_trains():
    """FP8 (emulated on CPU) converts the Linear modules, V4's MTP projections included, and
    leaves the hyper-connections' weights in their precision; the model still steps."""
    from titan_hybrid.config.sections import Float8Section
    from titan_hybrid.quantize.float8 import apply_float8

    args = dataclasses.replace(hybrid_flavors["debug_moe"], hc_mult=N, dim=64, vocab_size=128)
    torch.manual_seed(0)
    model = HybridModel(args)
    model.init_weights()
    converted = apply_float8(model, Float8Section(enable=True, emulate=True))
    assert "mtp.0.e_proj" in converted and "mtp.0.h_proj" in converted
    assert not any("hyper_connection" in fqn or "hc_head" in fqn for fqn in converted)
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    logits = model(tokens)[0]
    logits.float().logsumexp(-1).mean().backward()
    assert torch.isfinite(logits).all()
    assert all(p.grad is not None and p.dtype == torch.float32  # the main head's loss
               for name, p in model.named_parameters()
               if "hyper_connection" in name and name.startswith("layers."))
