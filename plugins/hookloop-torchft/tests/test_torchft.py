"""hookloop-torchft on this machine: a lighthouse and two replica groups (gloo, CPU).

- Groups of one process: group 1 is SIGKILLed at about update 10 and started
  again 5 s later: group 0 keeps committing updates while group 1 is down (no
  stop, no restart), group 1 recovers from its peer (it has no checkpoint to
  read), both reach the requested number of updates with bitwise-equal
  parameters, every batch the group's share at the healthy group's position.
- Groups of two processes, each under ``torchrun --max-restarts=1``: a rank of
  group 1 dies, its torchrun restarts the group, which heals from group 0
  while group 0 trains on alone."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
STEPS = 200  # at 0.1 s an update: group 0 still trains when group 1 is back (its start takes seconds)
PATIENCE_S = 240


def lines(file: Path) -> list[dict]:
    return [json.loads(line) for line in file.read_text().splitlines()] if file.exists() else []


def group(out: Path, gid: int, lighthouse: str, log_name: str, *, steps: int = STEPS, launcher=(),
          args=()) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(TORCHFT_LIGHTHOUSE=lighthouse, REPLICA_GROUP_ID=str(gid), NUM_REPLICA_GROUPS="2",
               OMP_NUM_THREADS="1", HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # (torch 2.13's restarts: docs/distributed.md)
    return subprocess.Popen([sys.executable, *launcher, str(HERE / "ft_run.py"), str(out), "--max-steps", str(steps),
                             "--step-sleep", "0.1", *args], env=env, stdout=open(out / log_name, "w"),
                            stderr=subprocess.STDOUT)


@contextlib.contextmanager
def lighthouse_and_groups():
    """A lighthouse in this process (``torchft_lighthouse`` is the same server as a
    command) and the list of group processes the test starts, each killed at the end."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, quorum_tick_ms=50, join_timeout_ms=2000,
                                  heartbeat_timeout_ms=1500)
    processes: list[subprocess.Popen] = []
    try:
        yield lighthouse.address(), processes
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
        lighthouse.shutdown()


def finish(process: subprocess.Popen, log: Path) -> None:
    assert process.wait(timeout=PATIENCE_S) == 0, log.read_text()[-3000:]


def bitwise_equal_parameters(a_out: Path, b_out: Path) -> bool:
    pa, pb = (torch.load(o / "params.pt", weights_only=True) for o in (a_out, b_out))
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


def share(gid: int, epoch: int) -> list[list[int]]:
    """The batches of replica group ``gid``'s share of ft_run.py's 256 examples in ``epoch``."""
    from torch.utils.data import TensorDataset

    import hookloop_torchft

    sampler = hookloop_torchft.replica_share(TensorDataset(torch.zeros(256)), replica_group=gid,
                                             num_replica_groups=2)
    sampler.set_epoch(epoch)
    order = list(sampler)
    return [order[i:i + 8] for i in range(0, len(order), 8)]


def wait_for(condition, what, processes, timeout=PATIENCE_S):
    deadline = time.monotonic() + timeout
    while not condition():
        for p in processes:
            assert p.poll() is None or p.returncode == 0, f"a group exited {p.returncode} before {what}"
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_replica_group_killed_and_restarted_recovers_from_its_peer_while_the_other_trains_on(tmp_path):
    a_out, b_out = tmp_path / "group0", tmp_path / "group1"
    with lighthouse_and_groups() as (address, processes):
        a = group(a_out, 0, address, "first.log")
        b = group(b_out, 1, address, "first.log")
        processes += [a, b]
        wait_for(lambda: any(r["global_step"] >= 10 and r["participants"] == 2 for r in lines(b_out / "records.jsonl")),
                 "update 10 of both groups", processes)
        b.send_signal(signal.SIGKILL)
        b.wait()
        killed_at = time.time()
        killed_step = max(r["global_step"] for r in lines(b_out / "records.jsonl"))
        time.sleep(5)
        during = [r for r in lines(a_out / "records.jsonl") if r["time"] > killed_at]
        restarted_at = time.time()
        b2 = group(b_out, 1, address, "second.log")
        processes.append(b2)
        finish(a, a_out / "first.log")
        finish(b2, b_out / "second.log")
    # group 0 trained on alone while group 1 was down: updates committed with one group
    committed_alone = [r["global_step"] for r in during if r["participants"] == 1]
    assert len(committed_alone) >= 10 and committed_alone == sorted(set(committed_alone)), during
    assert committed_alone[0] <= killed_step + 2  # at once, not after a restart
    run_a, run_b = (json.loads((o / "run.json").read_text()) for o in (a_out, b_out))
    assert run_a["global_step"] == run_b["global_step"] == STEPS
    # group 1's second process healed from group 0: it started at group 0's update, not 0
    second = [r for r in lines(b_out / "records.jsonl") if r["time"] > killed_at + 5]
    assert second[0]["global_step"] > killed_step and second[0]["participants"] == 2
    assert not list(tmp_path.rglob("hookloop.json"))  # no checkpoint anywhere: healed from the peer
    # every batch of each group is its share's, at its position: group 1 rejoined at group 0's
    for gid, out in ((0, a_out), (1, b_out)):
        for r in lines(out / "records.jsonl"):
            assert r["indices"] == share(gid, r["epoch"])[r["step_in_epoch"] - 1], (gid, r)
    position = {r["global_step"]: (r["epoch"], r["step_in_epoch"]) for r in lines(a_out / "records.jsonl")}
    assert all(position[r["global_step"]] == (r["epoch"], r["step_in_epoch"]) for r in second)
    assert bitwise_equal_parameters(a_out, b_out)
    times = [r["time"] for r in lines(a_out / "records.jsonl")]
    pauses = [b - a for a, b in zip(times, times[1:])]
    print(json.dumps({"group0_discarded": run_a["discarded"], "group0_seconds": round(run_a["seconds"], 2),
                      "group0_longest_pause_s": round(max(pauses), 3), "group0_median_update_s":
                      round(sorted(pauses)[len(pauses) // 2], 3), "killed_at_step": killed_step,
                      "committed_alone": len(committed_alone), "group1_healed_at": second[0]["global_step"],
                      "group1_start_to_first_update_s": round(second[0]["time"] - restarted_at, 2)}))


@pytest.mark.slow
def test_a_group_of_two_processes_restarted_by_torchrun_heals_from_the_other_group(tmp_path):
    steps = 60
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1")
    a_out, b_out = tmp_path / "group0", tmp_path / "group1"
    with lighthouse_and_groups() as (address, processes):
        processes += [group(a_out, 0, address, "agent.log", steps=steps, launcher=torchrun),
                      group(b_out, 1, address, "agent.log", steps=steps, launcher=torchrun, args=("--kill-at", "10"))]
        for p, out in zip(processes, (a_out, b_out)):
            finish(p, out / "agent.log")
    assert (b_out / "killed").read_text() == "10"
    after = [r["global_step"] for r in lines(b_out / "records.jsonl") if r["global_step"] > 10]  # restarted
    alone = sorted({r["global_step"] for r in lines(a_out / "records.jsonl")
                    if r["participants"] == 1 and r["global_step"] > 10})
    assert alone and alone[0] <= 12  # group 0 trained on at once, alone
    assert after and min(after) - 1 in alone  # group 1 healed from group 0's update, not from 0
    for gid, out in ((0, a_out), (1, b_out)):
        rows = lines(out / "records.jsonl")
        assert {r["rank"] for r in rows} == {0, 1} and max(r["global_step"] for r in rows) == steps
        for r in rows:  # rank r trains batch r of each pair of its group's share (Accelerate's split)
            batches = share(gid, r["epoch"])
            assert r["indices"] == batches[2 * (r["step_in_epoch"] - 1) + r["rank"]], (gid, r)
    assert bitwise_equal_parameters(a_out, b_out)
