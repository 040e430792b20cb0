#!/usr/bin/env bash
# Train: ./run_train.sh --job.config_file train_configs/hybrid.toml [--section.key value ...]
# NGPU=N launches N processes with torchrun (gloo on CPU, nccl on GPU).
set -euo pipefail
cd "$(dirname "$0")"
source scripts/bootstrap.sh
NGPU=${NGPU:-1}
if [ "$NGPU" -gt 1 ]; then
    exec torchrun --standalone --nproc_per_node="$NGPU" --local-ranks-filter "${LOG_RANK:-0}" \
        --role rank --tee 3 -m titan_hybrid.train "$@"
fi
# A single process still goes through torchrun's environment contract (RANK, LOCAL_RANK, ...).
exec torchrun --standalone --nproc_per_node=1 -m titan_hybrid.train "$@"
