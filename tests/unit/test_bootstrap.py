"""scripts/bootstrap.sh on a shared checkout: concurrent starts install the venv once, a lock
left by a killed bootstrap is taken over, and a GPU host without the kernel packages is told so.

Each test runs the real bootstrap, in real bash processes, from a copy of the repository (the
bootstrap, pyproject.toml, README.md, titan_hybrid/) whose `.venv` has no install stamp: stale,
as after a change to pyproject.toml. That venv is a fresh one that sees this test run's
site-packages through a .pth file, so pip finds torch, triton and torchtitan already satisfied
and does only its quick part (the editable install; on a CPU host the kernels' sources for the
interpreter tests): about 12 s on a CPU-only machine, instead of copying gigabytes of wheels.
`nvidia-smi` is an external program the bootstrap asks whether there is a GPU; a stand-in on
PATH answers (no, or one GPU), so each test takes the path it means on any machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from importlib.metadata import distributions, version
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
INSTALLING = "== bootstrap: installing "
# The kernel packages the GPU note is about: module, distribution.
KERNEL_PACKAGES = {"mamba_ssm": "mamba-ssm", "fla": "fla-core", "causal_conv1d": "causal-conv1d"}

# The bootstrap needs the venv this suite runs in to be one of its own (exact torch / triton /
# torchtitan pins): anything else, and pip in the copy would download another torch.
# The script is the same under every torch: CI runs these on its first torch leg only.
pytestmark = [pytest.mark.skipif(
    not (Path(sys.prefix) / ".titan_hybrid_installed").exists(),
    reason="the tests run outside a venv made by scripts/bootstrap.sh"),
    pytest.mark.once_per_ci]


def _minor(distribution: str) -> str:
    return ".".join(version(distribution).split(".")[:2])


class Checkout:
    """A copy of the repository with a stale venv, and the commands that bootstrap it."""

    def __init__(self, root: Path, *, gpu: bool):
        self.root = root
        shutil.copytree(REPO_ROOT / "titan_hybrid", root / "titan_hybrid",
                        ignore=shutil.ignore_patterns("__pycache__"))
        (root / "scripts").mkdir()
        shutil.copy2(REPO_ROOT / "scripts" / "bootstrap.sh", root / "scripts")
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(REPO_ROOT / name, root)
        # This suite's torch line, whatever the environment says (a default 2.13 would have pip
        # fetch torch 2.13 when the suite runs on another line).
        self.line = {"TITAN_HYBRID_TORCH": _minor("torch"),
                     "TITAN_HYBRID_TORCHTITAN": _minor("torchtitan")}
        self.venv_name = ".venv"
        if self.line["TITAN_HYBRID_TORCH"] != "2.13":
            self.venv_name += f"-torch-{self.line['TITAN_HYBRID_TORCH']}"
        if self.line["TITAN_HYBRID_TORCHTITAN"] != "0.2":
            self.venv_name += f"-torchtitan-{self.line['TITAN_HYBRID_TORCHTITAN']}"
        self.venv = root / self.venv_name
        # Without pip of its own: the bootstrap's `python -m pip` runs this suite's pip, which
        # installs into the venv it runs in (sys.prefix).
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(self.venv)],
                       check=True)
        self.site_packages = Path(sysconfig.get_path(
            "purelib", vars={"base": str(self.venv), "platbase": str(self.venv)}))
        here = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
        (self.site_packages / "suite_site_packages.pth").write_text("\n".join(sorted(here)))
        bin_dir = root / "fake-bin"
        bin_dir.mkdir()
        nvidia_smi = bin_dir / "nvidia-smi"
        nvidia_smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3'\n" if gpu
                              else "#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
        nvidia_smi.chmod(0o755)
        self.env = {**os.environ, **self.line,
                    "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}

    def command(self, after_barrier: Path | None = None) -> list[str]:
        """bash sourcing the bootstrap, as run_train.sh does, then printing the python it put
        first on PATH; with `after_barrier`, only once a line can be read from that FIFO."""
        script = 'source "$1" && command -v python'
        if after_barrier is not None:
            script = f'read -r _ < "$2" && {script}'
        return ["bash", "-c", script, "bash", str(self.root / "scripts" / "bootstrap.sh"),
                *([str(after_barrier)] if after_barrier else [])]

    def run(self, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(), env={**self.env, **env}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=600)

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python")

    @property
    def lock(self) -> Path:
        return self.venv / ".install-lock"


@pytest.mark.extended
def test_concurrent_bootstraps_install_the_venv_once(tmp_path):
    checkout = Checkout(tmp_path, gpu=False)
    # Both start at once, through a barrier: a FIFO that the test holds open, so each process's
    # read blocks until the test writes a line for each, once both processes exist. Both then
    # find the stamp stale (the install takes seconds): the old bootstrap had both pip-install
    # into the one venv; now one installs and the other waits for it, then finds it installed.
    barrier = tmp_path / "barrier"
    os.mkfifo(barrier)
    barrier_fd = os.open(barrier, os.O_RDWR)
    try:
        procs = [subprocess.Popen(checkout.command(after_barrier=barrier), env=checkout.env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for _ in range(2)]
        os.write(barrier_fd, b"go\n" * len(procs))
        outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    finally:
        os.close(barrier_fd)
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output
        # Both go on, with the venv's python first on PATH.
        assert output.splitlines()[-1] == checkout.python, output
    installers = [output for output in outputs if INSTALLING in output]
    assert len(installers) == 1, "\n---\n".join(outputs)
    assert installers[0].count(INSTALLING) == 1
    other = outputs[1 - outputs.index(installers[0])]
    assert f"{checkout.venv_name} was installed meanwhile by another process" in other, other
    assert not checkout.lock.exists()


@pytest.mark.extended
@pytest.mark.parametrize("holder_host", [
    "this host",
    # Another node's pid cannot be looked up: its lock goes stale when its heartbeat stops
    # (60 s). The killed bootstrap names another host through bash's HOSTNAME.
    pytest.param("another host", marks=pytest.mark.slow)])
def test_lock_of_a_killed_bootstrap_is_taken_over(tmp_path, holder_host):
    checkout = Checkout(tmp_path, gpu=False)
    env = {"HOSTNAME": "another-node"} if holder_host == "another host" else {}
    killed = subprocess.Popen(checkout.command(), env={**checkout.env, **env},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    # Killed mid-install, with pip and everything else it started (its process group), by a
    # signal no trap sees: nothing removes its lock.
    output = ""
    for line in killed.stdout:
        output += line
        if line.startswith(INSTALLING):
            break
    os.killpg(killed.pid, signal.SIGKILL)
    output += killed.communicate()[0]
    assert INSTALLING in output, output
    assert checkout.lock.exists(), "the killed bootstrap left no lock"

    after = checkout.run()
    assert after.returncode == 0, after.stdout
    assert "is gone (no such process, or no heartbeat for 60 s): taking over its install " \
        "lock" in after.stdout, after.stdout
    assert after.stdout.count(INSTALLING) == 1, after.stdout
    assert after.stdout.splitlines()[-1] == checkout.python
    assert not checkout.lock.exists()


@pytest.mark.extended
def test_gpu_host_is_told_which_kernel_packages_are_missing(tmp_path):
    checkout = Checkout(tmp_path, gpu=True)
    # Installed or not in this suite's venv, which the copy's venv sees (read from their
    # metadata; the bootstrap looks for their modules).
    installed = {dist.metadata["Name"].lower().replace("_", "-") for dist in distributions(
        path=[sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])}
    missing = [dist for dist in KERNEL_PACKAGES.values() if dist not in installed]

    def note(**env: str) -> str | None:
        result = checkout.run(**env)
        assert result.returncode == 0, result.stdout
        notes = [line for line in result.stdout.splitlines() if line.startswith("note: ")]
        assert len(notes) <= 1, notes
        return notes[0] if notes else None

    def check(note: str | None, missing: list[str]) -> None:
        if not missing:
            assert note is None, note
            return
        verb = "is" if len(missing) == 1 else "are"
        assert note is not None and note.startswith(
            f"note: {' / '.join(missing)} {verb} not installed in {checkout.venv_name}: the run "
            "takes the torch paths (about 3x slower); install them (README, \"GPU path\") with: "
            f"cd {checkout.root} && "), note
        if checkout.venv_name == ".venv":
            # The commands README's "GPU path" gives.
            readme = (REPO_ROOT / "README.md").read_text()
            for command in (".venv/bin/pip install wheel ninja",
                            'MAMBA_SKIP_CUDA_BUILD=TRUE .venv/bin/pip install '
                            '--no-build-isolation -e ".[gpu]" '
                            '"torch==2.13.*"'):
                assert command in readme and command in note, note

    check(note(), missing)  # the first start installs the venv, then looks
    # Then mamba_ssm and fla are found on the venv's path, then causal_conv1d too. Empty
    # stand-ins will do: the bootstrap asks only whether each is installed (the run's start-up
    # probe checks the rest).
    found = tmp_path / "kernel-packages"
    (checkout.site_packages / "kernel_packages.pth").write_text(str(found))
    for modules in (("mamba_ssm", "fla"), ("causal_conv1d",)):
        for module in modules:
            (found / module).mkdir(parents=True)
            (found / module / "__init__.py").touch()
            missing = [dist for dist in missing if dist != KERNEL_PACKAGES[module]]
        check(note(), missing)


def test_a_named_venv_of_another_torch_is_refused_untouched(tmp_path):
    """TITAN_HYBRID_VENV names a venv to reuse; asked for another torch line, the bootstrap says
    so in one line and installs nothing there (CI's 0.3 leg shares the 2.14 venv, and a test
    run from it must not see its torch replaced)."""
    venv = tmp_path / "venv-of-2.14"
    venv.mkdir()
    stamp = "torch==2.14.1 triton==3.8.0 torchtitan==0.2.2  gpu=0 0123456789abcdef\n"
    (venv / ".titan_hybrid_installed").write_text(stamp)
    env = {**os.environ, "TITAN_HYBRID_TORCH": "2.13", "TITAN_HYBRID_VENV": str(venv)}
    done = subprocess.run(["bash", "-c", "source scripts/bootstrap.sh"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert done.stderr.strip() == (
        f"error: TITAN_HYBRID_VENV={venv} holds torch==2.14.1, not torch==2.13.0 "
        "(TITAN_HYBRID_TORCH=2.13): name a venv of that torch, or unset TITAN_HYBRID_VENV")
    assert sorted(p.name for p in venv.iterdir()) == [".titan_hybrid_installed"]
