#!/usr/bin/env bash
# Run the unit tests against torch 2.14 in a scratch venv, leaving the repository's .venv
# (torch 2.13) alone.
#
#   scripts/test_torch_2_14.sh [pytest args]        e.g.  -x -k gated_delta
#
# The venv lives outside the repository, at $TITAN_HYBRID_SCRATCH/venv-torch-2.14
# (default ~/.cache/titan_hybrid/venv-torch-2.14), and is reused while the requested versions and
# pyproject.toml are unchanged. Other settings (environment):
#   TORCH_VERSION=2.14.1  TRITON_VERSION=3.8.0   what to install
#   PYTHON=python3                                  interpreter the venv is made from
#   TITAN_HYBRID_REINSTALL=1                        reinstall even if the venv looks current
#   TITAN_HYBRID_ALLOW_DOWNLOAD=1                   allow torch/triton to come from the network
#                                                   (by default they must be local files: the torch
#                                                   2.14 wheel is a ~5 GB CUDA build with its libs)
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SCRATCH="${TITAN_HYBRID_SCRATCH:-$HOME/.cache/titan_hybrid}"
TORCH_VERSION="${TORCH_VERSION:-2.14.1}"
TRITON_VERSION="${TRITON_VERSION:-3.8.0}"
VENV="$SCRATCH/venv-torch-${TORCH_VERSION%.*}"
PY="$VENV/bin/python"
STAMP="$VENV/.titan_hybrid_installed"

case "$VENV/" in
    "$REPO_ROOT"/*) echo "error: scratch venv $VENV is inside the repository" >&2; exit 2 ;;
esac

# This machine's pip configuration may name local package folders that do not exist; pip warns
# about each one. Keep the rest of pip's output.
quiet_pip() { "$PY" -m pip "$@" 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }; }

want="torch==$TORCH_VERSION triton==$TRITON_VERSION repo=$REPO_ROOT pyproject=$(sha256sum "$REPO_ROOT/pyproject.toml" | cut -c1-16)"
if [ "${TITAN_HYBRID_REINSTALL:-0}" = 1 ] || [ ! -x "$PY" ] || [ ! -f "$STAMP" ] \
        || [ "$(cat "$STAMP")" != "$want" ]; then
    echo "== installing into $VENV ($want)"
    t0=$SECONDS
    mkdir -p "$SCRATCH"
    [ -x "$PY" ] || "${PYTHON:-python3}" -m venv "$VENV"
    rm -f "$STAMP"
    CONSTRAINTS="$VENV/torch-constraints.txt"
    printf 'torch==%s\ntriton==%s\n' "$TORCH_VERSION" "$TRITON_VERSION" > "$CONSTRAINTS"

    # Dry run first: refuse to fetch torch or triton from the network unless allowed.
    report="$VENV/pip-dry-run.json"
    "$PY" -m pip install --quiet --dry-run --report "$report" \
        "torch==$TORCH_VERSION" "triton==$TRITON_VERSION" 2>&1 \
        | { grep -v "^WARNING: Location '.*' is ignored" || true; }
    "$PY" - "$report" "${TITAN_HYBRID_ALLOW_DOWNLOAD:-0}" <<'EOF'
import json, sys
report, allow = json.load(open(sys.argv[1])), sys.argv[2] == "1"
bad = []
for item in report["install"]:
    name, url = item["metadata"]["name"].lower(), item["download_info"]["url"]
    if name in ("torch", "triton"):
        print(f"   {name} {item['metadata']['version']} <- {url}")
        if not url.startswith("file:"):
            bad.append(name)
if bad and not allow:
    sys.exit(f"error: {', '.join(bad)} would be downloaded, not taken from a local file; "
             "set TITAN_HYBRID_ALLOW_DOWNLOAD=1 to allow it")
EOF
    quiet_pip install --quiet "torch==$TORCH_VERSION" "triton==$TRITON_VERSION"
    # The repository, editable, with its test extra. The constraints keep pip from swapping torch
    # or triton for the versions pyproject.toml would otherwise pick; if pyproject.toml excludes
    # this torch, pip stops with a conflict here instead.
    if ! quiet_pip install --quiet -c "$CONSTRAINTS" -e "$REPO_ROOT[test]"; then
        echo "error: installing the repository next to torch $TORCH_VERSION failed" \
             "(does pyproject.toml's torch requirement allow it?)" >&2
        exit 1
    fi
    # Check what ended up installed.
    "$PY" - "$TORCH_VERSION" "$TRITON_VERSION" <<'EOF'
import sys
from importlib.metadata import version, PackageNotFoundError
want = {"torch": sys.argv[1], "triton": sys.argv[2]}
for name in ("torch", "triton", "titan_hybrid", "torchtitan", "pytest", "transformers"):
    try:
        got = version(name)
    except PackageNotFoundError:
        sys.exit(f"error: {name} is not installed (pip install -e .[test] failed?)")
    if name in want and got.split("+")[0] != want[name]:
        sys.exit(f"error: {name} {got} installed, wanted {want[name]}")
EOF
    echo "$want" > "$STAMP"
    echo "== install took $((SECONDS - t0)) s; venv size $(du -sh "$VENV" | cut -f1)"
else
    echo "== reusing $VENV (venv size $(du -sh "$VENV" | cut -f1))"
fi

"$PY" - <<'EOF'
import sys
from importlib.metadata import version
import torch
print(f"python {sys.version.split()[0]}  torch {torch.__version__}  triton {version('triton')}  "
      f"torchtitan {version('torchtitan')}  cuda build {torch.version.cuda}  "
      f"cuda available {torch.cuda.is_available()}")
EOF

cd "$REPO_ROOT"
export PATH="$VENV/bin:$PATH"
exec "$PY" -m pytest -q tests/unit "$@"
