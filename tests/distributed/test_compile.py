"""`--compile.enable` in the trainer: the compiled loss curve against the eager one.

"aot_eager" (dynamo + AOTAutograd with eager kernels) must give the eager curve bit for bit
under every parallelism it composes with: the capture is what titan_hybrid's code controls.
"inductor" (the default backend, generated C++ kernels on CPU) reorders and fuses float32
arithmetic, so its curve is compared with a tolerance; its compile takes about a minute per
layer kind on this machine's two cores, which is why that case is in the slow suite.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch import BF16, SMALL_JOB, run_training, run_worker

AOT = ("--compile.enable", "--compile.backend", "aot_eager")


def compiled_and_eager(tmp_path, reference_run, *args, nproc=1, config="hybrid.toml",
                       compile_args=AOT):
    eager = reference_run(*args, nproc=nproc, config=config)
    compiled = run_training(tmp_path, *args, *compile_args, nproc=nproc, config=config).check()
    assert "Compiled each layer / bracket group" in compiled.output
    assert len(compiled.losses) == len(eager.losses) > 0
    return compiled.losses, eager.losses


# fp32 compile is also checked bitwise by the in-process unit test and the slow layouts here;
# bf16 (the split-precision units) is the richer case for CI's extended run.
@pytest.mark.parametrize("precision", [pytest.param("fp32", marks=pytest.mark.slow),
                                       pytest.param("bf16", marks=pytest.mark.extended)])
def test_compiled_fsdp_run_matches_eager_bitwise(tmp_path, reference_run, precision):
    # bf16: Mamba2 / GDN projections are FSDP units inside their layers, which then compile
    # in parts (parallel/compile.py).
    args = SMALL_JOB + (BF16 if precision == "bf16" else ())
    compiled, eager = compiled_and_eager(tmp_path, reference_run, *args, nproc=2)
    assert compiled == eager


@pytest.mark.extended
def test_compiled_packed_documents_match_eager_bitwise(tmp_path, reference_run):
    """`--hybrid.document_masking` with Mamba2, attention and gated DeltaNet layers (SMALL_JOB's
    pattern) compiles, each layer one graph, and gives the eager curve bit for bit. pydoc's
    documents are long, so these windows hold few starts; tests/unit/test_compile.py packs
    several documents per row."""
    args = SMALL_JOB + ("--hybrid.document_masking",)
    compiled, eager = compiled_and_eager(tmp_path, reference_run, *args)
    assert compiled == eager


LAYOUTS = {
    "activation checkpointing": (SMALL_JOB + ("--activation_checkpoint.mode", "full"), 1),
    "selective AC, FSDP2": (SMALL_JOB + ("--activation_checkpoint.mode", "selective"), 2),
    "TP2 + SP": (SMALL_JOB + ("--parallelism.tensor_parallel_degree", "2"), 2),
    "PP2": (SMALL_JOB + ("--parallelism.pipeline_parallel_degree", "2"), 2),
    "CP2": (SMALL_JOB + ("--parallelism.context_parallel_degree", "2"), 2),
    "CP2 chunkwise, documents": (SMALL_JOB + (
        "--parallelism.context_parallel_degree", "2", "--hybrid.document_masking",
        "--parallelism.context_parallel_linear_mode", "chunkwise"), 2),
    "groups, AC, FSDP2": (SMALL_JOB + ("--hybrid.pattern", "[M*][G-]",
                                   "--activation_checkpoint.mode", "full"), 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_compile_composes_with(tmp_path, reference_run, layout):
    args, nproc = LAYOUTS[layout]
    compiled, eager = compiled_and_eager(tmp_path, reference_run, *args, nproc=nproc)
    assert compiled == eager


MOE = ("--training.steps", "3", "--training.seq_len", "64", "--training.local_batch_size", "2")


@pytest.mark.extended
def test_bf16_moe_compiles_as_one_graph_per_layer_under_fsdp(tmp_path, reference_run):
    """bf16 FSDP2 without EP: each MoE layer is one graph, grouped GEMMs included (graphs
    counted in tests/unit/test_compile.py), inside the trainer with FSDP's hooks around it."""
    compiled, eager = compiled_and_eager(tmp_path, reference_run, *MOE, *BF16, nproc=2,
                                         config="hybrid_moe.toml")
    assert compiled == eager


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["EP2", "EP2 overlapped"])
def test_compile_composes_with_expert_parallel(tmp_path, reference_run, overlap):
    args = (*MOE, "--parallelism.expert_parallel_degree", "2")
    if overlap:
        args += ("--parallelism.expert_parallel_overlap", "--training.global_batch_size", "8")
    compiled, eager = compiled_and_eager(tmp_path, reference_run, *args, nproc=2,
                                         config="hybrid_moe.toml")
    # Seen 1e-7 apart from step 2: the router's outputs feed several branches (weights, aux
    # loss, statistics), whose gradients AOTAutograd's joint graph may sum in another order.
    assert compiled == pytest.approx(eager, rel=1e-6)


@pytest.mark.slow
def test_inductor_run_matches_eager(tmp_path, reference_run):
    compiled, eager = compiled_and_eager(tmp_path, reference_run, *SMALL_JOB,
                                         compile_args=("--compile.enable",))
    # Generated kernels sum in other orders (and fuse exp / softplus chains): float32 rounding,
    # which three optimizer steps carry into the weights.
    assert compiled == pytest.approx(eager, rel=2e-5)


def test_compiled_collectives_match_eager_bitwise():
    """The all-to-alls and the gather under `fullgraph` compile: outputs and gradients equal
    eager bit for bit. torch 2.11 lost the in-place c10d exchange in a compiled backward (zero
    gradients, so every compiled CP curve left the eager one after its first step)."""
    result = run_worker(Path(__file__).with_name("collectives_worker.py"))
    assert set(result) == {"all_to_all", "all_to_all_uneven", "all_gather"}
    for name, case in result.items():
        assert case["output_equal"] and case["grads_equal"], (name, case)
        assert case["grad_magnitude"] > 0, name
