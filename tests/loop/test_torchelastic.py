"""TorchElastic (``torchrun``) as users run it, on two CPU processes
(tests/scripts/torchelastic_run.py: ``Loop(..., resume_from="latest")``):

- a worker SIGKILLed under ``--max-restarts``: the agent restarts the group,
  which resumes from ``latest`` and ends bit for bit where an uninterrupted
  run ends;
- a node lost under ``--nnodes=1:2`` (two agents, the rendezvous store in a
  process of its own): the other agent's group restarts alone and continues
  on one process from the last checkpoint; every example of every epoch is
  drawn, only the updates after that checkpoint are redone;
- a node joining under ``--nnodes=1:2``: the running agent stops its worker
  with SIGTERM to re-rendezvous; that stop is a preemption (a checkpoint at
  the next safe point), and the group of two continues from it, no update
  redone.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from launching import _descendants, _env, _kill
from paths import SCRIPTS

pytestmark = pytest.mark.slow
SCRIPT = SCRIPTS / "torchelastic_run.py"
PATIENCE_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: torch 2.13's agents publish the shared store's address for their first round only: an
#: agent that stays rank 0 through a membership change never publishes it for the next
#: round, and a joining agent waits for it until the rendezvous times out. Not sharing the
#: rendezvous store with the workers (a store of their own each round) avoids it.
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun(out: Path, *options, args=()) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", *map(str, options), str(SCRIPT), str(out),
           "--ckpt", str(out.parent / "checkpoints"), *map(str, args)]
    log = open(out / f"agent-{time.monotonic_ns()}.log", "w")
    return subprocess.Popen(cmd, env=_env(**ELASTIC_ENV), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def finish(process: subprocess.Popen) -> int:
    try:
        return process.wait(timeout=PATIENCE_S)
    except subprocess.TimeoutExpired:
        _kill(process)
        raise AssertionError("torchrun hung") from None


def logs(out: Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(out.glob("agent-*.log")))


def lines(file: Path) -> list[dict]:
    return [json.loads(line) for line in file.read_text().splitlines()] if file.exists() else []


def until(condition, process_list, what: str, timeout: float = PATIENCE_S):
    deadline = time.monotonic() + timeout
    while not condition():
        dead = [p for p in process_list if p.poll() is not None]
        assert not dead, f"an agent ended (exit {dead[0].returncode}) before {what}"
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def params(out: Path) -> dict:
    return torch.load(out / "params.pt", weights_only=True)


def every_example_of_every_epoch(records: list[dict], epochs: int) -> bool:
    seen = {e: set() for e in range(epochs)}
    for r in records:
        seen[r["epoch"]].update(r["indices"])
    return all(seen[e] == set(range(64)) for e in range(epochs))


class Store:
    """The c10d rendezvous of two agents: the first agent started hosts its
    store (``own_process``: a process of its own hosts it, as a job's launcher
    host keeps it, so that losing either node's agent does not lose it)."""

    def __init__(self, own_process: bool):
        self.port, self.process = free_port(), None
        if own_process:
            self.process = subprocess.Popen([sys.executable, "-c", (
                "import time, torch.distributed as d; "
                f"s = d.TCPStore('127.0.0.1', {self.port}, is_master=True, wait_for_workers=False); "
                "print('ready', flush=True); time.sleep(3600)")], stdout=subprocess.PIPE, text=True)
            assert self.process.stdout.readline().strip() == "ready"
        self.agents = 0

    def agent(self, out: Path, *args) -> subprocess.Popen:
        host = "false" if self.process is not None or self.agents else "true"
        self.agents += 1
        return torchrun(out, "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=3", "--rdzv-backend=c10d",
                        f"--rdzv-endpoint=127.0.0.1:{self.port}", "--rdzv-id=hookloop-test",
                        f"--rdzv-conf=is_host={host},last_call_timeout=2,join_timeout=120",
                        "--monitor-interval=0.2", args=args)

    def close(self):
        if self.process is not None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def store(request):
    s = Store(own_process=getattr(request, "param", True))
    yield s
    s.close()


def test_a_worker_killed_under_max_restarts_resumes_bit_for_bit(tmp_path):
    args = ("--epochs", "3", "--every-steps", "3")
    ref = torchrun(tmp_path / "ref" / "run", "--standalone", "--nproc-per-node=2", args=args)
    assert finish(ref) == 0, logs(tmp_path / "ref" / "run")
    out = tmp_path / "run" / "run"
    # rank 1 dies after batch 7 (update 7 of 12; the last checkpoint: update 6)
    run = torchrun(out, "--standalone", "--nproc-per-node=2", "--max-restarts=3",
                   args=(*args, "--kill-once", "1:7"))
    assert finish(run) == 0, logs(out)
    starts = lines(out / "starts.jsonl")
    assert [(s["global_step"], s["num_processes"], s["restart"]) for s in starts] == [(0, 2, 0), (6, 2, 1)]
    assert starts[1]["resumed_from"] == "step-00000006"
    reference, final = params(tmp_path / "ref" / "run"), params(out)
    assert [k for k in reference if not torch.equal(reference[k], final[k])] == []


def test_a_node_lost_under_nnodes_1_2_continues_on_one_process(tmp_path, store):
    out = tmp_path / "job" / "run"  # (both nodes': whichever is rank 0 records)
    args = ("--epochs", "3", "--every-steps", "3", "--step-sleep", "0.1")
    a, b = store.agent(out, *args), store.agent(out, *args)
    try:
        # both running as one group of two, past the checkpoint of update 3
        until(lambda: any(r["global_step"] >= 5 for r in lines(out / "records.jsonl")), [a, b],
              "update 5 of the group of two")
        starts = lines(out / "starts.jsonl")
        assert starts[0]["num_processes"] == 2
        for pid in [*_descendants(b.pid), b.pid]:  # node b lost: its agent and its worker
            os.kill(pid, signal.SIGKILL)
        killed_after = max(r["global_step"] for r in lines(out / "records.jsonl"))
        b.wait()
        assert finish(a) == 0, logs(out)
    finally:
        _kill(a)
        _kill(b)
    starts, records = lines(out / "starts.jsonl"), lines(out / "records.jsonl")
    last = starts[-1]
    # resumed on one process from the last checkpoint (every 3 updates and every epoch end)
    assert last["num_processes"] == 1 and 0 < last["global_step"] and killed_after - last["global_step"] <= 3
    trained = [r["global_step"] for r in records]
    redone = sorted({s for s in trained if trained.count(s) > 1})
    assert all(s > last["global_step"] for s in redone), (redone, last)  # only after the checkpoint
    assert sorted(set(trained)) == list(range(1, 13))  # 4 updates an epoch on 1 or 2 processes
    assert json.loads((out / "run.json").read_text())["num_processes"] == 1
    assert every_example_of_every_epoch(records, 3)


@pytest.mark.parametrize("store", [False], indirect=True)  # (the first agent, which stays, hosts it)
def test_a_node_joining_under_nnodes_1_2_is_a_preemption_and_nothing_is_redone(tmp_path, store):
    out = tmp_path / "job" / "run"
    args = ("--epochs", "6", "--every-steps", "100", "--step-sleep", "0.4")  # 24 updates, ~10 s alone
    a = store.agent(out, *args)
    b = None
    try:
        until(lambda: any(r["global_step"] >= 3 for r in lines(out / "records.jsonl")), [a],
              "update 3 of the group of one")
        assert lines(out / "starts.jsonl")[0]["num_processes"] == 1
        b = store.agent(out, *args)  # a second node joins
        assert finish(a) == 0, logs(out)
        assert finish(b) == 0, logs(out)
    finally:
        _kill(a)
        if b is not None:
            _kill(b)
    starts, records = lines(out / "starts.jsonl"), lines(out / "records.jsonl")
    assert [s["num_processes"] for s in starts] == [1, 2], starts
    resumed = starts[1]
    # the agent's SIGTERM was a preemption: a checkpoint at the next safe point, status 75
    assert "SIGTERM received: saved" in logs(out) and "exiting with status 75" in logs(out)
    doc = json.loads((tmp_path / "job" / "checkpoints" / resumed["resumed_from"] / "hookloop.json").read_text())
    assert doc["loop"]["global_step"] == resumed["global_step"] > 0
    trained = [r["global_step"] for r in records]
    assert trained == list(range(1, 25)), "an update was redone or lost"
    assert json.loads((out / "run.json").read_text())["num_processes"] == 2
    assert every_example_of_every_epoch(records, 6)
