"""The autotune picks table (titan_hybrid/assets/autotune_picks/smXY.json) from a Triton cache:

    python bench/autotune_picks.py CACHE --out titan_hybrid/assets/autotune_picks/sm90.json \\
        --device "NVIDIA H200" --capability 9.0 --triton 3.6.0 --mamba-ssm 2.3.2.post1 \\
        --date 2026-11-27 --jobs "nemotron_h_1b, hybrid_moe_2b (bf16, batch 2 x 4096)"

CACHE is a Triton cache folder (TRITON_CACHE_DIR) or a .tar.gz of one (bench/gpu_profile.py's
compile_caches.tar.gz). With TRITON_CACHE_AUTOTUNING=1 Triton writes a KERNEL.autotune.json
there per kernel and tuning key: the key, and each config with its timings (triton's do_bench:
the median, 20th and 80th percentile ms). Each becomes one pick: the config of the lowest mean
timing, leaving out configs that failed (inf). Kernels whose configs carry a pre_hook are not
written by Triton, so they have no pick (they still autotune at run time).
titan_hybrid.ops.autotune_picks installs the table at start-up.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tarfile
from pathlib import Path

SUFFIX = ".autotune.json"
# What the table records of where it was measured (the picks hold for that GPU architecture).
MEASURED = ("device", "capability", "triton", "mamba_ssm", "date", "jobs")


def autotune_records(source: Path) -> list[dict]:
    """{"kernel", "key", "configs_timings"} of every KERNEL.autotune.json in a folder or .tar.gz."""
    if source.is_dir():
        files = [(path.name, path.read_text()) for path in sorted(source.rglob(f"*{SUFFIX}"))]
    else:
        with tarfile.open(source) as tar:
            files = [(Path(member.name).name, tar.extractfile(member).read().decode())
                     for member in tar.getmembers() if member.name.endswith(SUFFIX)]
    return [{"kernel": name.removesuffix(SUFFIX), **json.loads(text)} for name, text in files]


def _key_value(value):
    # Newer Triton releases write every key entry as str(): "128", "True", "torch.float32".
    if isinstance(value, str) and re.fullmatch(r"-?\d+", value):
        return int(value)
    return {"True": True, "False": False}.get(value, value) if isinstance(value, str) else value


def pick(record: dict) -> dict:
    """The fastest config of one record, with a summary of the timings it was chosen from."""
    means = [(sum(timings) / len(timings), config)
             for config, timings in record["configs_timings"]]
    finite = [(mean, config) for mean, config in means if math.isfinite(mean)]
    if not finite:
        raise ValueError(f"{record['kernel']} {record['key']}: every config failed")
    best_ms, best = min(finite, key=lambda pair: pair[0])
    return {"kernel": record["kernel"], "key": [_key_value(v) for v in record["key"]],
            "config": {field: best.get(field) for field in
                       ("kwargs", "num_warps", "num_stages", "num_ctas", "maxnreg")},
            "mean_ms": {"picked": round(best_ms, 5),
                        "slowest": round(max(mean for mean, _ in finite), 5),
                        "configs": len(means), "failed": len(means) - len(finite)}}


def picks_table(records: list[dict], measured: dict) -> dict:
    picks = sorted((pick(record) for record in records),
                   key=lambda entry: (entry["kernel"], json.dumps(entry["key"])))
    return {"measured": measured, "picks": picks}


def write_table(source: Path, out: Path, measured: dict) -> dict:
    table = picks_table(autotune_records(source), measured)
    out.parent.mkdir(parents=True, exist_ok=True)
    picks = ",\n  ".join(json.dumps(entry) for entry in table["picks"])  # one line each
    out.write_text(f'{{"measured": {json.dumps(measured)},\n "picks": [\n  {picks}\n ]}}\n')
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a Triton cache folder or a .tar.gz of one")
    parser.add_argument("--out", type=Path, required=True)
    for name in MEASURED:
        parser.add_argument(f"--{name.replace('_', '-')}", required=True,
                            help="where the timings were measured")
    args = parser.parse_args(argv)
    table = write_table(args.source, args.out, {name: getattr(args, name) for name in MEASURED})
    for entry in table["picks"]:
        print(f"{entry['kernel']} {entry['key']}: {entry['config']['kwargs']} "
              f"{entry['mean_ms']['picked']} ms (slowest {entry['mean_ms']['slowest']} ms)")
    print(f"{len(table['picks'])} picks -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
