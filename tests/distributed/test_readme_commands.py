"""The training commands of the README and of docs/ work as written (plus a short step count and
a private dump folder, the overrides the README says any job takes)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import REPO_ROOT

README = "\n".join(path.read_text() for path in
                   [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))])
BLOCKS = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
# torchtitan 0.2 commands; those of a torchtitan 0.3 job (`--module ...`) run in the 0.3 leg
# (tests/torchtitan_0_3). A command shown twice (the README's tour repeats some) runs once.
COMMANDS = list(dict.fromkeys(
    line.split("  #")[0].strip() for block in BLOCKS for line in block.splitlines()
    if re.match(r"\s*(NGPU=\d+ )?(\./run_train\.sh|torchrun) ", line)
    and "--module" not in line))


def test_the_readme_shows_the_commands_this_file_runs():
    # 5: the README's four of before the docs/ split (train, PP2 + checkpoints, FP8, torchtitan's
    # own trainer: now in the README and docs/fp8.md, docs/torchtitan_0_3.md), and the tour's
    # hybrid pattern.
    assert len(COMMANDS) == 5, COMMANDS


# The README's text is the same under every torch (the trainer's runs under each are other
# tests'): CI runs these on its first torch leg, in its extended run (the default suite's
# tests/distributed/test_train.py trains the first command's job).
@pytest.mark.extended
@pytest.mark.once_per_ci
@pytest.mark.parametrize("command", COMMANDS)
def test_readme_training_command_runs_as_written(tmp_path, command):
    words = shlex.split(command)
    # As after `source .venv/bin/activate` (run_tests.sh does the same): torchrun on PATH.
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    while "=" in words[0]:
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    words += ["--training.steps", "2", "--job.dump_folder", str(tmp_path / "outputs"),
              "--metrics.disable_color_printing"]
    proc = subprocess.run(words, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    losses = [float(x) for x in re.findall(r"step:  2  loss: +([-0-9.]+)", output)]
    assert losses and 0 < losses[0] < 10, output[-4000:]  # a real loss on the shown rank
