"""What one failure costs: a restart from the last checkpoint (``torchrun
--max-restarts``) against per-step fault tolerance (``hookloop-torchft``), on
this machine's CPUs.

    python benchmarks/failure_cost.py [--kill-at 15] [--every 10] [--sleep 0.1]

Both runs train a tiny MLP for 48 updates, each update made ``--sleep`` seconds
longer so that an update costs what it costs on a real job, relative to a
start-up; a process is SIGKILLed after update ``--kill-at``:

- ``torchrun --standalone --nproc-per-node=2 --max-restarts=1``
  (tests/scripts/torchelastic_run.py, ``Checkpoint(every_steps=--every)``
  and at every epoch end, 4 updates; ``resume_from="latest"``): rank 1 kills itself; the agent stops rank 0,
  starts both again, they resume from the last checkpoint and redo the
  updates since it.
- two replica groups of one process, ``FaultTolerant()``
  (plugins/hookloop-torchft/tests/ft_run.py) and a lighthouse: group 1 is
  killed and not started again; group 0 trains on.

Printed for each: the updates redone, the updates discarded, the seconds the
job lost (the time from the last update before the kill to the first update
past it, less one update), and the wall time against the same run without a
kill. Needs ``torchft`` and ``hookloop-torchft`` (installed, or from
plugins/ when not).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ELASTIC = ROOT / "tests" / "scripts" / "torchelastic_run.py"
FT_RUN = ROOT / "plugins" / "hookloop-torchft" / "tests" / "ft_run.py"
UPDATES = 48


def env(**extra) -> dict:
    out = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    try:
        import hookloop_torchft  # noqa: F401
    except ImportError:
        out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "plugins" / "hookloop-torchft" / "src"),
                                                          out.get("PYTHONPATH")]))
    return {**out, "OMP_NUM_THREADS": "1", "HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD": "1", **extra}


def lines(file: Path) -> list[dict]:
    return [json.loads(line) for line in file.read_text().splitlines()] if file.exists() else []


def lost(records: list[dict], kill_at: int) -> tuple[int, float]:
    """(updates trained twice, seconds from update ``kill_at`` to the first update past it, less one)."""
    steps = [r["global_step"] for r in records]
    redone = len(steps) - len(set(steps))
    first = {}
    for r in records:
        first.setdefault(r["global_step"], r["time"])
    times = [first[s] for s in sorted(first)]
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    median = gaps[len(gaps) // 2]
    return redone, first[kill_at + 1] - first[kill_at] - median


def torchrun(out: Path, args: argparse.Namespace, kill: bool) -> dict:
    epochs = UPDATES // 4  # (64 examples in global batches of 16)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           str(ELASTIC), str(out), "--ckpt", str(out / "checkpoints"), "--epochs", str(epochs),
           "--every-steps", str(args.every), "--step-sleep", str(args.sleep)]
    if kill:
        cmd += ["--kill-once", f"1:{args.kill_at}"]
    started = time.monotonic()
    done = subprocess.run(cmd, env=env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"), capture_output=True, text=True,
                          timeout=600)  # (the variable: torch 2.13's restarts, docs/distributed.md)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    wall = time.monotonic() - started
    records = lines(out / "records.jsonl")
    row = {"wall_s": wall, "discarded": 0}
    if kill:
        row["redone"], row["lost_s"] = lost(records, args.kill_at)
    return row


def torchft(out: Path, args: argparse.Namespace, kill: bool) -> dict:
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, quorum_tick_ms=50, join_timeout_ms=2000,
                                  heartbeat_timeout_ms=1500)
    groups = []
    try:
        started = time.monotonic()
        for gid in (0, 1):
            (out / str(gid)).mkdir(parents=True)
            groups.append(subprocess.Popen(
                [sys.executable, str(FT_RUN), str(out / str(gid)), "--max-steps", str(UPDATES),
                 "--step-sleep", str(args.sleep)],
                env=env(TORCHFT_LIGHTHOUSE=lighthouse.address(), REPLICA_GROUP_ID=str(gid), NUM_REPLICA_GROUPS="2"),
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        if kill:
            while not any(r["global_step"] >= args.kill_at for r in lines(out / "1" / "records.jsonl")):
                assert groups[1].poll() is None, "group 1 ended before the kill"
                time.sleep(0.01)
            groups[1].send_signal(signal.SIGKILL)
        assert groups[0].wait(timeout=600) == 0, "group 0 failed"
        wall = time.monotonic() - started
    finally:
        for p in groups:
            if p.poll() is None:
                p.kill()
        lighthouse.shutdown()
    records = lines(out / "0" / "records.jsonl")
    row = {"wall_s": wall, "discarded": json.loads((out / "0" / "run.json").read_text())["discarded"]}
    if kill:
        killed_at = max(r["global_step"] for r in lines(out / "1" / "records.jsonl"))
        row["redone"], row["lost_s"] = lost(records, killed_at)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kill-at", type=int, default=15)
    parser.add_argument("--every", type=int, default=10, help="torchrun's run: a checkpoint every N updates")
    parser.add_argument("--sleep", type=float, default=0.1, help="seconds added to each update")
    args = parser.parse_args(argv)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, run in (("torchrun --max-restarts, resume from the last checkpoint", torchrun),
                          ("hookloop-torchft, two replica groups", torchft)):
            base = run(Path(tmp) / f"{run.__name__}-base", args, kill=False)
            killed = run(Path(tmp) / f"{run.__name__}-kill", args, kill=True)
            rows[name] = (base, killed)
    print(f"{UPDATES} updates of {args.sleep:.2f} s (+ the step), a process SIGKILLed after update {args.kill_at}; "
          f"torchrun's run checkpoints every {args.every} updates and every epoch end (4 updates)\n")
    print("| | updates redone | updates discarded | job time lost (s) | wall, killed / not killed (s) |")
    print("|---|---|---|---|---|")
    for name, (base, killed) in rows.items():
        print(f"| {name} | {killed['redone']} | {killed['discarded']} | {killed['lost_s']:.2f} "
              f"| {killed['wall_s']:.1f} / {base['wall_s']:.1f} |")


if __name__ == "__main__":
    main()
