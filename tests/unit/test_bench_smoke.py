"""Smoke tests of the benchmarks.

bench/mixers_vs_transformers.py: its comparison runs at a small size and our ops agree with
transformers' torch paths (same inputs / weights), forward and gradients.
bench/gpu_check.py: the parts that run without a GPU (the no-CUDA exit, its trainer helpers on
a real torchtitan log, the same-dims transformer pattern, the table).
"""

import collections
import dataclasses
import re

import pytest
import torch

from bench import gpu_check
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.pattern import parse_hybrid_pattern


@pytest.mark.parametrize("op", [
    "ssd", "mixer", "gdn", pytest.param("kda", marks=pytest.mark.extended), "mla", "dsa", "v4",
    "short_conv", pytest.param("mamba1", marks=pytest.mark.extended)])
def test_compare_small(op):
    pytest.importorskip("transformers")
    from bench.mixers_vs_transformers import compare

    # T = 200 is not a multiple of either chunk size (128 / 64), so padding is exercised too
    result = compare(op, T=200, repeats=1, batch=1)
    assert result["err_out"] < 1e-4, result
    assert result["err_grad"] < 1e-4, result
    assert result["ours_tok_s"] > 0 and result["theirs_tok_s"] > 0


def test_the_mamba1_against_mamba2_row_times_two_layers_of_about_equal_size():
    from bench.mixers_vs_transformers import compare, make_case

    case = make_case("mamba1_vs_mamba2", T=64, batch=1)
    sizes = [sum(p.numel() for p in case[impl][1][1:]) for impl in ("ours", "theirs")]
    assert 0.85 < sizes[0] / sizes[1] < 1.0, sizes  # 1.69M against 1.85M
    result = compare("mamba1_vs_mamba2", T=64, repeats=1, batch=1)
    assert result["ours_tok_s"] > 0 and result["theirs_tok_s"] > 0


@pytest.mark.extended  # four trainer runs; the recipes' own tests run in the default suite
@pytest.mark.once_per_ci
def test_gpu_check_fp8_rows_run_the_float8_recipes(tmp_path, capsys):
    """--fp8 adds each FP8 flavor's rowwise and tensorwise rows (on CPU: the debug flavor,
    emulated) and their tokens/s ratio to the BF16 row; the runs log their float8 Linears."""
    assert gpu_check.main(["--cpu-smoke", "--fp8", "--skip-kernels", "--out",
                           str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for recipe in gpu_check.FP8_RECIPES:
        assert f"debug fp8 {recipe} / debug bf16: tokens/s x" in out
        log = (tmp_path / f"debug_fp8_{recipe}.log").read_text()
        assert (f"Float8 training: 17 modules compute in float8 (Linear {recipe}, emulated)"
                in log)
        assert "in high precision as the LM head: output" in log


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without CUDA")
def test_gpu_check_exits_cleanly_without_cuda(capsys):
    assert gpu_check.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


@pytest.mark.extended
def test_gpu_check_parses_the_trainers_log(tmp_path):
    """A real run (the debug job, 2 steps on CPU, ~10 s) through gpu_check's own helpers: the
    numbers parsed from each step line are the ones torchtitan printed."""
    command = gpu_check.trainer_command("debug", batch=1, seq_len=64, steps=2,
                                        dump_folder=tmp_path / "run")
    assert command[command.index("--job.config_file") + 1] == "train_configs/hybrid.toml"
    run = gpu_check.run_trainer(command, tmp_path / "debug.log", timeout_s=120)
    assert run["returncode"] == 0, (tmp_path / "debug.log").read_text()[-3000:]
    lines = [line for line in (tmp_path / "debug.log").read_text().splitlines() if "tps:" in line]
    assert len(lines) == 2 and [step["step"] for step in run["steps"]] == [1, 2]
    for line, parsed in zip(lines, run["steps"]):
        # read independently: the "name: number" pairs after the logger's prefix
        fields = {name: float(value.replace(",", "")) for name, value in
                  re.findall(r"(\w+): *([\d.,]+)", line.split(" - INFO - ")[1])}
        assert fields.keys() == {"step", "loss", "grad_norm", "memory", "tps", "tflops", "mfu"}
        assert (parsed["loss"], parsed["grad_norm"], parsed["memory_gib"], parsed["tps"],
                parsed["tflops"], parsed["mfu"]) == (fields["loss"], fields["grad_norm"],
                                                     fields["memory"], fields["tps"],
                                                     fields["tflops"], fields["mfu"])
    assert run["steps"][-1]["tps"] > 0 and 0 < run["first_step_s"] < run["wall_s"]
    assert gpu_check.parse_step_line("\x1b[31mstep:  7  loss:  1.00000  grad_norm:  0.5000  "
                                     "memory: 45.10GiB(56.94%)  tps: 26,012  tflops: 200.12  "
                                     "mfu: 20.23%\x1b[39m")["tps"] == 26012


@pytest.mark.parametrize("flavor", ["nemotron_h_1b", "hybrid_moe_2b", "dsa_hybrid_1b",
                                    "debug_grouped"])
def test_gpu_check_baseline_is_the_flavor_with_attention_mixers(flavor):
    pattern = hybrid_flavors[flavor].pattern
    baseline = gpu_check.transformer_pattern(pattern)
    ours, theirs = (parse_hybrid_pattern(text) for text in (pattern, baseline))
    assert theirs.num_physical_layers == ours.num_physical_layers
    assert theirs.mtp_depths == ours.mtp_depths
    symbols = ours.physical_layer_symbols(include_mtp=True)
    assert theirs.physical_layer_symbols(include_mtp=True) == [
        symbol if symbol in "-E" else "*" for symbol in symbols]
    if flavor == "nemotron_h_1b":
        assert baseline == "*-**-*-*-**-*-*-**-*-*-*-"  # 14 attention, 11 MLP layers


def test_gpu_check_table_without_a_gpu(tmp_path, monkeypatch, capsys):
    """main's flow with stand-in runs: every flavor, then the baseline with its pattern."""
    commands = []

    def fake_run(command, log_path, timeout_s):
        commands.append(command)
        tps = 100.0 if "--hybrid.pattern" in command else 80.0
        step = dict(step=2, loss=7.0, grad_norm=1.0, memory_gib=1.5, memory_pct=2.0, tps=tps,
                    tflops=tps / 10, mfu=5.0)
        return dict(returncode=0, first_step_s=9.0, steps=[step], wall_s=10.0, log=str(log_path))

    monkeypatch.setattr(gpu_check, "run_trainer", fake_run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--cpu-smoke", "--flavors", "debug", "debug_moe", "--no-compile",
                           "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "kernels: skipped: no CUDA device" in out
    assert [command[command.index("--model.flavor") + 1] for command in commands] == [
        "debug", "debug_moe", "debug"]
    assert commands[-1][commands[-1].index("--hybrid.pattern") + 1] == "*-*-*-*-"
    assert all("--compile.no-enable" in command for command in commands)
    assert re.search(r"transformer \(debug dims\) +100 +10\.0 +5\.0% +1\.5 +9", out), out
    assert "debug / transformer: tokens/s x0.80, TFLOP/s x0.80" in out
    assert (tmp_path / "summary.json").exists()

    monkeypatch.setattr(gpu_check, "run_trainer", lambda *args: dict(
        returncode=1, first_step_s=None, steps=[], wall_s=1.0, log="x.log"))
    assert gpu_check.main(["--cpu-smoke", "--flavors", "debug", "--out", str(tmp_path)]) == 1
    assert "FAILED (exit 1), see x.log" in capsys.readouterr().out


def test_train_step_bench_matches_sizes_and_counts_flops():
    import math

    from bench.train_step import compare

    result = compare("debug", batch=1, seq_len=64, repeats=1)
    hybrid, llama = result["rows"]
    # The baseline is sized to the hybrid: non-embedding parameters within 10%.
    assert abs(llama["non_embedding_params"] / hybrid["non_embedding_params"] - 1) < 0.10
    for row in (hybrid, llama):
        # Both are freshly initialised language models: first loss near uniform over 2048 tokens.
        assert abs(row["first_loss"] - math.log(2048)) < 0.5, row
        # 6 x non-embedding parameters plus the cores, so a little above 6N.
        assert 6 * row["non_embedding_params"] < row["flops_per_token"], row
        assert row["flops_per_token"] < 7 * row["non_embedding_params"], row
        assert 0 < row["mfu"] < 1.5 and row["tokens_per_s"] > 0


def test_dsa_vs_mla_bench_runs_small():
    from bench.dsa_vs_mla import compare

    result = compare(64, 0.01, batch=1, repeats=1, device="cpu")
    assert result["mla_ms"] > 0 and result["dsa_ms"] > 0 and result["ratio"] > 0


H100_SHARED_MEMORY = 232448  # bytes per block: Triton's "Hardware limit" on an H100


def _matmul_tile_bytes(config) -> int | None:
    """A lower bound of the shared memory a pipelined tl.dot kernel's config takes: its A and B
    tiles in float32, once per stage (296,448 bytes measured on an H100 for mamba_ssm's first
    SSD chunk-scan config, 128 x 256 x 64 in 3 stages; this gives 294,912)."""
    blocks = config.kwargs
    m, n = blocks.get("BLOCK_SIZE_M"), blocks.get("BLOCK_SIZE_N")
    k = blocks.get("BLOCK_SIZE_K", blocks.get("BLOCK_SIZE_CS"))
    if None in (m, n, k):
        return None
    return config.num_stages * (m * k + k * n) * 4


@pytest.mark.triton_interpreter
def test_kernel_check_runs_the_ssd_scan_on_configs_an_h100_can_hold(monkeypatch):
    """gpu_check's kernel check ran each autotuner's first config, and mamba_ssm's first SSD
    configs do not fit an H100's shared memory (OutOfResources there). It now runs the
    smallest-tiled one: every pick fits, where the first configs did not, and the scan agrees
    with the torch path (here in Triton's interpreter)."""
    from bench import kernel_check
    from tests.triton_kernels import kernels_on

    picks = []
    choose = kernel_check.smallest_tile
    monkeypatch.setattr(kernel_check, "smallest_tile",
                        lambda configs: picks.append((configs, choose(configs))) or picks[-1][1])
    monkeypatch.setattr(kernel_check, "DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
    with kernels_on(), kernel_check.one_config_only():
        error = kernel_check.check(kernel_check.CASES[0], torch.float32)
    assert error < kernel_check.CASES[0].tol[torch.float32]
    matmul_picks = [(configs, picked) for configs, picked in picks
                    if _matmul_tile_bytes(configs[0]) is not None]
    assert len(matmul_picks) >= 5, picks  # the SSD scan's chunk and state matmul kernels
    assert any(_matmul_tile_bytes(configs[0]) > H100_SHARED_MEMORY
               for configs, _ in matmul_picks)
    for configs, (picked,) in matmul_picks:
        assert picked in configs
        assert _matmul_tile_bytes(picked) <= H100_SHARED_MEMORY, picked
        assert _matmul_tile_bytes(picked) == min(_matmul_tile_bytes(c) for c in configs)


def test_gpu_profile_times_every_layer_forward_and_backward_also_under_checkpointing():
    """bench/gpu_profile.py's layer timer on a real model: every top-level layer and MTP depth
    gets a forward and a backward interval (a checkpointed layer's too: its backward hooks sit
    on the wrapper's output and input), labelled by its kind; per-kind counts are the
    pattern's."""
    from torch.utils.checkpoint import checkpoint

    from bench.gpu_profile import LayerTimer, kernel_group
    from titan_hybrid.model.model import HybridModel

    args = dataclasses.replace(hybrid_flavors["debug_moe"], dim=64, vocab_size=256)
    torch.manual_seed(0)
    model = HybridModel(args)
    model.init_weights()
    # full AC as the trainer wraps layers: a module whose forward recomputes in the backward
    first = model.layers["0"]

    class Checkpointed(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self._checkpoint_wrapped_module = inner

        def forward(self, *inputs):
            return checkpoint(self._checkpoint_wrapped_module, *inputs, use_reentrant=False)

    model.layers.register_module("0", Checkpointed(first))
    timer = LayerTimer(model)
    parsed = parse_hybrid_pattern(args.pattern)
    assert timer.labels == [*parsed.main, "mtp depth"]
    tokens = torch.randint(0, 256, (1, 32))
    for active in (False, True, True):
        timer.active = active
        if active:
            timer.new_step()
        logits, aux_loss, mtp_logits = model(tokens)
        (logits.sum() + aux_loss + mtp_logits.sum()).backward()
    assert len(timer.steps) == 2
    for marks in timer.steps[-1]:
        assert set(marks) == {"fwd_start", "fwd_end", "bwd_start", "bwd_end"}
    table = timer.per_kind_ms()
    counts = collections.Counter(timer.labels)
    assert {label: round(entry["count"]) for label, entry in table.items()} == counts
    assert all(entry["fwd"] > 0 and entry["bwd"] > 0 for entry in table.values()), table
    assert kernel_group("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT").startswith("GEMM")
    assert kernel_group("_chunk_scan_fwd_kernel").startswith("mamba_ssm")
    assert kernel_group("triton_poi_fused_silu_0").startswith("inductor")


def test_gpu_profile_job_variants_become_trainer_options(tmp_path):
    import argparse

    from bench.gpu_profile import job_command

    args = argparse.Namespace(batch=2, seq_len=4096, steps=12, trace=False, jobs=[])
    command, flavor = job_command("nemotron_h_1b:ac_op+b4", args, tmp_path)
    assert flavor == "nemotron_h_1b"
    joined = " ".join(command)
    assert "--training.local_batch_size 4 " in joined
    assert "--activation_checkpoint.selective_ac_option op" in joined
    command, _ = job_command("hybrid_moe_2b:ac_kinds", args, tmp_path)
    assert command[command.index("--activation_checkpoint.layer_kinds") + 1] == "*-E"
    command, _ = job_command("nemotron_h_1b:transformer", args, tmp_path)
    assert command[command.index("--hybrid.pattern") + 1] == "*-**-*-*-**-*-*-**-*-*-*-"
    with pytest.raises(SystemExit, match="variant 'ac_half'"):
        job_command("nemotron_h_1b:ac_half", args, tmp_path)


@pytest.mark.extended
def test_mamba_layer_bench_runs_ours_small():
    """bench/mamba_layer.py small: ours always; the fused baseline where CUDA and causal-conv1d
    are there (then first, ours agreeing with it), else the report says why it did not run."""
    from bench.mamba_layer import compare, report

    result = compare("nemotron_h_1b", batch=1, seq_len=128, repeats=1, dim=512, compiled=False)
    rows, skipped = result["rows"], result["baseline_skipped"]
    assert rows["ours (eager)"]["ms"] > 0
    if skipped is None:
        assert list(rows)[0].startswith("mamba_ssm fused")
        assert rows["ours (eager)"]["err_out"] < 5e-2 and rows["ours (eager)"]["err_grad"] < 5e-2
    else:
        if not torch.cuda.is_available():
            assert skipped == "no CUDA device"
        assert list(rows) == ["ours (eager)"]
        assert f"baseline skipped: {skipped}" in report(result, "nemotron_h_1b", 1, 128, 1)


# Compiled, the bench's inductor runs take ~45 s: once a CI run, as the FP8 rows above (the
# Triton conv's custom ops under compile are tests/unit/test_conv_triton.py's, on every torch).
@pytest.mark.parametrize("compiled", [
    pytest.param(False, marks=pytest.mark.extended),
    pytest.param(True, marks=[pytest.mark.extended, pytest.mark.once_per_ci])])
def test_conv_kernels_bench_counts_each_path(compiled):
    """bench/conv_kernels.py small: our Triton conv is two launches (forward, backward) and no
    ATen convolution work; the torch path's documents cost many ATen calls in eager; compiled,
    inductor's kernels are counted."""
    from bench.conv_kernels import measure

    rows = {row["path"]: row for row in measure("debug", 1, 40, compiled_rows=compiled)}
    torch_eager, ours_eager = rows["torch path, eager"], rows["our Triton conv, eager"]
    assert ours_eager["conv"]["triton"] == 2 and torch_eager["conv"]["triton"] == 0
    assert torch_eager["conv"]["aten"] >= 20 > ours_eager["conv"]["aten"]
    for part in ("conv", "layer"):
        assert ours_eager[part]["total"] < torch_eager[part]["total"]
    if compiled:
        for path in ("torch path, compiled", "our Triton conv, compiled"):
            assert rows[path]["layer"]["inductor"] > 0, rows[path]
        assert rows["our Triton conv, compiled"]["conv"]["triton"] == 2


def test_hyper_connections_bench_times_both_models_small():
    """bench/hyper_connections.py small: both models step, the streams add parameters and
    FLOPs, and the ratio is the two medians'."""
    from bench.hyper_connections import compare

    result = compare("debug", streams=2, batch=1, seq_len=32, steps=1, warmup=0)
    assert result["added_params"] > 0
    assert result["flops_per_token"][2] > result["flops_per_token"][0]
    assert result["ratio"] == result["step_s"][2] / result["step_s"][0] > 0


def test_gdp_vs_gdn_bench_times_both_mixers_small():
    """bench/gdp_vs_gdn.py small: GDN and GDP layers step, and every round times both."""
    from bench.gdp_vs_gdn import timings

    times = timings(["gdn", "gdp2"], T=32, repeats=2)
    assert [len(t) for t in times.values()] == [2, 2] and min(min(t) for t in times.values()) > 0


def test_ac_policies_bench_times_each_policy_small():
    """bench/ac_policies.py small: every policy steps on one model in turn (the wrappers put on
    and taken off)."""
    from bench.ac_policies import POLICIES, build, set_policy, timings

    model = build("debug", vocab=128, seq_len=64)
    times = timings(model, batch=1, seq_len=64, repeats=1)
    assert list(times) == list(POLICIES) and min(min(t) for t in times.values()) > 0
    assert not any(hasattr(layer, "_checkpoint_wrapped_module") for layer in model.layers.values())
    set_policy(model, "full, layer_kinds *-")
    assert [name for name, layer in model.layers.items()
            if hasattr(layer, "_checkpoint_wrapped_module")] == ["1", "2", "3", "5", "7"]


@pytest.mark.extended  # two fresh processes
@pytest.mark.once_per_ci
def test_ac_policies_bench_memory_probe_sees_full_checkpointing_lower_the_peak():
    """The probe the bench runs in a fresh process per policy: full AC's peak is below no
    checkpointing's (in a process that has run other tests, freed heap memory would hide a
    step's growth)."""
    from bench.ac_policies import __file__ as bench
    from bench.peak_rss import in_fresh_process

    def peak(policy: str) -> int:
        return in_fresh_process(bench, ["--probe", policy, "--flavor", "debug", "--vocab", "128",
                                        "--seq-len", "256", "--threads", "1"])["bytes"]

    assert 0 < peak("full") < peak("none") / 2


def test_parallel_group_bench_runs_both_forms_on_the_same_mixers():
    """bench/parallel_group.py: the group and the sequence hold the same mixer weights, and
    the comparison runs."""
    from bench import parallel_group

    parallel = parallel_group.make_case("parallel", 64)
    sequence = parallel_group.make_case("sequence", 64)
    parallel_weights = [p for p in parallel[1][1:] if p.dim() > 1]
    sequence_weights = [p for p in sequence[1][1:] if p.dim() > 1]
    assert all(torch.equal(a, b) for a, b in zip(parallel_weights, sequence_weights, strict=True))
    result = parallel_group.compare(64, repeats=1)
    assert result["parallel_tok_s"] > 0 and result["sequence_tok_s"] > 0 and result["paired"] > 0
