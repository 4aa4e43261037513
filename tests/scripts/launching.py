"""Start a script in two processes for the tests, never waiting forever.

:func:`accelerate_two`: ``accelerate launch --multi_gpu --num_processes 2``
on this CPU machine (the script asks for ``Accelerator(cpu=True)``, or does
not, to show what happens then). :func:`two_machines`: two plain ``python``
processes with the environment ``torchrun --nnodes 2 --nproc_per_node 1``
gives them, as if on two machines: each is its own machine's (local) main
process. Both return ``(exit statuses, output)`` and kill every process of
the run once ``timeout`` seconds have passed (a hang fails the test).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
#: a run that takes longer hangs: killed, and the test fails
TIMEOUT_S = 90


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
