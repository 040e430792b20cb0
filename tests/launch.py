"""Run titan_hybrid's trainer in real processes (torchrun + gloo) and read its exact loss curve.

Every launch is a real process tree: a launcher process and its workers, with their own exit
status and output. To save each launch the seconds a fresh interpreter spends importing torch,
torchtitan and titan_hybrid, the launcher process is forked from a per-session fork server that
imported them once (tests/zygote.py), and the trainer's launcher forks its workers in turn
(titan_hybrid.launch does that on CPU-only hosts); worker scripts and modules (torchtitan
0.3's `torchrun -m torchtitan.train`) are forked by the same server under torchrun's
environment contract. A launch whose environment differs from the one the fork server
imported with runs as a fresh subprocess instead, as does everything when
TITAN_HYBRID_TEST_FORK=0.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Variables that may differ between a launch and the fork server without changing what the
# launch imports: pytest's per-test marker, output buffering (the server's children write
# unbuffered, as run_training asks for), and the address inductor sets in a process that
# compiled in place (a test's torch.compile), before each compiled module it loads there.
_ENV_IGNORED = {"PYTEST_CURRENT_TEST", "PYTHONUNBUFFERED",
                "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"}
# Variables a forked child applies itself as a fresh interpreter would: PYTHONPATH's entries go
# in front of sys.path (tests/zygote.py). Modules the server imported stay as imported, so a
# test's PYTHONPATH adds modules of its own (a user's registry), never other copies of these.
_ENV_APPLIED = {"PYTHONPATH"}


# A few steps of a small job with every sequence-mixing kind (Mamba2, attention, GDN, MLP):
# the reference for checks whose runs are costly per step (compile, mixed precision).
SMALL_JOB = ("--training.steps", "3", "--training.seq_len", "64",
             "--training.local_batch_size", "2", "--hybrid.pattern", "M*G-")
BF16 = ("--training.mixed_precision_param", "bfloat16")

# Loss curves through DSA's `D` or DeepSeek-V4's `C` against one process, relative. Their
# indexers train on a small loss (coefficient 0.01), so their gradients are small and Adam's
# eps makes their updates sensitive to the gradient-clipping coefficient max_norm / |g|. |g| is
# a float32 norm whose rounding depends on the layout (torch's CPU norm of the LM head's
# gradient, 524k elements, is 8e-5 off its float64 value, and TP's two half norms round
# differently: measured 1.2e-5 apart at step 1 under TP2). The indexers' weights then drift
# apart, and where two of a query's candidate rows score within that drift, the layouts keep
# different rows: one query's attention at one layer changes, and the step's mean loss moves
# by about 2e-5 (measured on torch 2.11 under TP2: 2.1e-5 for debug_dsa at step 4, 2.3e-5 for
# debug_v4_all; without clipping, --training.max_norm 1e6, the same curves agree within 1e-7).
# 1e-4 admits a few such swaps; a wrong gradient moves a curve by 1e-3 or more (issue 32's
# compiled-CP bug: 1.2e-3 at step 2).
TOP_K_CURVE_REL = 1e-4
# The indexer's own logged loss (its KL) under the same drift: measured up to 1.4% apart from
# step 2 on torch 2.11 under TP2 (exact without clipping). A wrong average over the data /
# context / pipeline ranks is off by 50% or more.
INDEXER_LOSS_REL = 5e-2


@dataclass
class TrainResult:
    returncode: int
    output: str
    losses: list[float]
    validation_losses: list[float] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)  # the loss-curve file's lines

    def check(self) -> "TrainResult":
        assert self.returncode == 0, self.failure_excerpt()
        return self

    def failure_excerpt(self, size: int = 6000) -> str:
        """The output's tail, after the start of a crash's faulthandler dump (the crashed
        rank's Python stack, "Fatal Python error: ..."), which the other ranks' later
        tracebacks would push out of the tail."""
        crash = self.output.find("Fatal Python error")
        if crash < 0 or crash >= len(self.output) - size:
            return self.output[-size:]
        return (self.output[crash:crash + size // 2] + "\n[...]\n"
                + self.output[-size // 2:])


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(pid: int) -> None:
    """SIGKILL a launch and every process under it (forked workers run in sessions of their
    own, so its process group is not enough)."""
    for victim in [pid, *_descendants(pid)]:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


class _ForkServer:
    """tests/zygote.py in a process of its own, started with ENV; ready once it has imported."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        request_r, request_w = os.pipe()
        reply_r, reply_w = os.pipe()
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote", str(request_r), str(reply_w)],
            cwd=REPO_ROOT, env=env, pass_fds=(request_r, reply_w), stdin=subprocess.DEVNULL,
            stdout=self.log, stderr=self.log)
        os.close(request_r)
        os.close(reply_w)
        self.requests = os.fdopen(request_w, "w", buffering=1)
        self.reply_fd = reply_r
        self.buffer = b""
        self.ready = False
        self.set_by_imports: dict[str, str] = {}
        self.refused: set[tuple[str, ...]] = set()

    def _read(self, timeout: float | None) -> dict:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.reply_fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(self.reply_fd, 65536)
            if not chunk:
                self.log.seek(0)
                raise RuntimeError("the tests' fork server stopped:\n"
                                   + self.log.read().decode(errors="replace")[-4000:])
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def wait_ready(self) -> None:
        if not self.ready:
            try:
                ready = self._read(timeout=300)  # once the imports are done
            except BaseException:
                self.close()
                raise
            self.set_by_imports = ready["set_by_imports"]
            self.ready = True

    def accepts(self, env: dict[str, str]) -> bool:
        """Whether a launch with ENV may be forked from here: ENV is the environment this
        server imported in, give or take what its imports set (a fresh process's imports set
        those too) and the variables that change nothing at import."""
        if self.proc.poll() is not None:
            return False
        imported_in = {**self.env, **self.set_by_imports}
        differ = tuple(sorted(
            key for key in (set(env) | set(imported_in)) - _ENV_IGNORED - _ENV_APPLIED
            if env.get(key) != imported_in.get(key)
            and not (key in self.set_by_imports and key not in env)))
        if differ and differ not in self.refused:
            # Not an error (the launch runs as a subprocess), but seconds lost each time.
            warnings.warn(f"tests/launch.py: environment differs from the fork server's in "
                          f"{', '.join(differ)}: launching a subprocess", stacklevel=2)
            self.refused.add(differ)
        return not differ

    def run(self, request: dict, timeout: float) -> int:
        self.requests.write(json.dumps(request) + "\n")
        pid = self._read(timeout=60)["pid"]
        try:
            return self._read(timeout)["status"]
        except BaseException:  # a timeout or an interrupt: stop the whole launch
            _kill_tree(pid)
            self._read(timeout=60)
            raise

    def close(self) -> None:
        self.requests.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_server: _ForkServer | None = None
_server_failed = False


def _launch_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def start_fork_server() -> None:
    """Start the session's fork server now, without waiting for its imports (tests/conftest.py
    does this at the start of a session that runs distributed tests: the server then imports
    while pytest collects)."""
    global _server
    if _server is None and os.environ.get("TITAN_HYBRID_TEST_FORK", "1") != "0":
        env = _launch_env(PYTHONUNBUFFERED="1")
        env.pop("PYTEST_CURRENT_TEST", None)
        _server = _ForkServer(env)
        atexit.register(_server.close)


def _fork_server(env: dict[str, str]) -> _ForkServer | None:
    """The session's fork server if it can run a launch with ENV, else None (subprocess)."""
    global _server_failed
    if _server_failed or os.environ.get("TITAN_HYBRID_TEST_FORK", "1") == "0":
        return None
    start_fork_server()
    try:
        _server.wait_ready()
    except (RuntimeError, TimeoutError) as error:
        # e.g. a library that does not import: every launch then shows that itself.
        print(f"tests/launch.py: no fork server, launching subprocesses ({error})",
              file=sys.stderr)
        _server_failed = True
        return None
    return _server if _server.accepts(env) else None


def _run(python_args: list[str], env: dict[str, str], timeout: float,
         call: tuple[str, list[str]] | None = None) -> subprocess.CompletedProcess:
    """`python PYTHON_ARGS` (`-m MODULE ARGS` or a script) with ENV in REPO_ROOT, forked from
    the fork server where it can be: CALL = (pkg.mod:function, args) is how the server runs
    it then (default: the module of `-m`)."""
    server = _fork_server(env)
    if server is None:
        return subprocess.run([sys.executable, *python_args], cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="titan_hybrid_launch_") as folder:
        request = {"cwd": str(REPO_ROOT), "env": env, "stdout": f"{folder}/stdout",
                   "stderr": f"{folder}/stderr"}
        if call is None:
            assert python_args[0] == "-m", python_args
            request.update(module=python_args[1], args=python_args[2:])
        else:
            request.update(call=call[0], args=call[1])
        try:
            status = server.run(request, timeout)
        except TimeoutError:
            status = None
        stdout, stderr = (Path(folder, name).read_text(errors="replace")
                          for name in ("stdout", "stderr"))
    if status is None:
        raise subprocess.TimeoutExpired([sys.executable, *python_args], timeout, stdout, stderr)
    return subprocess.CompletedProcess([sys.executable, *python_args], status, stdout, stderr)


def run_training(tmp_path: Path, *args: str, nproc: int = 1, config: str = "hybrid.toml",
                 module: str = "titan_hybrid.train", timeout: int = 600) -> TrainResult:
    """`python -m titan_hybrid.launch --nproc NPROC --job.config_file CONFIG ARGS` (what
    run_train.sh runs; every rank's output is kept), or with another MODULE
    `torchrun --nproc_per_node NPROC -m MODULE --job.config_file CONFIG ARGS`.

    The loss curve is read from a fresh file under tmp_path, or from the ARGS' own
    --hybrid.loss_curve_file (relative to the dump folder tmp_path/outputs)."""
    curve = tmp_path / f"loss_curve_{len(list(tmp_path.glob('loss_curve_*')))}.jsonl"
    given = "--hybrid.loss_curve_file" in args
    if given:
        curve = tmp_path / "outputs" / args[args.index("--hybrid.loss_curve_file") + 1]
    if module == "titan_hybrid.train":
        launcher = ["-m", "titan_hybrid.launch", "--nproc", str(nproc),
                    "--log-rank", ",".join(str(rank) for rank in range(nproc))]
    else:
        launcher = ["-m", "torch.distributed.run", "--standalone",
                    f"--nproc_per_node={nproc}", "-m", module]
    command = [
        *launcher,
        "--job.config_file", str(REPO_ROOT / "train_configs" / config),
        "--job.dump_folder", str(tmp_path / "outputs"),
        "--metrics.disable_color_printing",
        *args,
    ]
    if not given and (module == "titan_hybrid.train" or "--job.custom_config_module" in args):
        command += ["--hybrid.loss_curve_file", str(curve)]
    proc = _run(command, _launch_env(PYTHONUNBUFFERED="1"), timeout)
    records = ([json.loads(line) for line in curve.read_text().splitlines()]
               if curve.exists() else [])
    return TrainResult(proc.returncode, proc.stdout + proc.stderr,
                       [r["loss"] for r in records if "loss" in r],
                       [r["validation_loss"] for r in records if "validation_loss" in r],
                       records)


def wait_for(condition, timeout: float = 240.0, poll: float = 0.002) -> bool:
    """Poll `condition` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll)
    return False


def launch_workers(script: Path, *args: str, nproc: int = 2,
                   timeout: int = 600) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node NPROC SCRIPT ARGS`: NPROC worker processes under
    torchrun's environment contract (forked by the fork server where it can be)."""
    command = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(script), *args]
    # A script's own folder is its sys.path[0]: the repository goes on the path for `tests`.
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return _run(command, _launch_env(PYTHONPATH=path), timeout,
                call=("tests.zygote:fork_workers", [str(script), str(nproc), *args]))


def torchrun(*words: str, timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    """`torchrun WORDS` in REPO_ROOT with ENV added to the launch environment: torchrun's own
    launcher (forked by the fork server where it can be) starts fresh worker processes, as it
    does for a user."""
    return _run(["-m", "torch.distributed.run", *words], _launch_env(**env), timeout)


def torchrun_module(module: str, *args: str, nproc: int = 1, fork_workers: bool = True,
                    timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node NPROC -m MODULE ARGS` in REPO_ROOT with ENV
    added to the launch environment. With fork_workers, the fork server forks NPROC workers
    under torchrun's environment contract (tests/zygote.py), which saves each worker its
    imports; without, this is `torchrun` (above), for what torchrun itself prints and
    returns."""
    words = ("--standalone", f"--nproc_per_node={nproc}", "-m", module, *args)
    if not fork_workers:
        return torchrun(*words, timeout=timeout, **env)
    return _run(["-m", "torch.distributed.run", *words], _launch_env(**env), timeout,
                call=("tests.zygote:fork_module_workers", [module, str(nproc), *args]))


def run_worker(script: Path, *args: str, nproc: int = 2) -> dict:
    """torchrun a worker script; returns the JSON of its last `RESULT {json}` line."""
    proc = launch_workers(script, *args, nproc=nproc)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(lines[-1][len("RESULT "):])
