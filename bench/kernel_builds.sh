#!/usr/bin/env bash
# Do causal-conv1d's and mamba-ssm's CUDA extensions build against each torch titan_hybrid
# supports? A compile-only build (no GPU needed, nvcc needed) of each sdist against the CUDA
# build of each torch, for sm_90 only, with the log of each kept:
#
#   bench/kernel_builds.sh [OUT]      (OUT: bench/kernel_builds by default)
#
# Each torch gets a venv under $WORK (/tmp/kernel_builds), made with uv as scripts/bootstrap.sh
# does. 2.13 is missing: the registry serves its CPU build only. The packages' setup.py files
# list their own -gencode flags (nine architectures under CUDA 13; TORCH_CUDA_ARCH_LIST is not
# read), so the copy built here keeps sm_90 alone: the same sources and compiler flags, for one
# architecture (causal-conv1d took 574-678 s so on 2 cores). A log keeps the build's commands,
# warnings and errors (of a failed build, the first 200 lines and the last 40); ptxas's
# per-kernel lines (-Xptxas -v) are left out. OUT/summary.txt has one line per build: package,
# torch, exit status, seconds.
set -uo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$REPO_ROOT/bench/kernel_builds}"
WORK="${WORK:-/tmp/kernel_builds}"
TORCHES=(2.11.0 2.14.1 2.15.0)
SDISTS=("causal-conv1d==1.7.0" "mamba-ssm==2.3.2.post1")
mkdir -p "$OUT" "$WORK/sdists"
uv="$REPO_ROOT/.venv/bin/uv"  # scripts/bootstrap.sh puts uv there

venv_for() {  # venv_for TORCH: a venv with that torch's CUDA build and the build tools
    local venv="$WORK/torch-$1"
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv"
        env ${PIP_CERT:+SSL_CERT_FILE="$PIP_CERT"} UV_CACHE_DIR="$WORK/uv-cache" "$uv" pip install \
            --quiet --python "$venv/bin/python" "torch==$1" numpy setuptools wheel ninja packaging
    fi
    echo "$venv"
}

sdist_dir() {  # sdist_dir REQUIREMENT: the unpacked sdist (downloaded once)
    local name="${1%%==*}" version="${1##*==}"
    local folder="$WORK/sdists/${name//-/_}-$version"
    if [ ! -d "$folder" ]; then
        # pip runs the setup.py to read its metadata: skip the CUDA build there
        (cd "$WORK/sdists" && MAMBA_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE \
            "$(venv_for "${TORCHES[0]}")/bin/pip" download --quiet --no-deps --no-binary :all: \
            --no-build-isolation "$1" && tar xzf "${name//-/_}-$version.tar.gz")
    fi
    echo "$folder"
}

build() {  # build REQUIREMENT TORCH: one build, its log in OUT
    local venv source work log started status
    venv="$(venv_for "$2")" source="$(sdist_dir "$1")"
    work="$WORK/build-$(basename "$source")-torch-$2"
    log="$OUT/$(basename "$source")-torch-$2.log"
    rm -rf "$work" && cp -r "$source" "$work"
    "$venv/bin/python" - "$work/setup.py" <<'PY'
import sys
path = sys.argv[1]
source = open(path).read()
anchor = "    if FORCE_CXX11_ABI:"
assert source.count(anchor) == 1, "the setup.py changed: find where its cc_flag list ends"
keep_sm90 = ('    cc_flag = [f for f in cc_flag if f != "-gencode" and not f.startswith("arch=")]\n'
             '    cc_flag += ["-gencode", "arch=compute_90,code=sm_90"]  # compile-only: sm_90\n')
open(path, "w").write(source.replace(anchor, keep_sm90 + anchor))
PY
    started=$SECONDS
    {
        echo "# $1 against torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
        echo "# $(nvcc --version | grep release); $(g++ --version | head -1)"
        (cd "$work" && env CAUSAL_CONV1D_FORCE_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE MAX_JOBS=2 \
            TORCH_CUDA_ARCH_LIST=9.0 "$venv/bin/pip" wheel --no-build-isolation --no-deps -v \
            -w "$work/dist" . 2>&1)
        status=$?
        echo "# exit status $status after $((SECONDS - started)) s"
    } | grep -v -E "ptxas info|bytes stack frame|^\s*$" > "$log.full"
    status=$(tail -1 "$log.full" | awk '{print $4}')
    if [ "$status" = 0 ] || [ "$(wc -l < "$log.full")" -le 260 ]; then
        mv "$log.full" "$log"
    else  # a failed build repeats its errors in every file: the first ones and the end
        { head -200 "$log.full"; echo "[... $(($(wc -l < "$log.full") - 240)) lines ...]"
          tail -40 "$log.full"; } > "$log" && rm "$log.full"
    fi
    printf '%-24s torch %-7s exit %-3s %5d s\n' "${1%%==*}" "$2" "$status" \
        $((SECONDS - started)) | tee -a "$OUT/summary.txt"
}

: > "$OUT/summary.txt"
for torch in "${TORCHES[@]}"; do
    for sdist in "${SDISTS[@]}"; do build "$sdist" "$torch"; done
done
