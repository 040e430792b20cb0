"""Worker entry that runs a trainer entry point (`--probe-entry MODULE`; the rest is the job)
and counts, in this process, how often the run configuration and model args are resolved and
the layout validated; prints `PROBE {json}` when the trainer closes.

Counted after imports: model-args objects created (constructed or copied; apart, those that
come with the model copies torchtitan makes for pipeline stages), `run_config`,
`resolve_model_args` and `validate_layout` calls."""

from __future__ import annotations

import json
import runpy
import sys

# Before torchtitan is imported: its ConfigManager.parse_args binds sys.argv[1:] as its default.
ENTRY = sys.argv[sys.argv.index("--probe-entry") + 1]
del sys.argv[sys.argv.index("--probe-entry"):sys.argv.index("--probe-entry") + 2]

from titan_hybrid.adapters.torchtitan_0_2.job_config import run_config
from titan_hybrid.model.args import HybridModelArgs, resolve_model_args
from titan_hybrid.parallel.validate import validate_layout

counts = {"model_args_objects": 0, "copied_with_stages": 0, "run_configs": 0,
          "resolve_model_args": 0, "validate_layout": 0}
splitting = [0]  # inside torchtitan's pipeline_module_split, which deep-copies the model


def _counting_new(cls, *args, **kwargs):
    counts["copied_with_stages" if splitting[0] else "model_args_objects"] += 1
    return object.__new__(cls)


def _profile(frame, event, arg):
    code = frame.f_code
    if code.co_name == "pipeline_module_split" and event in ("call", "return"):
        splitting[0] += 1 if event == "call" else -1
    if event == "call":
        if code is validate_layout.__code__:
            counts["validate_layout"] += 1
        elif code is resolve_model_args.__code__:
            counts["resolve_model_args"] += 1
        elif code is run_config.__code__:
            counts["run_configs"] += 1
        elif code.co_name == "close" and code.co_filename.endswith("torchtitan/train.py"):
            # Trainer.close (runpy runs torchtitan.train anew: match it by name and file)
            print("PROBE " + json.dumps(counts), flush=True)


def main() -> None:
    HybridModelArgs.__new__ = _counting_new
    sys.setprofile(_profile)
    runpy.run_module(ENTRY, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
