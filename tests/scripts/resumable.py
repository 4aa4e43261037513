"""A resumable run for the kill-and-resume tests (tests/test_resume_kill.py,
tests/test_preemption.py, tests/test_resume_distributed.py).

    python resumable.py OUT [--strategy supervised|gan] [--accum K] [--epochs E]
                            [--every-steps N] [--pause WHERE] [--signal-check-every N]
                            [--data map|stream|stateful]

Trains (shuffled data, dropout, a warm-up schedule, gradient accumulation K;
``--data stream``: an ``IterableDataset`` without a length that draws a new
order from the global RNG at each pass, resumed by replaying it;
``--data stateful``: a stream with an order and a state of its own, as a
``datasets.IterableDataset`` has, through torchdata's ``StatefulDataLoader``,
resumed from the loader's state; ``--sampler numpy|named|stateful|hidden``:
map data drawn by a sampler of the user's own, with a numpy Generator, a
``torch.Generator`` named ``g``, torchdata's ``Stateful`` protocol, or a
generator hookloop cannot see; ``--stateful-loader``: Accelerate's
``use_stateful_dataloader=True``)
with ``Checkpoint(dir=OUT/checkpoints, every_steps=N)`` and
``resume_from="latest"``, then the main process writes OUT/params.pt, every
network's final parameters. Works alone or under ``accelerate launch
--multi_gpu --num_processes 2`` (``Accelerator(cpu=True)``).

``--pause`` stops the run at an exact point so the test can kill it there;
the script writes OUT/paused-<rank> (its pid, where) and sleeps until killed:

``step:K``
    in batch K's ``after_step`` (``micro_step`` K), before a checkpoint
    would be written;
``save:STAGE:K``
    inside the save of the checkpoint after update K (``global_step``, as
    checkpoints are named): ``write`` (Accelerate's files written, hookloop's
    not), ``publish`` (complete in ``.tmp-<name>``, not renamed), ``latest``
    (renamed, ``latest`` not yet updated);
``signal:K``
    in batch K, before its backward pass, until a signal arrives (the test
    sends it); then the run goes on;
``savesignal:STAGE:K``
    inside the save after update K, at STAGE (as ``save:``), until a signal
    arrives; then the save and the run go on;
``selfterm:K:R``
    rank R sends itself SIGTERM in batch K's ``after_step`` and goes on;
``load``
    inside ``load_checkpoint`` (start-up, ``resume_from``), until killed or
    signalled;
``predict:K``
    in ``eval_step`` of the K-th batch of the ``predict`` after ``fit``
    (``--predict``), until killed or signalled.

With ``--accum 2`` an update is two batches: batch K ends update K/2.

When stopped by a signal (in a fit, or outside one: start-up, ``--predict``),
each rank writes OUT/preempted-<rank>.json (the step it stopped after, the
checkpoint, where) before exiting with status 75.
"""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, IterableDataset, Sampler, TensorDataset

from hookloop import Loop, Network, hookimpl
from hookloop.checkpointing import codec, store as layout, writer
from hookloop.plugins import Checkpoint, GradClip
from hookloop.preemption import Preempted


def pause_here(out, rank, what, until=None):
    # written whole, then renamed: a test polling for the marker never reads it half-written
    (out / f".paused-{rank}").write_text(json.dumps({"pid": os.getpid(), "at": what}))
    os.replace(out / f".paused-{rank}", out / f"paused-{rank}")
    deadline = time.monotonic() + 120  # the test kills us long before
    while time.monotonic() < deadline:
        if until is not None and until():
            return
        time.sleep(0.01)
    sys.exit(f"resumable.py: nobody came to kill the paused run ({what})")


_LOOPS = []


def signalled(loop) -> bool:
    """Whether the preemption plugin of the run recorded a signal."""
    loop = loop or (_LOOPS[0] if _LOOPS else None)
    watcher = loop.plugins.get("preemption").watcher if loop is not None else None
    return watcher is not None and watcher.received is not None


class Pauser:
    """Holds the run at the point --pause names."""

    name = "pauser"

    def __init__(self, spec, out, checkpoint):
        self.kind, *rest = spec.split(":") if spec else ("", )
        self.args = rest
        self.out = out
        self.checkpoint = checkpoint

    @hookimpl
    def before_backward(self, loop, network):
        if self.kind == "signal" and loop.state.micro_step + 1 == int(self.args[0]):
            if network.name == next(iter(loop.networks)):
                rank = loop.accelerator.process_index
                pause_here(self.out, rank, "signal", until=lambda: signalled(loop))

    @hookimpl(wrapper=True)
    def eval_step(self, loop):
        if self.kind == "predict" and loop.state.stage == "predict":
            self.predicted = getattr(self, "predicted", 0) + 1
            if self.predicted == int(self.args[0]):
                pause_here(self.out, loop.accelerator.process_index, "predict")
        return (yield)

    @hookimpl
    def after_step(self, loop):
        step = loop.state.micro_step
        rank = loop.accelerator.process_index
        if self.kind == "step" and step == int(self.args[0]):
            pause_here(self.out, rank, f"step {step}")
        if self.kind == "selfterm" and step == int(self.args[0]) and rank == int(self.args[1]):
            os.kill(os.getpid(), signal.SIGTERM)


def pause_in_save(stage, step, out, rank, until=None):
    """Wrap the checkpointing function of ``stage`` to hold the save of
    step ``step`` there (until ``until()``, if given)."""
    module, target = {"write": (codec, "write_rank_file"), "publish": (writer, "publish"),
                      "latest": (layout, "write_latest")}[stage]
    original = getattr(module, target)

    def held(*args, **kwargs):
        name = str(args[-1] if stage == "latest" else args[0])
        if f"step-{step:08d}" in name:
            pause_here(out, rank, f"save {stage} {step}", until=until)
        return original(*args, **kwargs)

    setattr(module, target, held)


class Stream(IterableDataset):
    """Rows without a length: each pass draws a new order from the global
    torch RNG (so a resume must redraw it from the epoch's random state)."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __iter__(self):
        for i in torch.randperm(len(self.x)).tolist():
            yield self.x[i], self.y[i]


class SeededStream(IterableDataset):
    """A stream with its own order (seeded by its epoch, which the loop sets
    through ``set_epoch``) and state (epoch, position), as Hugging Face
    ``datasets.IterableDataset`` has: a ``StatefulDataLoader`` resumes it."""

    def __init__(self, x, y):
        self.x, self.y = x, y
        self.epoch, self.position, self._start = 0, 0, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def state_dict(self):
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state):
        self.epoch, self._start = state["epoch"], state["position"]

    def __iter__(self):
        order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(100 + self.epoch))
        start, self._start = self._start, 0
        for position in range(start, len(self.x)):
            self.position = position + 1
            i = int(order[position])
            yield self.x[i], self.y[i]


class NumpySampler(Sampler):
    """A permutation per pass from a numpy Generator of its own."""

    def __init__(self, n):
        self.n, self.rng = n, np.random.default_rng(0)

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(self.rng.permutation(self.n).tolist())


class NamedGeneratorSampler(NumpySampler):
    """A permutation per pass from a torch.Generator named ``g``, not ``generator``."""

    def __init__(self, n):
        self.n, self.g = n, torch.Generator().manual_seed(0)

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=self.g).tolist())


class StatefulSampler(NumpySampler):
    """torchdata's Stateful protocol: an order of its own per pass (a seed and
    the number of passes started) and its position in the pass; a pass
    interrupted is continued by ``load_state_dict`` then ``iter``."""

    def __init__(self, n):
        self.n, self.passes, self.yielded, self._continue_at = n, 0, 0, 0

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(1000 + self.passes)).tolist()
        self.passes += 1
        start, self._continue_at = self._continue_at, 0
        for self.yielded in range(start + 1, self.n + 1):
            yield order[self.yielded - 1]

    def state_dict(self):
        return {"passes": self.passes, "yielded": self.yielded}

    def load_state_dict(self, state):
        in_pass = 0 < state["yielded"] < self.n  # (a finished pass: the next starts afresh)
        self.passes = state["passes"] - in_pass
        self.yielded = self._continue_at = state["yielded"] if in_pass else 0


class HiddenStateSampler(NumpySampler):
    """Its generator inside another object: hookloop cannot see it."""

    def __init__(self, n):
        self.n, self.box = n, [np.random.default_rng(0)]

    def __iter__(self):
        return iter(self.box[0].permutation(self.n).tolist())


SAMPLERS = {"numpy": NumpySampler, "named": NamedGeneratorSampler, "stateful": StatefulSampler,
            "hidden": HiddenStateSampler}


def loader(args, x, y):
    if args.data == "map" and args.sampler:
        return DataLoader(TensorDataset(x, y), batch_size=8, sampler=SAMPLERS[args.sampler](len(x)))
    if args.data == "map":
        return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    if args.data == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(SeededStream(x, y), batch_size=8)
    return DataLoader(Stream(x, y), batch_size=8)


def mlp(i, o, dropout):
    return torch.nn.Sequential(torch.nn.Linear(i, 16), torch.nn.ReLU(), torch.nn.Dropout(dropout),
                               torch.nn.Linear(16, o))


def warmup(optimizer, total):
    return LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4) * max(0.1, 1 - s / total))


def build(args, accelerator, plugins):
    set_seed(0)
    if args.strategy == "gan":
        from hookloop.strategies import GAN

        angles = torch.rand(128) * 6.2832
        real = torch.stack([angles.cos(), angles.sin()], 1) * 2 + 0.05 * torch.randn(128, 2)
        data = DataLoader(TensorDataset(real), batch_size=16, shuffle=True)
        G, D = mlp(4, 2, 0.0), mlp(2, 1, 0.2)
        opt_g = torch.optim.Adam(G.parameters(), lr=2e-3)
        opt_d = torch.optim.Adam(D.parameters(), lr=2e-3)
        total = args.epochs * len(data)
        networks = {"generator": Network(G, opt_g, warmup(opt_g, total)),
                    "discriminator": Network(D, opt_d, warmup(opt_d, total))}
        return Loop(networks=networks, strategy=GAN(latent_dim=4), train_data=data,
                    plugins=plugins, accelerator=accelerator, block=["progress"],
                    resume_from="latest")
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    data = loader(args, x, y)
    model = mlp(8, 3, 0.2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = warmup(optimizer, args.epochs * 8)  # 64 rows, batch 8 (a stream has no len)
    return Loop(model=model, optimizer=optimizer, scheduler=scheduler, train_data=data,
                plugins=plugins, accelerator=accelerator, block=["progress"],
                resume_from="latest")


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--strategy", default="supervised", choices=["supervised", "gan"])
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--every-steps", type=int, default=3)
    parser.add_argument("--signal-check-every", type=int, default=10)
    parser.add_argument("--pause", default="")
    parser.add_argument("--data", default="map", choices=["map", "stream", "stateful"])
    parser.add_argument("--sampler", default="", choices=["", *SAMPLERS],
                        help="map data drawn by a sampler of the user's own")
    parser.add_argument("--stateful-loader", action="store_true",
                        help="Accelerate's use_stateful_dataloader=True (torchdata's StatefulDataLoader)")
    parser.add_argument("--predict", action="store_true", help="predict on the training data after fit")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from accelerate.utils import DataLoaderConfiguration

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accum, dataloader_config=(
        DataLoaderConfiguration(use_stateful_dataloader=args.data == "stateful" or args.stateful_loader)))
    rank = accelerator.process_index
    checkpoint = Checkpoint(dir=args.out / "checkpoints", every_steps=args.every_steps,
                            keep_last=3, signal_check_every=args.signal_check_every)
    if args.pause.startswith(("save:", "savesignal:")):
        kind, stage, step = args.pause.split(":")
        until = (lambda: signalled(None)) if kind == "savesignal" else None
        pause_in_save(stage, int(step), args.out, rank, until=until)
    if args.pause == "load":
        from hookloop import checkpointing

        load = checkpointing.load

        def held_load(*a, **kw):
            pause_here(args.out, rank, "load")
            return load(*a, **kw)

        checkpointing.load = held_load
    plugins = [GradClip(max_norm=1.0), checkpoint, Pauser(args.pause, args.out, checkpoint)]
    where, loop, start = "start-up", None, None
    try:
        loop = build(args, accelerator, plugins)
        _LOOPS.append(loop)
        start, where = loop.state.global_step, "fit"
        loop.fit(epochs=args.epochs)
        if args.predict:
            where = "predict"
            loop.predict(loop.train_data)
    except Preempted as stop:
        (args.out / f"preempted-{rank}.json").write_text(json.dumps({
            "step": stop.global_step, "code": stop.code, "checkpoint": str(stop.checkpoint),
            "signal": int(stop.signal), "started_at": start, "where": where,
        }))
        if where == "fit":  # every rank stopped at the same safe point
            accelerator.wait_for_everyone()
        if loop is not None:
            loop.close()
        raise
    if accelerator.is_main_process:
        torch.save({f"{name}.{k}": v.detach().clone()
                    for name, net in loop.networks.items()
                    for k, v in net.unwrapped.state_dict().items()}, args.out / "params.pt")
        (args.out / "run.json").write_text(json.dumps({
            "started_at": start, "resumed_from": str(loop.resumed_from),
            "global_step": loop.state.global_step, "num_processes": accelerator.num_processes,
        }))
    loop.close()


def child(argv, log):
    """Entry point of a forked run (tests/scripts/runner.py): output to ``log``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    main(argv)


if __name__ == "__main__":
    from refusals import every_rank_prints_its_refusal

    with every_rank_prints_its_refusal(Path(sys.argv[1])):  # (tests that every rank refuses)
        main()
