"""titan_hybrid.training.loss.hybrid_loss against hand-computed values.

The trainer divides the returned loss by the global number of valid tokens, so cross-entropy is
a SUM and the MoE aux loss is scaled by this batch's valid-token count. MTP depth k predicts
labels[t + k]; its last k positions have no target. References are computed in float64 from
log-softmax by hand; the loss itself runs in float32 (rtol 1e-6).
"""

from __future__ import annotations

import pytest
import torch

from titan_hybrid.training.loss import hybrid_loss, shift_labels

IGNORE = -100
B, T, V = 2, 7, 11
TOL = dict(atol=1e-4, rtol=1e-6)


def make(seed=0, n_mtp=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=gen) * 2
    labels = torch.randint(0, V, (B, T), generator=gen)
    labels[0, 2] = IGNORE  # padding / ignored positions inside the sequence
    labels[1, 5] = IGNORE
    mtp = [torch.randn(B, T, V, generator=gen) * 2 for _ in range(n_mtp)]
    return logits, labels, mtp


def ce_sum_by_hand(logits, targets):
    """sum over positions with a target of -log softmax(logits)[target], float64, by loops."""
    total = torch.zeros((), dtype=torch.float64)
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            target = int(targets[b][t])
            if target == IGNORE:
                continue
            row = logits[b, t].double()
            total += torch.logsumexp(row, 0) - row[target]
    return total


def test_plain_logits_give_cross_entropy_sum():
    logits, labels, _ = make()
    loss = hybrid_loss(logits, labels)
    assert loss.shape == ()
    torch.testing.assert_close(loss.double(), ce_sum_by_hand(logits, labels.tolist()), **TOL)
    # a sum, not a mean: 12 valid tokens of ~log(V) each
    assert loss > 0.5 * 12 * torch.log(torch.tensor(float(V)))


def test_aux_loss_is_scaled_by_valid_tokens():
    logits, labels, _ = make(seed=1)
    aux = torch.tensor(0.0375)
    loss = hybrid_loss((logits, aux), labels)
    n_valid = B * T - 2
    want = ce_sum_by_hand(logits, labels.tolist()) + 0.0375 * n_valid
    torch.testing.assert_close(loss.double(), want, **TOL)
    # the aux term carries gradient
    aux = torch.tensor(0.5, requires_grad=True)
    hybrid_loss((logits, aux), labels).backward()
    assert aux.grad == n_valid


def test_shift_labels():
    labels = torch.tensor([[1, 2, 3, IGNORE, 5], [6, 7, 8, 9, 10]])
    assert shift_labels(labels, 1).tolist() == [[2, 3, IGNORE, 5, IGNORE],
                                                [7, 8, 9, 10, IGNORE]]
    assert shift_labels(labels, 2).tolist() == [[3, IGNORE, 5, IGNORE, IGNORE],
                                                [8, 9, 10, IGNORE, IGNORE]]


@pytest.mark.parametrize("n_mtp", [1, 2])
def test_mtp_targets_are_labels_shifted_by_depth(n_mtp):
    logits, labels, mtp = make(seed=2, n_mtp=n_mtp)
    aux, coeff = torch.tensor(0.01), 0.3
    loss = hybrid_loss((logits, aux, *mtp), labels, mtp_loss_coeff=coeff)

    rows = labels.tolist()
    mtp_total = torch.zeros((), dtype=torch.float64)
    for depth, depth_logits in enumerate(mtp, start=1):
        # target of position t at depth k: labels[t + k]; none for the last k positions
        targets = [[row[t + depth] if t + depth < T else IGNORE for t in range(T)]
                   for row in rows]
        mtp_total += ce_sum_by_hand(depth_logits, targets)
    n_valid = B * T - 2
    want = ce_sum_by_hand(logits, rows) + 0.01 * n_valid + coeff / n_mtp * mtp_total
    torch.testing.assert_close(loss.double(), want, **TOL)
