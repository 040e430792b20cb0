"""Checkpoint folders: commit by rename, checksums, and what counts as damaged (one process, real
DCP saves); the divergence guard's verdicts."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from titan_hybrid.checkpoint import integrity
from titan_hybrid.runtime.errors import DivergedError
from titan_hybrid.training.divergence import DivergenceGuard


def save(folder, seed=0):
    torch.manual_seed(seed)
    dcp.save({"w": torch.randn(256, 256), "b": torch.randn(256)}, checkpoint_id=str(folder))


@pytest.fixture
def committed(tmp_path):
    partial = tmp_path / "step-4.partial"
    save(partial)
    integrity.commit(partial, tmp_path / "step-4")
    return tmp_path / "step-4"


def test_commit_renames_the_complete_folder_and_records_every_file(tmp_path, committed):
    assert not (tmp_path / "step-4.partial").exists()
    sums = json.loads((committed / integrity.CHECKSUMS_FILE).read_text())
    assert sorted(sums) == [".metadata", "__0_0.distcp"]
    for name, entry in sums.items():
        assert entry["bytes"] == (committed / name).stat().st_size
        assert entry["crc32"] == integrity.file_crc32(committed / name)
    assert integrity.verify(committed) is None


@pytest.mark.parametrize("damage, reason", [
    (lambda f: (f / "__0_0.distcp").write_bytes(b"x"), "__0_0.distcp has 1 bytes"),
    (lambda f: (f / "__0_0.distcp").unlink(), "__0_0.distcp is missing"),
    (lambda f: (f / "__0_0.distcp").write_bytes(
        (f / "__0_0.distcp").read_bytes()[:-8] + b"\0" * 8), "__0_0.distcp: checksum mismatch"),
    (lambda f: (f / integrity.CHECKSUMS_FILE).write_text("{"), "unreadable checksums.json"),
])
def test_verify_names_the_damage(committed, damage, reason):
    damage(committed)
    assert reason in integrity.verify(committed)


def test_folders_without_checksums_get_a_structural_check(tmp_path):
    folder = tmp_path / "step-2"
    save(folder)  # as torchtitan would: no checksums.json
    assert integrity.verify(folder) is None
    data = folder / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:1000])
    assert "__0_0.distcp is truncated (1000 bytes" in integrity.verify(folder)
    (folder / ".metadata").write_bytes(b"garbage")
    assert "unreadable .metadata" in integrity.verify(folder)
    (folder / ".metadata").unlink()
    assert integrity.verify(folder) == "no .metadata (the save did not finish)"


def test_a_new_save_replaces_a_damaged_folder_of_the_same_step(tmp_path, committed):
    (committed / "__0_0.distcp").write_bytes(b"broken")
    partial = tmp_path / "step-4.partial"
    save(partial, seed=1)
    integrity.commit(partial, committed)
    assert integrity.verify(committed) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4"]


def test_leftovers_of_interrupted_saves_are_discarded_and_never_listed(tmp_path, committed):
    save(tmp_path / "step-6.partial")
    (tmp_path / "step-8.replaced").mkdir()
    integrity.set_aside_damaged(committed)
    assert integrity.step_folders(tmp_path) == []
    removed = integrity.discard_leftovers(tmp_path)
    assert sorted(p.name for p in removed) == ["step-4.damaged", "step-6.partial",
                                               "step-8.replaced"]
    # Nothing else was there: the folder goes too, so an initial_load_path applies again.
    assert not tmp_path.exists()


def guard_with_grads(value: float) -> DivergenceGuard:
    model = nn.Linear(4, 4)
    for param in model.parameters():
        param.grad = torch.full_like(param, value)
    return DivergenceGuard([model], microbatches_per_step=2)


def test_guard_passes_a_finite_step_and_checks_only_after_the_last_microbatch():
    guard = guard_with_grads(1.0)
    guard.after_microbatch(torch.tensor(float("nan")), step=3)  # first of 2: not checked yet
    with pytest.raises(DivergedError, match="diverged at step 3: loss = nan on rank 0$|"
                                            "diverged at step 3: loss = nan on rank 0\\."):
        guard.after_microbatch(torch.tensor(1.0), step=3)
    healthy = guard_with_grads(1.0)
    healthy.after_microbatch(torch.tensor(2.0), step=1)
    healthy.after_microbatch(torch.tensor(2.0), step=1)  # no error


@pytest.mark.parametrize("grad, shown", [(math.inf, "gradient norm = inf"),
                                         (math.nan, "gradient norm = nan"),
                                         (1e30, "gradient norm = inf")])  # finite, norm overflows
def test_guard_sees_non_finite_gradient_norms(grad, shown):
    guard = guard_with_grads(grad)
    with pytest.raises(DivergedError, match=f"step 5: {shown} on rank 0"):
        guard.check(5, torch.tensor(1.0, dtype=torch.float64))


def test_guard_runs_before_clipping_because_clipping_hides_an_overflowing_norm():
    # Finite gradients whose float32 norm overflows: clipping scales them by 1/inf = 0, and the
    # step would go ahead with all-zero gradients (Adam's moments still move the weights).
    params = list(guard_with_grads(1e30).model_parts[0].parameters())
    norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    assert math.isinf(norm)
    assert all(torch.equal(p.grad, torch.zeros_like(p.grad)) for p in params)
