#!/usr/bin/env bash
# The shipped CPU jobs' exact loss curves at a git revision, for a before / after comparison of
# a change that must not change behaviour (issue 48 item 6):
#
#   scripts/curves_at_revision.sh REV OUT [RESUME_FROM]
#
# REV is checked out in a temporary worktree and run with this checkout's venv (its titan_hybrid
# first on PYTHONPATH). OUT/<job>.jsonl gets each job's per-step losses (hybrid.loss_curve_file),
# and OUT/checkpoint the hybrid job's checkpoints (steps 10 and 20). With RESUME_FROM (an OUT of
# an earlier call), the hybrid job also resumes from that run's step-10 checkpoint to step 20
# (OUT/hybrid_resumed.jsonl): a checkpoint written by one revision, read by another. Compare the
# files with `cmp` or diff: the losses are printed with every digit.
set -euo pipefail
REV=$1 OUT=$(realpath -m "$2") RESUME_FROM=${3:+$(realpath "$3")}
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO/scripts/bootstrap.sh"
TREE=$(mktemp -d)
trap 'git -C "$REPO" worktree remove --force "$TREE"' EXIT
git -C "$REPO" worktree add --detach "$TREE" "$REV" >/dev/null
mkdir -p "$OUT"
cd "$TREE"
run() {  # run JOB NAME [flags]: one job, one curve file
    local job=$1 name=$2
    shift 2
    rm -f "$OUT/$name.jsonl"
    PYTHONPATH="$TREE" python -m titan_hybrid.launch --nproc "${NPROC:-1}" --job.config_file "train_configs/$job.toml" \
        --job.dump_folder "$OUT" --hybrid.loss_curve_file "$OUT/$name.jsonl" "$@" \
        > "$OUT/$name.log" 2>&1 || { tail -20 "$OUT/$name.log"; exit 1; }
    echo "$name: $(wc -l < "$OUT/$name.jsonl") steps"
}
run hybrid hybrid --checkpoint.enable --checkpoint.interval 10 --checkpoint.folder checkpoint
run hybrid_moe hybrid_moe
NPROC=2 run hybrid hybrid_fsdp2
if [ -n "$RESUME_FROM" ]; then
    rm -rf "$OUT/resumed" && mkdir -p "$OUT/resumed"
    cp -r "$RESUME_FROM/checkpoint/step-10" "$OUT/resumed/"
    run hybrid hybrid_resumed --checkpoint.enable --checkpoint.interval 10 \
        --checkpoint.folder resumed
fi
