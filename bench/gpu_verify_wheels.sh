#!/usr/bin/env bash
# Prepare what bench/gpu_verify.py needs on a lent GPU machine that has torch, triton,
# transformers and einops but no package index: Python 3.12 wheels in .whl/ (git-ignored) and
# mamba_ssm's Python sources in .whl/mamba_ssm_src/. mamba_ssm ships as an sdist whose CUDA
# extensions take minutes to compile; gpu_verify.py needs only its Triton SSD kernel, which is
# plain Python (see load_mamba_ssm_ssd_kernel there). causal-conv1d is compiled-only: not fetched.
#
#   bash bench/gpu_verify_wheels.sh      # then carry ".whl" and run, on the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD:$PWD/.whl/mamba_ssm_src
#   python3 bench/gpu_verify.py --json $OUT/gpu_verify.json 2>&1 | tee $OUT/gpu_verify_output.txt
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl

# torchtitan and the packages its import pulls in that the GPU image lacks; fla 0.6.0 (split
# into fla-core + flash-linear-attention) needs triton >= 3.3 and transformers >= 5.6.2.
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl \
    torchtitan==0.2.2 datasets==5.2.0 tyro==1.0.17 torchdata==0.11.0 dill==0.4.1 \
    multiprocess==0.70.19 docstring_parser==0.18.0 typeguard==4.6.0 tomli==2.5.0 \
    fla-core==0.6.0 flash-linear-attention==0.6.0

# mamba_ssm's setup.py imports torch to compute its metadata, hence the project venv and
# --no-build-isolation; MAMBA_SKIP_CUDA_BUILD keeps it from compiling anything.
sdist_dir=$(mktemp -d)
trap 'rm -rf "$sdist_dir"' EXIT
MAMBA_SKIP_CUDA_BUILD=TRUE .venv/bin/python -m pip download --no-deps --no-build-isolation \
    mamba-ssm==2.3.2.post1 -d "$sdist_dir"
tar xzf "$sdist_dir"/mamba_ssm-*.tar.gz -C "$sdist_dir"
rm -rf .whl/mamba_ssm_src
mkdir -p .whl/mamba_ssm_src
cp -r "$sdist_dir"/mamba_ssm-*/mamba_ssm .whl/mamba_ssm_src/
du -sh .whl
