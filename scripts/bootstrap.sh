#!/usr/bin/env bash
# Create or reuse .venv at the repository root with titan_hybrid installed (editable).
# On machines without CUDA, torch's CPU build is installed first so that nothing pulls a
# multi-GB CUDA build. Sourced by run_train.sh and run_tests.sh.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO_ROOT/.venv"
PY="$VENV/bin/python"
STAMP="$VENV/.titan_hybrid_installed"

if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
fi
# This machine's pip configuration may name local package folders that do not exist; pip warns
# about each one. Keep the rest of pip's output.
quiet_pip() { "$PY" -m pip "$@" 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }; }

if [ ! -f "$STAMP" ] || [ "$REPO_ROOT/pyproject.toml" -nt "$STAMP" ] \
        || [ "$REPO_ROOT/scripts/bootstrap.sh" -nt "$STAMP" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        quiet_pip install --quiet "torch==2.13.*" "triton==3.7.1"
        quiet_pip install --quiet -e "$REPO_ROOT[test]"
        # GPU hosts install the real kernels themselves: README, "GPU path".
    else
        quiet_pip install --quiet "torch==2.13.0" "triton==3.7.1"
        quiet_pip install --quiet -e "$REPO_ROOT[test]"
        # The GPU kernels' Python + Triton sources, which the triton_interpreter tests run in
        # Triton's interpreter (tests/triton_kernels.py), at the versions they were checked on.
        # Outside site-packages (--target): transformers switches its own torch paths to these
        # packages whenever they import, so only those tests put them on sys.path.
        # --no-deps: their declared dependencies would pull other torch builds and GPU-only
        # packages (mamba-ssm: tilelang, quack-kernels; fla-core's cpu extra: torch); what they
        # import (einops, packaging) is already here. mamba-ssm is an sdist whose setup.py
        # imports torch (hence --no-build-isolation, and wheel for its bdist_wheel); the two
        # variables are its own: compile no CUDA extension, fetch no prebuilt wheel.
        KERNELS="$VENV/triton-interpreter-kernels"
        quiet_pip install --quiet wheel
        rm -rf "$KERNELS"
        MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE quiet_pip install --quiet --no-deps \
            --no-build-isolation --target "$KERNELS" "mamba-ssm==2.3.2.post1" "fla-core==0.6.0"
    fi
    touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
