"""Start a script in two processes for the tests, never waiting forever.

:class:`TwoRanks`: the script's two ranks forked from this session's
forkserver (:func:`forkserver`: torch, Accelerate, transformers and hookloop
imported once), with the environment ``accelerate launch --multi_gpu
--num_processes 2`` gives its ranks; no launcher and no fresh interpreters,
about 5 s of CPU less a run (tests/loop/test_launch.py checks that a rank
sees what it sees under ``accelerate launch``), handled as the launch's
``Popen``; :func:`run_two` runs it to its end. For a test about the
launch itself (its exit statuses, its restarts, a kill of the whole job):
:func:`accelerate_two`: ``accelerate launch --multi_gpu --num_processes 2``
on this CPU machine (the script asks for ``Accelerator(cpu=True)``, or does
not, to show what happens then). :func:`two_machines`: two plain ``python``
processes with the environment ``torchrun --nnodes 2 --nproc_per_node 1``
gives them, as if on two machines: each is its own machine's (local) main
process. Both return ``(exit statuses, output)`` and kill every process of
the run once ``timeout`` seconds have passed (a hang fails the test).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
#: a run that takes longer hangs: killed, and the test fails
TIMEOUT_S = 90


#: what the rank processes of the tests' scripts import, imported once by the forkserver
PRELOAD = ["torch", "torch._dynamo", "accelerate", "transformers", "hookloop", "resumable"]
_forkserver = None


def forkserver():
    """This session's forkserver context (one per process: runner.py's runs too)."""
    global _forkserver
    if _forkserver is None:
        if str(SCRIPTS) not in sys.path:
            sys.path.insert(0, str(SCRIPTS))  # the server imports resumable from here
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _forkserver = ctx
    return _forkserver


def launch_env(rank: int, port: int, **extra) -> dict:
    """The environment of rank ``rank`` of ``accelerate launch --multi_gpu
    --num_processes 2 --mixed_precision no --dynamo_backend no`` on this
    machine, but for the agent's error file; ``port`` is the store's, which
    the caller hosts (the launcher's agent does: TORCHELASTIC_USE_AGENT_STORE)."""
    return _env(ACCELERATE_MIXED_PRECISION="no", ACCELERATE_DYNAMO_BACKEND="NO",
                ACCELERATE_DYNAMO_MODE="default", ACCELERATE_DYNAMO_USE_FULLGRAPH="False",
                ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION="False",
                TORCHELASTIC_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
                RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_NAME="default",
                LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", WORLD_SIZE="2", GROUP_WORLD_SIZE="1",
                ROLE_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none",
                TORCHELASTIC_USE_AGENT_STORE="True", TORCH_NCCL_ASYNC_ERROR_HANDLING="1", **extra)


def _rank_main(script: str, args: list, env: dict, cwd: str, out: str, err: str) -> None:
    """A rank, in a process forked from the forkserver: the environment, the
    working directory, stdout/stderr and ``sys.argv`` of a launched script,
    then the script as ``__main__``, ended as ``python script`` ends (its
    traceback through ``sys.excepthook``, the ``atexit`` handlers, the exit
    status), not as a multiprocessing target does."""
    import atexit
    import runpy

    import torch

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    for fd, path in ((1, out), (2, err)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, fd)
        os.close(file)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # line-buffered, as a launched rank's pipe
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).parent))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit:
        if exit.code is None or isinstance(exit.code, int):
            code = exit.code or 0
        else:  # sys.exit("message"), as the interpreter prints it
            print(exit.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


#: how often the launcher's agent looks at its ranks (accelerate launch's --monitor_interval)
MONITOR_INTERVAL_S = 0.1


class TwoRanks:
    """``script`` (a path, or a name in tests/scripts/) in two ranks forked
    from :func:`forkserver`, run as ``accelerate launch`` runs them, handled
    as the ``Popen`` of that launch is: :meth:`poll`, :meth:`wait`,
    :meth:`communicate` (rank 0's then rank 1's stdout and stderr; exit
    status 0 when both ranks exit 0, else 1, as the launcher's), :meth:`kill`
    (SIGKILL to both ranks, as ``killpg`` of the launch's session). As the launcher's agent does, a rank that fails
    gets the other one a SIGTERM (a SIGKILL 30 s later)."""

    def __init__(self, script: str, *args, **extra_env):
        import tempfile

        import torch.distributed

        self.path = Path(script) if os.path.isabs(str(script)) else SCRIPTS / script
        self.args = ["run_two", str(self.path), *map(str, args)]
        # the ranks' store, here as in the launcher's agent: on a port the kernel chose (no
        # race with another test for a free one), alive until both ranks have ended
        self._store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self._logs = tempfile.TemporaryDirectory(prefix="hookloop-two-")
        self._files = [(os.path.join(self._logs.name, f"out-{r}"), os.path.join(self._logs.name, f"err-{r}"))
                       for r in (0, 1)]
        ctx = forkserver()
        self.ranks = [ctx.Process(target=_rank_main,
                                  args=(str(self.path), list(self.args[2:]),
                                        launch_env(r, self._store.port, **extra_env), os.getcwd(),
                                        *self._files[r]))
                      for r in (0, 1)]
        for rank in self.ranks:
            rank.start()
        self.returncode: int | None = None
        self._terminated_at: float | None = None
        self._output: tuple[str, str] | None = None

    def _supervise(self) -> None:
        """The agent's part: a failed rank ends the other (SIGTERM, then SIGKILL)."""
        if self._terminated_at is None:
            if any(r.exitcode not in (None, 0) for r in self.ranks):
                self._terminated_at = time.monotonic()
                for rank in self.ranks:
                    if rank.exitcode is None:
                        rank.terminate()
        elif time.monotonic() > self._terminated_at + 30:
            self.kill()

    def poll(self) -> int | None:
        self._supervise()
        if self.returncode is None and all(r.exitcode is not None for r in self.ranks):
            self.returncode = 0 if all(r.exitcode == 0 for r in self.ranks) else 1
            self._output = self._read()
            self._logs.cleanup()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status; subprocess.TimeoutExpired past ``timeout`` (the
        ranks run on). Looks at the ranks every MONITOR_INTERVAL_S, as the
        launcher's agent does: a rank that fails a moment after the other
        still reports its own error, as under ``accelerate launch``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout, output=self.output())
            time.sleep(MONITOR_INTERVAL_S)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.wait(timeout)
        return self.output(), None

    def output(self) -> str:
        """What both ranks wrote so far (all of it, once both ended): their
        stdout, then their stderr."""
        return "".join(self.streams())

    def streams(self) -> tuple[str, str]:
        """Rank 0's then rank 1's stdout; the same of stderr."""
        return self._output if self._output is not None else self._read()

    def _read(self) -> tuple[str, str]:
        def read(path):
            return Path(path).read_text(errors="replace") if os.path.exists(path) else ""

        return ("".join(read(out) for out, _ in self._files), "".join(read(err) for _, err in self._files))

    def kill(self) -> None:
        for rank in self.ranks:
            if rank.exitcode is None:
                rank.kill()
        for rank in self.ranks:
            rank.join()


def run_two(script: str, *args, timeout: float = TIMEOUT_S, check: bool = False,
            **extra_env) -> subprocess.CompletedProcess:
    """:class:`TwoRanks`, to its end: a CompletedProcess with the exit
    status, rank 0's then rank 1's stdout, and the same of stderr. Past
    ``timeout`` both ranks are killed: subprocess.TimeoutExpired, as
    ``subprocess.run`` raises."""
    run = TwoRanks(script, *args, **extra_env)
    try:
        code = run.wait(timeout)
    except subprocess.TimeoutExpired:
        run.kill()
        run.poll()
        raise subprocess.TimeoutExpired(run.args, timeout, *run.streams()) from None
    stdout, stderr = run.streams()
    if check and code != 0:
        raise AssertionError(f"{run.path.name} {' '.join(run.args[2:])}: exit statuses "
                             f"{[r.exitcode for r in run.ranks]}\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(run.args, code, stdout, stderr)


def two_ranks(script: str, *args, timeout: float = TIMEOUT_S) -> tuple[int | None, str]:
    """:func:`run_two`'s exit status (None: it hung and was killed) and output,
    as :func:`accelerate_two` returns them."""
    try:
        done = run_two(script, *args, timeout=timeout)
    except subprocess.TimeoutExpired as hung:
        return None, f"{hung.output or ''}{hung.stderr or ''}"
    return done.returncode, done.stdout + done.stderr


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ACCELERATE_USE_CPU", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _descendants(pid: int) -> list[int]:
    """``pid``'s child processes, theirs, ... (from /proc: torchrun starts the
    ranks in sessions of their own, which killing the launcher's group misses)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def _kill(process) -> None:
    for pid in [*_descendants(process.pid), process.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait(processes, timeout) -> tuple[list[int | None], str]:
    outputs, codes = [], []
    for process in processes:
        try:
            outputs.append(process.communicate(timeout=timeout)[0])
            codes.append(process.returncode)
        except subprocess.TimeoutExpired:
            for p in processes:
                _kill(p)
            outputs.append(process.communicate()[0])
            codes.append(None)  # hung
    return codes, "\n".join(outputs)


def accelerate_two(script: str, *args, timeout: float = TIMEOUT_S) -> tuple[int | None, str]:
    """The launcher's exit status (None: it hung and was killed) and output."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", "0", str(SCRIPTS / script), *map(str, args)]
    process = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    codes, output = _wait([process], timeout)
    return codes[0], output


def two_machines(script: str, *args, timeout: float = TIMEOUT_S) -> tuple[list[int | None], str]:
    """Each process's exit status (None: hung, killed) and their output."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    processes = [
        subprocess.Popen([sys.executable, str(SCRIPTS / script), *map(str, args)],
                         env=_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                                  GROUP_RANK=str(r), NODE_RANK=str(r), MASTER_ADDR="127.0.0.1",
                                  MASTER_PORT=str(port)),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
        for r in (0, 1)
    ]
    return _wait(processes, timeout)
