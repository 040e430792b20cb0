"""The shipped autotune picks (titan_hybrid.ops.autotune_picks): the table fits the installed
mamba_ssm, an installed pick is the config a kernel runs without being benchmarked (keys
without a pick still autotune), the start-up call and its opt-out, and bench/autotune_picks.py
choosing the fastest finite config from a Triton cache.

The mamba_ssm cases carry the triton_interpreter marker (tests/triton_kernels.py): the SSD scan
runs in Triton's interpreter on CPU, whose autotuner shim scores every config equal (so it
would choose the first), or on CUDA where there is a GPU.
"""

from __future__ import annotations

import contextlib
import json
import math
import tarfile
import types
from unittest import mock

import pytest
import torch

from bench import autotune_picks as picks_script
from tests.triton_kernels import DEVICE, assert_close_rel, kernels_on, outputs_and_grads
from titan_hybrid.compat import triton_autotune
from titan_hybrid.ops import autotune_picks
from titan_hybrid.ops.autotune_picks import InstalledPicks, install_autotune_picks
from titan_hybrid.ops.ssd import mamba_chunk_scan_combined

SM90 = (9, 0)


def _is_dtype(value) -> bool:
    return isinstance(value, str) and value.startswith("torch.")


@pytest.mark.triton_interpreter
def test_shipped_table_fits_the_installed_mamba_ssm():
    """Every pick names an autotuned SSD kernel of the installed mamba_ssm, one of that kernel's
    own configs, and a tuning key of the kernel's form: a value per key argument, then the
    dtypes of at most all its pointer arguments."""
    table = autotune_picks.shipped_picks(SM90)
    assert table["measured"]["capability"] == "9.0" and table["picks"]
    assert len({(p["kernel"], json.dumps(p["key"])) for p in table["picks"]}) == len(
        table["picks"])
    with kernels_on():
        autotuners = triton_autotune.ssd_autotuners()
        for pick in table["picks"]:
            autotuner = autotuners[pick["kernel"]]
            config = triton_autotune.own_config(autotuner, pick["config"])
            assert config is not None and config.pre_hook is None, pick
            values = [v for v in pick["key"] if not _is_dtype(v)]
            dtypes = pick["key"][len(values):]
            pointers = [n for n in triton_autotune.argument_names(autotuner) if n.endswith("_ptr")]
            assert len(values) == len(triton_autotune.key_names(autotuner)), pick
            assert dtypes and all(map(_is_dtype, dtypes)) and len(dtypes) <= len(pointers), pick


def _scan(chunk_size: int = 16):
    """A float32 SSD scan through our op, forward and every input gradient."""
    gen = torch.Generator().manual_seed(0)
    b, l, h, p, g, n = 1, 32, 2, 8, 1, 16
    inputs = dict(x=torch.randn(b, l, h, p, generator=gen), dt=torch.randn(b, l, h, generator=gen),
                  A=-torch.rand(h, generator=gen) - 0.5, B=torch.randn(b, l, g, n, generator=gen),
                  C=torch.randn(b, l, g, n, generator=gen), D=torch.randn(h, generator=gen),
                  dt_bias=torch.randn(h, generator=gen))
    inputs = {name: value.to(DEVICE) for name, value in inputs.items()}
    return outputs_and_grads(mamba_chunk_scan_combined, inputs, chunk_size=chunk_size,
                             dt_softplus=True)


@pytest.fixture
def ssd_autotuners():
    """mamba_ssm's SSD autotuners inside kernels_on(), their tables emptied; restored after
    (they are module globals that other tests in this process share)."""
    with kernels_on():
        autotuners = triton_autotune.ssd_autotuners()
        saved = {name: dict(triton_autotune.tuning_table(a)) for name, a in autotuners.items()}
        try:
            yield autotuners
        finally:
            for name, autotuner in autotuners.items():
                triton_autotune.tuning_table(autotuner).clear()
                triton_autotune.tuning_table(autotuner).update(saved[name])


def _clear(autotuners) -> None:
    for autotuner in autotuners.values():
        triton_autotune.tuning_table(autotuner).clear()


@pytest.mark.triton_interpreter
def test_installed_picks_run_without_benchmarking(ssd_autotuners):
    _clear(ssd_autotuners)
    want = _scan()  # tunes every kernel the scan runs: their tuning keys at this shape
    used = {name: list(triton_autotune.tuning_table(a)) for name, a in ssd_autotuners.items()
            if triton_autotune.tuning_table(a)}
    assert len(used) >= 10, used
    # Each kernel's last config, never the one the interpreter's equal scores choose; kernels
    # whose configs carry a pre_hook (zeroing an output) are included: it must be kept.
    last = {name: triton_autotune.configs(ssd_autotuners[name])[-1] for name in used}
    picks = [{"kernel": name, "key": list(key), "config": triton_autotune.describe(last[name])}
             for name, keys in used.items() for key in keys]
    table = json.loads(json.dumps({"measured": {}, "picks": picks}))  # as shipped: JSON keys
    _clear(ssd_autotuners)
    assert install_autotune_picks(table) == InstalledPicks(len(picks), ())

    with contextlib.ExitStack() as stack:  # counts each autotuner's timing runs
        spies = {name: stack.enter_context(mock.patch.object(a, "_bench", wraps=a._bench))
                 for name, a in ssd_autotuners.items()}
        got = _scan()
        for name in used:
            autotuner = ssd_autotuners[name]
            assert spies[name].call_count == 0, f"{name} was benchmarked"
            assert autotuner.best_config is last[name], name  # what it launched last
            assert list(triton_autotune.tuning_table(autotuner)) == [tuple(used[name][0])]
        # Another chunk size: new keys for the kernels keyed on it, which autotune as before.
        _scan(chunk_size=32)
        retuned = {name for name, spy in spies.items() if spy.call_count}
    assert {"_bmm_chunk_fwd_kernel", "_chunk_scan_fwd_kernel"} <= retuned
    assert_close_rel(got, want, 2e-5 if DEVICE == "cpu" else 5e-3, "scan with the picks")


def _fake_autotuner(*configs):
    return types.SimpleNamespace(configs=list(configs), cache={})


def _config(block: int, warps: int = 4, pre_hook=None):
    return types.SimpleNamespace(kwargs={"BLOCK_SIZE": block}, num_warps=warps, num_stages=3,
                                 num_ctas=1, maxnreg=None, pre_hook=pre_hook)


def test_a_pick_installs_the_autotuners_own_config_and_reports_the_rest(monkeypatch):
    hook = object()
    own = _config(128, pre_hook=hook)
    autotuner = _fake_autotuner(_config(64), own)
    monkeypatch.setattr(triton_autotune, "ssd_autotuners", lambda: {"_kernel": autotuner})
    described = triton_autotune.describe(own)
    table = {"picks": [
        {"kernel": "_kernel", "key": [128, False, "torch.bfloat16"], "config": described},
        {"kernel": "_kernel", "key": [256, False, "torch.bfloat16"],
         "config": described | {"num_warps": 8}},
        {"kernel": "_gone_kernel", "key": [1], "config": described}]}
    result = install_autotune_picks(table)
    assert result.installed == 1
    assert result.skipped == (
        "_kernel [256, False, 'torch.bfloat16']: its config is not one the installed mamba_ssm "
        "declares",
        "_gone_kernel [1]: the installed mamba_ssm has no such autotuned kernel")
    assert autotuner.cache == {(128, False, "torch.bfloat16"): own}
    assert autotuner.cache[(128, False, "torch.bfloat16")].pre_hook is hook


def _on_gpu_with_mamba_ssm(monkeypatch, capability=SM90):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: capability)
    monkeypatch.setattr(autotune_picks, "probe_kernels", lambda: {"mamba_ssm": None})
    installed = []
    monkeypatch.setattr(autotune_picks, "install_autotune_picks", lambda table: installed.append(
        table) or InstalledPicks(len(table["picks"]) - 1, ("_k [1]: why",)))
    return installed


def test_start_up_installs_the_shipped_table_for_this_gpu(monkeypatch):
    monkeypatch.delenv(autotune_picks.OPT_OUT, raising=False)
    installed = _on_gpu_with_mamba_ssm(monkeypatch)
    line = autotune_picks.install_picks_at_start_up()
    assert installed == [autotune_picks.shipped_picks(SM90)]
    count = len(installed[0]["picks"])
    assert line == (f"autotune picks: {count - 1} of {count} installed (sm90.json: NVIDIA H200, "
                    "triton 3.6.0, mamba_ssm 2.3.2.post1); _k [1]: why")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (8, 0))
    assert autotune_picks.install_picks_at_start_up() == (
        "autotune picks: none shipped for sm80, mamba_ssm's kernels autotune")
    assert len(installed) == 1


def test_start_up_opt_out_and_no_kernels(monkeypatch):
    installed = _on_gpu_with_mamba_ssm(monkeypatch)
    monkeypatch.setenv(autotune_picks.OPT_OUT, "0")
    assert autotune_picks.install_picks_at_start_up() == (
        "autotune picks: not installed (TITAN_HYBRID_AUTOTUNE_PICKS=0), mamba_ssm's kernels "
        "autotune")
    monkeypatch.delenv(autotune_picks.OPT_OUT)
    monkeypatch.setattr(autotune_picks, "probe_kernels", lambda: {"mamba_ssm": "not installed"})
    assert autotune_picks.install_picks_at_start_up() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(autotune_picks, "probe_kernels", lambda: pytest.fail("probed"))
    assert autotune_picks.install_picks_at_start_up() is None
    assert installed == []


def _timed(block: int, timings: list[float]) -> list:
    return [{"kwargs": {"BLOCK_SIZE": block}, "num_warps": 4, "num_ctas": 1, "num_stages": 3,
             "maxnreg": None, "pre_hook": None, "ir_override": None}, timings]


def test_the_picks_script_chooses_the_fastest_finite_config(tmp_path):
    cache = tmp_path / "triton-cache"
    inf = math.inf
    files = {
        "AAA/_scan_kernel.autotune.json": {"key": [128, True, "torch.bfloat16"], "configs_timings": [
            _timed(64, [inf, inf, inf]), _timed(128, [0.30, 0.29, 0.31]),
            _timed(256, [0.20, 0.19, 0.27]), _timed(512, [0.21, 0.20, 0.22])]},
        # a newer Triton writes every key entry as a string
        "BBB/_passing_kernel.autotune.json": {"key": ["8192", "False", "torch.float32"],
                                              "configs_timings": [
            _timed(64, [0.5, 0.5, 0.5]), _timed(128, [0.1, 0.1, 0.1])]}}
    for name, record in files.items():
        (cache / name).parent.mkdir(parents=True)
        (cache / name).write_text(json.dumps(record))
    with tarfile.open(tmp_path / "caches.tar.gz", "w:gz") as tar:
        tar.add(cache, arcname=cache.name)
    out = tmp_path / "sm90.json"
    measured = ["--device", "GPU", "--capability", "9.0", "--triton", "3.6.0",
                "--mamba-ssm", "2.3.2.post1", "--date", "2026-11-27", "--jobs", "j"]
    assert picks_script.main([str(tmp_path / "caches.tar.gz"), "--out", str(out), *measured]) == 0
    table = json.loads(out.read_text())
    assert table["measured"] == {"device": "GPU", "capability": "9.0", "triton": "3.6.0",
                                 "mamba_ssm": "2.3.2.post1", "date": "2026-11-27", "jobs": "j"}
    config = {"num_warps": 4, "num_stages": 3, "num_ctas": 1, "maxnreg": None}
    assert table["picks"] == [
        {"kernel": "_passing_kernel", "key": [8192, False, "torch.float32"],
         "config": {"kwargs": {"BLOCK_SIZE": 128}, **config},
         "mean_ms": {"picked": 0.1, "slowest": 0.5, "configs": 2, "failed": 0}},
        {"kernel": "_scan_kernel", "key": [128, True, "torch.bfloat16"],
         "config": {"kwargs": {"BLOCK_SIZE": 512}, **config},  # mean 0.21 beats 0.22
         "mean_ms": {"picked": 0.21, "slowest": 0.3, "configs": 4, "failed": 1}}]
    assert picks_script.write_table(cache, tmp_path / "from_dir.json", table["measured"]) == table
