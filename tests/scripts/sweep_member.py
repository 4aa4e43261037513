"""A member of a sweep for tests/checkpointing/test_run_lock.py: a tiny run in
a shared working directory, with the default run folders
(``./checkpoints/version_<N>``), started as a forked process
(:func:`member`, through tests/scripts/runner.py's forkserver).

``together`` makes the start race exact: the first time this process picks a
run folder name (``next_run_name``), it writes ``chose-<tag>`` into the
working directory and waits until ``together`` members did, so that every
member computes the same ``version_N`` before any creates it. The member
then writes ``result-<tag>.json``: its run id, the folder it wrote into, its
pid and learning rate.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def _barrier(workdir: Path, tag: str, together: int):
    from hookloop import checkpointing

    modules = [checkpointing]
    try:
        from hookloop.checkpointing import store as layout
    except ImportError:  # hookloop 0.2: one module
        pass
    else:
        modules.append(layout)
    original = modules[-1].next_run_name
    state = {"waited": False}

    def next_run_name(base):
        name = original(base)
        if not state["waited"]:
            state["waited"] = True
            (workdir / f"chose-{tag}").write_text(name)
            deadline = time.monotonic() + 60
            while len(list(workdir.glob("chose-*"))) < together and time.monotonic() < deadline:
                time.sleep(0.005)
        return name

    for module in modules:
        module.next_run_name = next_run_name


def main(workdir, tag, lr, together=0, resume=False, epochs=1):
    import torch

    from hookloop.plugins import Checkpoint
    from hookloop.testing import no_installed_plugins, tiny_loop

    workdir = Path(workdir)
    os.chdir(workdir)
    torch.set_num_threads(1)
    if together:
        _barrier(workdir, tag, together)
    checkpoint = Checkpoint(every_steps=2)
    with no_installed_plugins():
        loop = tiny_loop([checkpoint], scheduler=False, resume_from="latest" if resume else None)
    for group in loop.networks["model"].optimizer.param_groups:
        group["lr"] = lr
    loop.fit(epochs=epochs)
    from hookloop.checkpointing import read_manifest

    (workdir / f"result-{tag}.json").write_text(json.dumps({
        "run_id": read_manifest(checkpoint.last_saved).get("run_id"),
        "dir": str(checkpoint.directory(loop)), "pid": os.getpid(),
        "lr": lr, "resumed_from": str(loop.resumed_from),
    }))
    loop.close()


def member(args, log):
    """Entry point of a forked member: output to ``log``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    main(*args)
