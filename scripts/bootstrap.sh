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
#   TITAN_HYBRID_VENV=PATH              this venv instead of the line's own: an existing venv of
#                                       the same torch line is brought to this torchtitan (pip
#                                       swaps torchtitan alone; torch is not downloaded again).
#                                       .ci/run runs the torchtitan 0.3 leg so, in the 2.14 venv.
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
if [ -n "${TITAN_HYBRID_VENV:-}" ]; then
    case "$TITAN_HYBRID_VENV" in /*) VENV="$TITAN_HYBRID_VENV" ;;
                                  *) VENV="$REPO_ROOT/$TITAN_HYBRID_VENV" ;; esac
fi
VENV_NAME="${VENV#"$REPO_ROOT"/}"  # for messages
PY="$VENV/bin/python"
CONSTRAINTS="$VENV/torch-constraints.txt"
STAMP="$VENV/.titan_hybrid_installed"

# A GPU host takes 2.13's CUDA build (by version range, so pip may pick the matching local build).
has_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then has_gpu=1; fi
torch_requirement="torch==$TORCH_VERSION"
if [ "$has_gpu" = 1 ] && [ "$TORCH_LINE" = 2.13 ]; then torch_requirement="torch==2.13.*"; fi
# A venv named by TITAN_HYBRID_VENV keeps its torch: installing another torch line into it would
# pull the torch from under whatever else runs from it (a test run of that venv, say).
if [ -n "${TITAN_HYBRID_VENV:-}" ] && [ -f "$STAMP" ]; then
    installed_torch="$(cut -d' ' -f1 "$STAMP")"
    if [ "$installed_torch" != "$torch_requirement" ]; then
        echo "error: TITAN_HYBRID_VENV=$TITAN_HYBRID_VENV holds $installed_torch, not" \
            "$torch_requirement (TITAN_HYBRID_TORCH=$TORCH_LINE): name a venv of that torch," \
            "or unset TITAN_HYBRID_VENV" >&2
        exit 2
    fi
fi
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

# uv installs where it can: a CUDA build (the 2.11, 2.14 and 2.15 lines; any line on a GPU
# host) is about 2.6 GB of wheels, which uv unpacks in ~45 s where pip takes ~200 s, and uv
# resolves and installs titan_hybrid's own requirements in ~7 s where pip takes ~75 s (a 2-core
# machine; CI makes five venvs a run). uv comes from the registry into the venv, with its cache
# inside the venv (removed after each install; the installed files are hard links); pip
# installs where uv cannot be had or fails. 2.13's CPU build is a local file that pip's
# configuration names (find-links), which uv does not read: pip installs it.
uv_install() {
    { [ -x "$VENV/bin/uv" ] || quiet_pip install --quiet uv; } || return 1
    local status=0
    env ${PIP_CERT:+SSL_CERT_FILE="$PIP_CERT"} UV_CACHE_DIR="$VENV/.uv-cache" \
        "$VENV/bin/uv" pip install --quiet --python "$PY" --constraint "$CONSTRAINTS" "$@" \
        || status=$?
    rm -rf "$VENV/.uv-cache"
    return $status
}

install_torch() {
    local wheels=("$torch_requirement" "triton==$TRITON_VERSION" "${EXTRA[@]}")
    if [ "$torch_requirement" != "torch==2.13.0" ] && uv_install "${wheels[@]}"; then return; fi
    quiet_pip install --quiet "${wheels[@]}"
}

# titan_hybrid (editable) with its test extras; torch and triton are already in place, and the
# constraints keep them.
install_project() {
    uv_install -e "$REPO_ROOT[test]" || quiet_pip install --quiet -e "$REPO_ROOT[test]"
}

# The venv is current when its stamp names what this host wants (the stamp is written last).
venv_current() { [ -x "$PY" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; }

install_venv() {
    echo "== bootstrap: installing $want into $VENV_NAME" >&2
    [ -x "$PY" ] || python3 -m venv "$VENV"
    rm -f "$STAMP"
    # The constraints (quiet_pip, uv_install) keep the editable install from swapping torch or triton for
    # whatever pyproject.toml's range would pick.
    printf '%s\n' "$torch_requirement" "triton==$TRITON_VERSION" \
        "torchtitan==$TORCHTITAN_VERSION" "${EXTRA[@]}" > "$CONSTRAINTS"
    install_torch
    install_project
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
}

# One install at a time. The nodes of a SLURM job, the tasks of a job array, or a test run beside
# a training run may all start this bootstrap at once in one shared checkout; without a lock
# each would pip-install into the same venv over the others. The lock is a directory made with
# mkdir: creating it is one atomic operation on the file server on NFS (v3 and v4), Lustre, GPFS
# and local disks alike. flock(2) is not relied on: across nodes it excludes only where the
# mount honours it (not NFS mounted `nolock` or `local_lock=flock`, not Lustre mounted
# `localflock`; Lustre `noflock` fails it outright), which a job cannot see.
# A mkdir lock outlives a holder killed by SIGKILL or a node that dies, so the holder writes
# who it is (host, pid namespace, pid) and renews a heartbeat every 5 s; a waiter takes the lock
# over when that pid is gone (holder on this host and in this pid namespace: containers with
# host networking share the host name, not the pids) or when the heartbeat has not changed for
# 60 s by the waiter's own clock (nodes' clocks are never compared). Any other exit of the
# holder (an error, Ctrl-C, SIGTERM) removes the lock through the EXIT trap. Two waiters
# breaking the same stale lock within microseconds could still both install: that needs a
# crash first, and ends as every start did without a lock.
LOCK="$VENV/.install-lock"
HOST_ID="$HOSTNAME $(readlink /proc/self/ns/pid 2>/dev/null || echo -)"
HEARTBEAT_S=5
STALE_S=60

pid_alive() { kill -0 "$1" 2>/dev/null || [ -d "/proc/$1" ]; }  # /proc: another user's pid

acquire_install_lock() {
    local seen="" seen_since=$SECONDS owner beat host pidns pid holder
    mkdir -p "$VENV"
    until mkdir "$LOCK" 2>/dev/null; do
        owner="$(cat "$LOCK/owner" 2>/dev/null || true)"
        beat="$(cat "$LOCK/beat" 2>/dev/null || true)"
        read -r host pidns pid <<< "$owner" || true
        holder="another process"
        if [ -n "$pid" ]; then holder="pid $pid on $host"; fi
        if [ -z "$seen" ]; then
            echo "== bootstrap: waiting for the install into $VENV_NAME by $holder" >&2
        fi
        if [ "$owner $beat" != "$seen" ]; then seen="$owner $beat" seen_since=$SECONDS; fi
        if { [ -n "$pid" ] && [ "$host $pidns" = "$HOST_ID" ] && ! pid_alive "$pid"; } \
            || [ $((SECONDS - seen_since)) -ge $STALE_S ]; then
            echo "== bootstrap: $holder is gone (no such process, or no heartbeat for" \
                "$STALE_S s): taking over its install lock" >&2
            # Only if it is still that holder's, and renamed away in one step (rm -rf is many):
            # another waiter that broke it first and made its own keeps that one.
            if [ "$(cat "$LOCK/owner" 2>/dev/null || true)" = "$owner" ] \
                && mv "$LOCK" "$LOCK.stale.$$" 2>/dev/null; then
                rm -rf "$LOCK.stale.$$"
            fi
            seen="" seen_since=$SECONDS
            continue
        fi
        sleep 1
    done
    trap release_install_lock EXIT
    echo "$HOST_ID $$" > "$LOCK/owner"
    # $$ is this shell, also in the subshell: the heartbeat stops when this shell dies.
    ( n=0; while kill -0 $$ 2>/dev/null && echo $((n += 1)) > "$LOCK/beat"; do
          sleep $HEARTBEAT_S
      done ) </dev/null >/dev/null 2>&1 &
    HEARTBEAT_PID=$!
}

release_install_lock() {
    kill "$HEARTBEAT_PID" 2>/dev/null && { wait "$HEARTBEAT_PID" 2>/dev/null || true; }
    rm -rf "$LOCK"
    trap - EXIT
}

if ! venv_current; then
    acquire_install_lock
    # Another process may have installed it while this one waited.
    if venv_current; then
        echo "== bootstrap: $VENV_NAME was installed meanwhile by another process;" \
            "not installing it again" >&2
    else
        install_venv
    fi
    release_install_lock
fi

# A GPU host runs mamba-ssm's, fla-core's and causal-conv1d's kernels when they are usable, but
# this bootstrap does not build them (CUDA builds against this torch, minutes each: README, "GPU
# path"), so say on every start when they are not installed. Only whether each is installed
# (find_spec does not import: importing them imports torch, seconds on every start); one that
# is installed but unusable is named by the run's start-up probe (titan_hybrid/ops/kernels.py).
if [ "$has_gpu" = 1 ]; then
    missing="$("$PY" -c 'import importlib.util
packages = {"mamba_ssm": "mamba-ssm", "fla": "fla-core", "causal_conv1d": "causal-conv1d"}
print(" / ".join(p for m, p in packages.items() if importlib.util.find_spec(m) is None))')"
    if [ -n "$missing" ]; then
        case "$missing" in *" / "*) verb=are ;; *) verb=is ;; esac
        echo "note: $missing $verb not installed in $VENV_NAME: the run takes the torch paths" \
            "(about 3x slower); install them (README, \"GPU path\") with: cd $REPO_ROOT &&" \
            "$VENV_NAME/bin/pip install wheel ninja && MAMBA_SKIP_CUDA_BUILD=TRUE" \
            "$VENV_NAME/bin/pip install --no-build-isolation -e \".[gpu]\"" \
            "\"$torch_requirement\"" >&2
    fi
fi
export PATH="$VENV/bin:$PATH"
