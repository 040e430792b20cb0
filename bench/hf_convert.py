"""Import / export time and peak memory of `python -m titan_hybrid.hf` on a checkpoint of over
1 GB, against transformers' own load + save of the same folder.

    .venv/bin/python bench/hf_convert.py [--folder /tmp/bench_hf] [--keep]

A random transformers NemotronH model (fp32, ~270M parameters, 1.1 GB: 12 Mamba2, 12 MLP and
2 attention layers at width 1024, vocabulary 32,000) is saved with `save_pretrained`. Each
measured command runs in a fresh process, which reports its wall time and peak resident memory
(ru_maxrss):
- ours: `import HF_DIR OUT`, then `export OUT/checkpoint HF_OUT --model-config HF_DIR`;
- baseline: transformers' `from_pretrained(HF_DIR)` then `save_pretrained(...)`, the round trip
  a user would otherwise write (it also holds one copy of the model).
The export is checked to equal the original tensors.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

MEASURE = """
import resource, runpy, sys, time
start = time.perf_counter()
sys.argv = {argv!r}
try:
    runpy.run_module({module!r}, run_name="__main__")
except SystemExit as exit:
    assert not exit.code, exit.code
print("MEASURED", time.perf_counter() - start,
      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
"""

BASELINE = """
import resource, sys, time, torch, transformers
start = time.perf_counter()
model = transformers.NemotronHForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
model.save_pretrained(sys.argv[2])
print("MEASURED", time.perf_counter() - start,
      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
"""


def measured(code: str, *args: str) -> tuple[float, float]:
    """(seconds, peak GiB) of `code` in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True,
                          text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("MEASURED")]
    if done.returncode or not lines:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    _, seconds, gib = lines[-1].split()
    return float(seconds), float(gib)


def run_module(module: str, *argv: str) -> tuple[float, float]:
    return measured(MEASURE.format(argv=[module, *argv], module=module))


def main() -> None:
    import torch
    import transformers
    from safetensors.torch import load_file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path("/tmp/bench_hf"))
    parser.add_argument("--keep", action="store_true", help="keep the folders afterwards")
    options = parser.parse_args()
    root = options.folder
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    start = time.perf_counter()
    config = transformers.NemotronHConfig(
        vocab_size=32000, hidden_size=1024, num_attention_heads=8, num_key_value_heads=4,
        head_dim=128, intermediate_size=4096, ssm_state_size=128, mamba_num_heads=32,
        mamba_head_dim=64, n_groups=8, chunk_size=128, max_position_embeddings=4096,
        layers_block_type=["mamba", "mlp"] * 6 + ["attention", "mlp"] + ["mamba", "mlp"] * 6
        + ["attention"])
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(root / "hf"))
    del model
    size = sum(f.stat().st_size for f in (root / "hf").glob("*.safetensors"))
    print(f"checkpoint: {params / 1e6:.0f}M parameters, {size / 1e9:.2f} GB of safetensors "
          f"(built and saved in {time.perf_counter() - start:.0f} s)")

    import_s, import_gib = run_module("titan_hybrid.hf", "import", str(root / "hf"),
                                      str(root / "ours"))
    export_s, export_gib = run_module("titan_hybrid.hf", "export", str(root / "ours" / "checkpoint"),
                                      str(root / "back"), "--model-config", str(root / "hf"))
    base_s, base_gib = measured(BASELINE, str(root / "hf"), str(root / "transformers"))

    original, exported = {}, {}
    for folder, tensors in ((root / "hf", original), (root / "back", exported)):
        for file in sorted(folder.glob("*.safetensors")):
            tensors.update(load_file(str(file)))
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[key], value) for key, value in original.items())
    print(f"{'':28} {'seconds':>8} {'peak GiB':>9}")
    print(f"{'ours: import':28} {import_s:8.1f} {import_gib:9.2f}")
    print(f"{'ours: export':28} {export_s:8.1f} {export_gib:9.2f}")
    print(f"{'ours: import + export':28} {import_s + export_s:8.1f} "
          f"{max(import_gib, export_gib):9.2f}")
    print(f"{'transformers: load + save':28} {base_s:8.1f} {base_gib:9.2f}")
    print(f"ours / transformers: time x{(import_s + export_s) / base_s:.2f}, peak memory "
          f"x{max(import_gib, export_gib) / base_gib:.2f}; the export equals the original "
          "tensors")
    print(json.dumps({"import_s": import_s, "export_s": export_s, "import_gib": import_gib,
                      "export_gib": export_gib, "baseline_s": base_s,
                      "baseline_gib": base_gib}))
    if not options.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
