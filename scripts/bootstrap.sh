#!/usr/bin/env bash
# Create or reuse the venv for one supported torch / torchtitan pair, with titan_hybrid
# installed (editable). Sourced by run_train.sh and run_tests.sh; puts that venv's bin/ first on
# PATH.
#
#   TITAN_HYBRID_TORCH=2.13 (default)   .venv             torch 2.13.0, CPU build (a local file)
#   TITAN_HYBRID_TORCH=2.11             .venv-torch-2.11  torch 2.11.0 + triton 3.6.0
#   TITAN_HYBRID_TORCH=2.14             .venv-torch-2.14  torch 2.14.1 + triton 3.8.0
#   TITAN_HYBRID_TORCH=2.15             .venv-torch-2.15  torch 2.15.0 + triton 3.9.0
#
#   TITAN_HYBRID_TORCHTITAN=0.2 (default)   torchtitan 0.2.2, with any of those torch lines
#   TITAN_HYBRID_TORCHTITAN=0.3             torchtitan 0.3.0, with torch 2.14 or 2.15 (the
#                                           torch it was released with, and newer); the venv's
#                                           name ends in -torchtitan-0.3
#
# These are the versions CI runs (.ci/run), and the only ones titan_hybrid/compat accepts
# (CHECKED_TORCH). The registry serves 2.11, 2.14 and 2.15 as CUDA builds (about 2.6 GB with
# their libraries); they run on CPU too. On machines without CUDA, 2.13's CPU build is installed
# first so that nothing pulls a multi-GB CUDA build for the default venv.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_LINE="${TITAN_HYBRID_TORCH:-2.13}"
# EXTRA: what else a line pins. Triton 3.6's interpreter turns one-element arrays into ints,
# which numpy 2.4 refuses (the interpreter tests fail with "only 0-dimensional arrays can be
# converted to Python scalars"); numpy 2.3 only warns.
EXTRA=()
case "$TORCH_LINE" in
    2.11) TORCH_VERSION=2.11.0 TRITON_VERSION=3.6.0 EXTRA=("numpy<2.4") ;;
    2.13) TORCH_VERSION=2.13.0 TRITON_VERSION=3.7.1 ;;
    2.14) TORCH_VERSION=2.14.1 TRITON_VERSION=3.8.0 ;;
    2.15) TORCH_VERSION=2.15.0 TRITON_VERSION=3.9.0 ;;
    *) echo "error: TITAN_HYBRID_TORCH '$TORCH_LINE' is not one of 2.11 2.13 2.14 2.15" \
            "(the torch versions CI runs)" >&2
       exit 2 ;;
esac
TORCHTITAN_LINE="${TITAN_HYBRID_TORCHTITAN:-0.2}"
case "$TORCHTITAN_LINE" in
    0.2) TORCHTITAN_VERSION=0.2.2 ;;
    0.3) TORCHTITAN_VERSION=0.3.0
         case "$TORCH_LINE" in
             2.14|2.15) ;;
             *) echo "error: TITAN_HYBRID_TORCHTITAN=0.3 needs TITAN_HYBRID_TORCH 2.14 or 2.15" \
                     "(torchtitan 0.3 calls torch APIs that $TORCH_LINE lacks)" >&2
                exit 2 ;;
         esac ;;
    *) echo "error: TITAN_HYBRID_TORCHTITAN '$TORCHTITAN_LINE' is not one of 0.2 0.3" >&2
       exit 2 ;;
esac
VENV="$REPO_ROOT/.venv"
if [ "$TORCH_LINE" != 2.13 ]; then VENV="$REPO_ROOT/.venv-torch-$TORCH_LINE"; fi
if [ "$TORCHTITAN_LINE" != 0.2 ]; then VENV="$VENV-torchtitan-$TORCHTITAN_LINE"; fi
PY="$VENV/bin/python"
CONSTRAINTS="$VENV/torch-constraints.txt"
STAMP="$VENV/.titan_hybrid_installed"

# A GPU host takes 2.13's CUDA build (by version range, so pip may pick the matching local build).
has_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then has_gpu=1; fi
torch_requirement="torch==$TORCH_VERSION"
if [ "$has_gpu" = 1 ] && [ "$TORCH_LINE" = 2.13 ]; then torch_requirement="torch==2.13.*"; fi
sources="$(cat "$REPO_ROOT/pyproject.toml" "$REPO_ROOT/scripts/bootstrap.sh" \
    | sha256sum | cut -c1-16)"
want="$torch_requirement triton==$TRITON_VERSION torchtitan==$TORCHTITAN_VERSION ${EXTRA[*]}"
want="$want gpu=$has_gpu $sources"

# This machine's pip configuration may name local package folders that do not exist; pip warns
# about each one. Keep the rest of pip's output. PIP_CONSTRAINT replaces any constraints file
# that the machine's pip configuration names (some cap torch below the versions we test, and
# pip then refuses torch==2.15.0) with ours, which pins exactly this line's torch and triton.
quiet_pip() {
    PIP_CONSTRAINT="$CONSTRAINTS" "$PY" -m pip "$@" 2>&1 \
        | { grep -v "^WARNING: Location '.*' is ignored" || true; }
}

if [ ! -x "$PY" ] || [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
    echo "== bootstrap: installing $want into ${VENV#"$REPO_ROOT"/}" >&2
    [ -x "$PY" ] || python3 -m venv "$VENV"
    rm -f "$STAMP"
    # The constraints (quiet_pip) keep the editable install from swapping torch or triton for
    # whatever pyproject.toml's range would pick.
    printf '%s\n' "$torch_requirement" "triton==$TRITON_VERSION" \
        "torchtitan==$TORCHTITAN_VERSION" "${EXTRA[@]}" > "$CONSTRAINTS"
    quiet_pip install --quiet "$torch_requirement" "triton==$TRITON_VERSION" "${EXTRA[@]}"
    quiet_pip install --quiet -e "$REPO_ROOT[test]"
    if [ "$has_gpu" = 0 ]; then
        # The GPU kernels' Python + Triton sources, which the triton_interpreter tests run in
        # Triton's interpreter (tests/triton_kernels.py), at the versions they were checked on.
        # Outside site-packages (--target): transformers switches its own torch paths to these
        # packages whenever they import, so only those tests put them on sys.path.
        # --no-deps: their declared dependencies would pull other torch builds and GPU-only
        # packages (mamba-ssm: tilelang, quack-kernels; fla-core's cpu extra: torch); what they
        # import (einops, packaging) is already here. mamba-ssm is an sdist whose setup.py
        # imports torch (hence --no-build-isolation, and wheel for its bdist_wheel); the two
        # variables are its own: compile no CUDA extension, fetch no prebuilt wheel.
        # GPU hosts install the real kernels themselves: README, "GPU path".
        KERNELS="$VENV/triton-interpreter-kernels"
        quiet_pip install --quiet wheel
        rm -rf "$KERNELS"
        MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE quiet_pip install --quiet --no-deps \
            --no-build-isolation --target "$KERNELS" "mamba-ssm==2.3.2.post1" "fla-core==0.6.0"
    fi
    # Check that what ended up installed is what was asked for.
    "$PY" - "$TORCH_LINE" "$TRITON_VERSION" "$TORCHTITAN_VERSION" <<'EOF'
import sys
from importlib.metadata import version
torch_line, triton_version, torchtitan_version = sys.argv[1:]
got = version("torch"), version("triton"), version("torchtitan")
if (".".join(got[0].split(".")[:2]), got[1], got[2]) != (torch_line, triton_version,
                                                         torchtitan_version):
    sys.exit(f"error: torch {got[0]} / triton {got[1]} / torchtitan {got[2]} installed, "
             f"wanted torch {torch_line}.x / triton {triton_version} / "
             f"torchtitan {torchtitan_version}")
EOF
    echo "$want" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
