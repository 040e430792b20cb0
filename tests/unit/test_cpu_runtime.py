"""The CPU runtime patches that let torchtitan's trainer run without an accelerator."""

import json

import pytest
import torch

import titan_hybrid.torchtitan_plugin  # noqa: F401  (TrainSpec, dataset; CPU runtime)
from titan_hybrid.runtime import cpu

pytestmark = pytest.mark.skipif(cpu.accelerator_available(), reason="CPU-only patches")


def test_torchtitan_sees_a_cpu_device_everywhere():
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tt_utils

    for module in (tt_utils, dist_utils, parallel_dims, metrics):
        assert module.device_type == "cpu", module.__name__
    assert tt_utils.device_module.get_device_properties().total_memory > 0
    assert tt_utils.device_module.memory_stats()["active_bytes.all.peak"] > 0


def test_fsdp_gradient_reduction_uses_sum_on_cpu():
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    class TwoRankGroup:  # only .size() is consulted
        def size(self):
            return 2

    # torchtitan passes factor=1.0; unpatched, FSDP2 then picks PREMUL_SUM, which gloo rejects.
    *_, reduce_scatter_op, all_reduce_op = collectives._get_gradient_divide_factors(
        TwoRankGroup(), None, torch.float32, "cpu", 1.0)
    assert reduce_scatter_op == dist.ReduceOp.SUM and all_reduce_op == dist.ReduceOp.SUM
    *_, cuda_op, _ = collectives._get_gradient_divide_factors(
        TwoRankGroup(), None, torch.float32, "cuda", 1.0)
    assert cuda_op != dist.ReduceOp.SUM  # the patch is CPU-only


def test_peak_flops_is_measured_here():
    import torchtitan.tools.utils as tt_utils

    peak = tt_utils.get_peak_flops("cpu")
    assert peak == cpu.measured_peak_flops()
    # A real measurement on this machine, not torchtitan's A100 fallback (312 TFLOP/s bf16).
    assert 1e8 < peak < 5e13


def test_peak_flops_keeps_the_best_measurement_of_this_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_HYBRID_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu, "MEASUREMENTS_PER_MACHINE", 4)
    # a busy moment, then a measurement beyond the limit that is never taken
    for measured, expected in ((4e10, 4e10), (1e11, 1e11), (3e10, 1e11), (5e10, 1e11),
                               (2e11, 1e11)):
        monkeypatch.setattr(cpu, "matmul_flops", lambda: measured)
        cpu.measured_peak_flops.cache_clear()
        assert cpu.measured_peak_flops() == expected
    cpu.measured_peak_flops.cache_clear()
    cached = json.loads((tmp_path / "cpu_peak_flops.json").read_text())
    assert list(cached.values()) == [{"best": 1e11, "measurements": 4}]


def test_peak_flops_reads_a_bare_figure_from_an_older_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_HYBRID_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu, "matmul_flops", lambda: 3e10)
    cpu.measured_peak_flops.cache_clear()
    cpu.measured_peak_flops()
    key = next(iter(json.loads((tmp_path / "cpu_peak_flops.json").read_text())))
    (tmp_path / "cpu_peak_flops.json").write_text(json.dumps({key: 9e10}))
    cpu.measured_peak_flops.cache_clear()
    assert cpu.measured_peak_flops() == 9e10
    cpu.measured_peak_flops.cache_clear()  # later tests measure for real again
    cached = json.loads((tmp_path / "cpu_peak_flops.json").read_text())
    assert cached == {key: {"best": 9e10, "measurements": 2}}
