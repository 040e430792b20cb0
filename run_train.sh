#!/usr/bin/env bash
# Train: ./run_train.sh --job.config_file train_configs/hybrid.toml [--section.key value ...]
# NGPU=N launches N processes with torchrun (gloo on CPU, nccl on GPU); LOG_RANK=R[,R] picks
# the ranks whose output is shown (default 0). The job is checked before any worker starts.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/bootstrap.sh
exec python -m titan_hybrid.launch "$@"
