"""A save that fails on rank 1 only, two processes on a CPU
(tests/checkpointing/test_guarantees_0_5.py).

    accelerate launch --multi_gpu --num_processes 2 rank_fails_in_save.py OUT
        --format sharded|plain [--fail dcp-write|rng-write|none]

Trains the MLP of sharded.py for one epoch of 8 updates with
``Checkpoint(dir=OUT/checkpoints, every_steps=3)`` and
``resume_from="latest"``: ``--format sharded``: the user shards it with
``fully_shard`` (a DCP save, a collective, inside every save), under
``Loop(prepare=False)``; ``--format plain``: Accelerate's DDP. From the
``before_save_checkpoint`` of ``step-00000006`` on, rank 1 fails (the
save of ``step-00000003`` lands first):

``dcp-write``
    torch.distributed.checkpoint's ``FileSystemWriter.write_data`` raises
    ``OSError(ENOSPC)`` (rank 1's shard cannot be written: inside DCP's
    collective save);
``rng-write``
    writing rank 1's random states, ``random_states_1.pkl``, raises
    ``OSError(ENOSPC)`` (a file only rank 1 writes, in every format).

Every rank writes OUT/saving-<rank>.json (``{"at": time.time(), "pid"}``) when that
save begins, and OUT/result-<rank>.json when its fit ends:
``{"error": class name or None, "checkpoint_error": bool, "message",
"elapsed": seconds since the save began}``; then it exits 0 (the test
judges). A run with ``--fail none`` resumes and trains to the epoch's end;
the main process writes OUT/resumed.json (where it started, where it ended).
"""

import argparse
import errno
import json
import os
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop, hookimpl
from hookloop.checkpointing import CheckpointError
from hookloop.plugins import Checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sharded import mlp  # noqa: E402 - the same model as the other sharded tests

FAILING_SAVE = "step-00000006"
RNG_FILE = "random_states_1.pkl"  # Accelerate's name for rank 1's random states


def write_json(path: Path, doc) -> None:
    # written whole, then renamed: the test polling for it never reads half a file
    path.with_name("." + path.name).write_text(json.dumps(doc))
    os.replace(path.with_name("." + path.name), path)


class Fault:
    """Rank 1's failure, armed at the failing save's ``before_save_checkpoint``
    (a public hook: every process calls it before the save begins)."""

    name = "fault"

    def __init__(self, out: Path, kind: str, rank: int):
        self.out, self.kind, self.rank = out, kind, rank
        self.armed = False
        self.began: float | None = None
        if kind != "none" and rank == 1:
            self._install()

    @hookimpl
    def before_save_checkpoint(self, loop, checkpoint):
        if Path(checkpoint).name == FAILING_SAVE and self.kind != "none":
            self.began = time.time()
            write_json(self.out / f"saving-{self.rank}.json", {"at": self.began, "pid": os.getpid()})
            self.armed = self.rank == 1

    def _error(self, what: str) -> OSError:
        return OSError(errno.ENOSPC, f"No space left on device (injected on rank 1: {what})")

    def _install(self) -> None:
        fault = self
        if self.kind == "dcp-write":
            # DCP's storage writer for a folder path is FileSystemWriter (dcp.save's default, and
            # what Accelerate's FSDP save passes): its write_data writes this rank's shard files,
            # inside DCP's collective save. A class attribute: subclasses see it too.
            from torch.distributed.checkpoint import FileSystemWriter

            original = FileSystemWriter.write_data

            def write_data(self, *args, **kwargs):
                if fault.armed:
                    raise fault._error("DCP FileSystemWriter.write_data")
                return original(self, *args, **kwargs)

            FileSystemWriter.write_data = write_data
        elif self.kind == "rng-write":
            # random_states_<rank>.pkl is a file of Accelerate's checkpoint format (its
            # load_state reads it), a torch pickle: whoever writes it calls torch.save, with
            # its path or a file object; a writer that opens the file itself opens it by name
            import builtins

            def target(f) -> bool:
                name = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", getattr(f, "path", ""))
                return fault.armed and os.path.basename(os.fspath(name) if name else "") == RNG_FILE

            save, open_, os_open = torch.save, builtins.open, os.open

            def failing_save(obj, f, *args, **kwargs):
                if target(f):
                    raise fault._error(f"torch.save of {RNG_FILE}")
                return save(obj, f, *args, **kwargs)

            def failing_open(file, *args, **kwargs):
                if isinstance(file, (str, os.PathLike)) and target(file):
                    raise fault._error(f"open of {RNG_FILE}")
                return open_(file, *args, **kwargs)

            def failing_os_open(path, *args, **kwargs):
                if target(path):
                    raise fault._error(f"os.open of {RNG_FILE}")
                return os_open(path, *args, **kwargs)

            torch.save, builtins.open, os.open = failing_save, failing_open, failing_os_open
        else:
            raise SystemExit(f"rank_fails_in_save.py: unknown --fail {self.kind!r}")


class SetEpoch:
    """A DistributedSampler's epoch (a plain DataLoader has no set_epoch)."""

    name = "set_epoch"

    def __init__(self, sampler):
        self.sampler = sampler

    @hookimpl
    def on_fit_start(self, loop):
        if self.sampler is not None:  # a resumed epoch draws its order before on_epoch_start
            self.sampler.set_epoch(loop.state.epoch)

    @hookimpl
    def on_epoch_start(self, loop, epoch):
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--format", default="sharded", choices=["sharded", "plain"])
    parser.add_argument("--fail", default="dcp-write", choices=["dcp-write", "rng-write", "none"])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == 2, accelerator.num_processes
    rank = accelerator.process_index
    set_seed(0)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    model = mlp()
    sampler = None
    if args.format == "sharded":
        from torch.distributed.fsdp import fully_shard
        from torch.utils.data.distributed import DistributedSampler

        for layer in (model[0], model[3]):
            fully_shard(layer)
        fully_shard(model)
        sampler = DistributedSampler(TensorDataset(x, y), num_replicas=2, rank=rank, seed=3)
        data = DataLoader(TensorDataset(x, y), batch_size=4, sampler=sampler,
                          generator=torch.Generator().manual_seed(5))
    else:
        data = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)  # (sharded: over the sharded parameters)
    fault = Fault(args.out, args.fail, rank)
    loop = Loop(model=model, optimizer=optimizer, train_data=data, accelerator=accelerator,
                plugins=[Checkpoint(dir=args.out / "checkpoints", every_steps=3, keep_last=None, signals=None),
                         SetEpoch(sampler), fault],
                block=["progress"], resume_from="latest", prepare=args.format == "plain")
    start = loop.state.global_step
    error = None
    try:
        loop.fit(epochs=1)
    except BaseException as exc:  # noqa: BLE001 - reported to the test, which judges it (DCP raises BaseExceptions)
        error = exc
    if args.fail != "none":
        write_json(args.out / f"result-{rank}.json", {
            "error": None if error is None else type(error).__name__,
            "checkpoint_error": isinstance(error, CheckpointError),
            "message": "" if error is None else str(error),
            "elapsed": None if fault.began is None else time.time() - fault.began,
            "global_step": loop.state.global_step})
    elif error is not None:
        raise error
    elif accelerator.is_main_process:
        write_json(args.out / "resumed.json", {"started_at": start, "global_step": loop.state.global_step,
                                               "resumed_from": str(loop.resumed_from)})
    try:
        loop.close()
    except Exception as exc:  # noqa: BLE001 - the result is written: the test judges the fit
        print(f"rank {rank}: loop.close() raised {type(exc).__name__}: {exc}", file=sys.stderr)
    if args.fail != "none":  # (a process group left mid-collective by the failure must not hold the exit)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
