#!/usr/bin/env bash
# The GPU figures owed first (issue 56; issue 46's items 1, 2, 3, 6, 7) in one device call, sized
# for a lend of 15 minutes of device time (the machine's start included) with room for a rerun:
#
#   device run, carry [".device"], timeout 540:
#     source .device/setup.sh; bash bench/gpu_figures.sh
#
# Each step writes its log under $OUT (the device tool brings it back) and has its own
# timeout, so a slow step costs only itself:
# 1. gpu_check's kernel rows (bench/kernel_check.py): every
#    kernel against its torch path on CUDA, our Triton conv and Mamba2's fused core's kernels
#    included; fla's gated backward on the torch path where triton < 3.7.1 refuses it.
# 2. bench/mamba_layer.py: the Mamba2 layer, Megatron's fused path against ours with each conv
#    (causal-conv1d, our Triton kernel, the torch path's cuDNN conv, the shifted-sum
#    formulation inductor fuses): the measurement that chooses the conv (item 2).
# 3. bench/gpu_profile.py, cold (no caches unpacked; the shipped autotune picks installed):
#    the first step's seconds (item 6), then the trainer rows of item 7 beside the twins.
set -u
OUT="${OUT:-outputs/gpu_figures}"
mkdir -p "$OUT"
echo "gpu_figures: $(date -u +%FT%TZ) $(python3 -c 'import torch; print(torch.cuda.get_device_name())')"

timeout 150 python3 -c "import sys; from bench.kernel_check import run_kernel_checks
sys.exit(0 if run_kernel_checks() else 1)" > "$OUT/kernel_check.log" 2>&1
echo "kernel rows: rc $? (OUT/kernel_check.log)"; grep -E "^  |kernels:" "$OUT/kernel_check.log" | tail -12

timeout 90 python3 bench/mamba_layer.py --repeats 10 > "$OUT/mamba_layer.log" 2>&1
echo "mamba_layer: rc $?"; tail -9 "$OUT/mamba_layer.log"

timeout 280 python3 bench/gpu_profile.py --deadline 230 --timeout 150 --out "$OUT/profile" \
    --jobs nemotron_h_1b nemotron_h_1b:transformer hybrid_moe_2b kda_hybrid_1b gdn_hybrid_1b \
    hybrid_moe_2b:transformer > "$OUT/gpu_profile.log" 2>&1
echo "gpu_profile: rc $?"; grep -E "^\| " "$OUT/gpu_profile.log" | head -12
