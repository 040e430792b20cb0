"""Convert between Hugging Face folders and titan_hybrid checkpoints.

    python -m titan_hybrid.hf import HF_DIR OUT_DIR
    python -m titan_hybrid.hf export CHECKPOINT OUT_HF_DIR --job OUT_DIR/job.toml
    python -m titan_hybrid.hf export CHECKPOINT OUT_HF_DIR --model-config HF_DIR_OR_CONFIG
    python -m titan_hybrid.hf export CHECKPOINT OUT_HF_DIR --flavor NAME [--pattern P]

`import` writes OUT_DIR/checkpoint/step-0, OUT_DIR/config.json, the tokenizer files and
OUT_DIR/job.toml (see titan_hybrid/hf/convert.py). `export` reads the model args from the job
(its model.flavor, hybrid.pattern, hybrid.model_config), from an HF config, or from a flavor;
CHECKPOINT is a step folder or a checkpoint folder (its newest intact step). A user error is
one line naming the argument, field or tensor, and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from titan_hybrid.hf.convert import MAX_SHARD_BYTES, export_hf, import_hf
from titan_hybrid.hf.families import model_args_from_hf
from titan_hybrid.model.args import HybridModelArgs, resolve_model_args


def model_args_of_job(job_file: Path) -> tuple[HybridModelArgs, str | None]:
    """(model args, tokenizer folder) of a TOML job: its model.flavor, hybrid.pattern and
    hybrid.model_config, as a run resolves them."""
    try:
        job = tomllib.loads(job_file.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ValueError(f"--job '{job_file}' is not a readable TOML job ({error})") from None
    hybrid, model = job.get("hybrid", {}), job.get("model", {})
    base = model_args_from_hf(hybrid["model_config"]) if hybrid.get("model_config") else None
    seq_len = job.get("training", {}).get("seq_len", 2048)
    args = resolve_model_args(model.get("flavor", "debug"), pattern=hybrid.get("pattern", ""),
                              seq_len=seq_len, hc_mult=hybrid.get("hc_mult"), base=base)
    return args, model.get("hf_assets_path")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_hybrid.hf",
                                     description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    importing = commands.add_parser("import", help="HF folder -> titan_hybrid checkpoint + job")
    importing.add_argument("hf_dir", type=Path)
    importing.add_argument("out_dir", type=Path)
    exporting = commands.add_parser("export", help="titan_hybrid checkpoint -> HF folder")
    exporting.add_argument("checkpoint", type=Path)
    exporting.add_argument("hf_dir", type=Path)
    source = exporting.add_mutually_exclusive_group(required=True)
    source.add_argument("--job", type=Path, help="the run's TOML job")
    source.add_argument("--model-config", help="an HF folder or config.json")
    source.add_argument("--flavor", help="a titan_hybrid flavor (with --pattern)")
    exporting.add_argument("--pattern", default="")
    exporting.add_argument("--tokenizer", type=Path, help="folder whose tokenizer files to copy")
    exporting.add_argument("--max-shard-gb", type=float, default=MAX_SHARD_BYTES / 2**30)
    options = parser.parse_args(argv)
    try:
        if options.command == "import":
            import_hf(options.hf_dir, options.out_dir)
            return 0
        tokenizer = options.tokenizer
        if options.job:
            args, job_tokenizer = model_args_of_job(options.job)
            tokenizer = tokenizer or job_tokenizer
        elif options.model_config:
            args = model_args_from_hf(options.model_config, "--model-config")
        else:
            args = resolve_model_args(options.flavor, pattern=options.pattern, seq_len=2048)
        if tokenizer is None and options.model_config:
            tokenizer = Path(options.model_config)
        export_hf(options.checkpoint, options.hf_dir, args, tokenizer=tokenizer,
                  max_shard_bytes=int(options.max_shard_gb * 2**30))
        return 0
    except ValueError as error:  # a user error: one message, no traceback
        print(f"titan_hybrid.hf {options.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
