"""A fork server for the tests' launches: `python -m tests.zygote REQUEST_FD REPLY_FD`.

Every launch of the trainer or of a worker script used to start a fresh interpreter that spent
seconds importing torch, torchtitan (which pulls in inductor) and titan_hybrid before doing any
work. This process imports them once, runs no torch operation (no thread pools exist to be
broken by fork), and forks one child per request; the child runs the requested module as
`python -m MODULE ARGS` would (or calls a function), with its stdout and stderr in files, and
its exit status is sent back. tests/launch.py starts one per test session and falls back to a
plain subprocess whenever a launch needs an environment other than the one this process
imported with.

Requests and replies are JSON lines. First reply, once the imports are done: {"ready": PID,
"set_by_imports": {the environment variables the imports set}}. Request: {"cwd", "env",
"stdout", "stderr", and "module" + "args" or "call": "pkg.mod:function" + "args"}. Replies:
{"pid": P} once the child exists, then {"status": S} (an exit code, or minus the signal that
ended it).
"""

from __future__ import annotations

import json
import os
import sys

# What every child would import, imported once here; none of it runs a torch operation. Which
# modules depends on the installed torchtitan's generation: under 0.2, the plugin that every
# run imports first (it activates titan_hybrid); under 0.3, the library modules behind the
# config registry, which torchtitan imports in each child (`--module titan_hybrid`).
PRELOAD = ("torch", "torch.distributed.run", "torchtitan.train", "titan_hybrid.training.preflight")
PRELOAD_BY_GENERATION = {
    (0, 2): ("titan_hybrid.adapters.torchtitan_0_2.trainer", "titan_hybrid.torchtitan_plugin"),
    (0, 3): ("torchtitan.trainer", "titan_hybrid.adapters.torchtitan_0_3.trainer",
             "titan_hybrid.adapters.torchtitan_0_3.model_spec"),
}


def _exit_code(error: SystemExit) -> int:
    # What the interpreter does with SystemExit: None -> 0, an int as is, anything else printed
    # to stderr -> 1.
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code
    print(error.code, file=sys.stderr)
    return 1


def _run_child(request: dict, set_by_imports: dict[str, str]) -> None:
    """In the forked child: become the requested process, then leave with its status.
    SET_BY_IMPORTS: the variables the preloaded imports set (a fresh process that imports them
    sets them too), kept unless the request sets them itself."""
    import importlib
    import runpy
    import traceback
    import warnings

    # runpy warns when the module to run was imported already (this process preloaded it).
    warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package",
                            category=RuntimeWarning)
    code = 1
    try:
        os.setpgid(0, 0)  # a group of its own: the test can stop the launch as a whole
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
            os.dup2(target, fd)
            os.close(target)
        os.chdir(request["cwd"])
        imported_with = os.environ.get("PYTHONPATH", "")
        os.environ.clear()
        os.environ.update({**set_by_imports, **request["env"]})
        # A PYTHONPATH of the request's own (a test's folder of user modules) goes in front of
        # sys.path, where a fresh interpreter puts it.
        if os.environ.get("PYTHONPATH", "") != imported_with:
            extra = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                     if entry and entry not in sys.path]
            sys.path[:0] = extra
        if "module" in request:
            sys.argv = [request["module"], *request["args"]]
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        else:
            module, function = request["call"].split(":")
            code = int(getattr(importlib.import_module(module), function)(*request["args"]) or 0)
    except SystemExit as error:
        code = _exit_code(error)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def fork_workers(script: str, nproc: str, *args: str) -> int:
    """`torchrun --standalone --nproc_per_node NPROC SCRIPT ARGS` by fork: NPROC workers with
    torchrun's environment contract, each running SCRIPT as `python SCRIPT ARGS` would."""
    import runpy

    def run() -> None:
        sys.argv = [script, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")

    return _fork_ranks(int(nproc), run)


def fork_module_workers(module: str, nproc: str, *args: str) -> int:
    """`torchrun --standalone --nproc_per_node NPROC -m MODULE ARGS` by fork: each of NPROC
    workers runs MODULE as `python -m MODULE ARGS` would."""
    import runpy

    def run() -> None:
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)

    return _fork_ranks(int(nproc), run)


def _fork_ranks(world: int, run) -> int:
    """WORLD forked workers with torchrun's environment contract (RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, MASTER_ADDR, MASTER_PORT), each calling RUN. Like
    torchrun, the first worker to fail stops the others; the result is 0 or that worker's
    status (1 when a signal ended it)."""
    import signal
    import socket
    import traceback

    with socket.socket() as probe:  # a free port for rank 0's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    workers = {}
    for rank in range(world):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.environ.update(
                    RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank), GROUP_RANK="0",
                    WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                run()
                code = 0
            except SystemExit as error:
                code = _exit_code(error)
            except BaseException:
                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        workers[pid] = rank
    result = 0
    while workers:
        pid, status = os.wait()
        rank = workers.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and result == 0:
            print(f"fork_workers: rank {rank} exited with status {code}", file=sys.stderr)
            result = code if code > 0 else 1
            for other in workers:
                os.kill(other, signal.SIGKILL)
    return result


def main(request_fd: int, reply_fd: int) -> None:
    import importlib

    started_with = dict(os.environ)
    from titan_hybrid.compat import TORCHTITAN_RELEASE

    for name in (*PRELOAD, *PRELOAD_BY_GENERATION[TORCHTITAN_RELEASE]):
        importlib.import_module(name)
    if TORCHTITAN_RELEASE == (0, 2):
        # Warm the job parser's caches (tyro reads the source of every config class): pure
        # Python.
        from titan_hybrid.adapters.torchtitan_0_2.job_config import parse_job

        parse_job(["--job.config_file", "train_configs/hybrid.toml"])
    requests = os.fdopen(request_fd, "r")
    replies = os.fdopen(reply_fd, "w", buffering=1)
    # e.g. TORCHINDUCTOR_CACHE_DIR, which importing torch's inductor sets.
    set_by_imports = {k: v for k, v in os.environ.items() if started_with.get(k) != v}
    replies.write(json.dumps({"ready": os.getpid(), "set_by_imports": set_by_imports}) + "\n")
    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            requests.close()
            replies.close()
            _run_child(request, set_by_imports)
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
