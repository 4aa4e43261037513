"""Sharded networks in hookloop checkpoints, two processes on a CPU
(tests/checkpointing/test_sharded.py).

    accelerate launch --multi_gpu --num_processes 2 sharded.py OUT
        --mode accelerate|fully_shard [--fsdp-version 1|2]
        [--state-dict SHARDED_STATE_DICT|FULL_STATE_DICT] [--epochs E]
        [--every-steps N] [--pause step:K]

``--mode accelerate``: ``Loop`` prepares the model with Accelerate's FSDP,
*forced* (:func:`force_fsdp`: Accelerate never runs FSDP on a CPU, it turns
an ``fsdp_plugin`` into plain DDP), trains with ``GradClip``, evaluates and
predicts. ``--mode fully_shard``: the user shards the model with
``torch.distributed.fsdp.fully_shard``, builds the optimizer over the sharded
parameters and a ``DataLoader`` with a ``DistributedSampler``, and gives them
to ``Loop(..., prepare=False)``.

Both train with ``Checkpoint(dir=OUT/checkpoints, every_steps=N)`` and
``resume_from="latest"``; ``--pause step:K`` holds every rank in batch K's
``after_step`` (OUT/paused-<rank> holds its pid) until the test kills them.
At the end the main process writes OUT/params.pt (every parameter, whole) and
OUT/run.json (where it started, the step, what GradClip's norms were, the
evaluation and the predictions checked against the whole model).
"""

import argparse
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
from hookloop.plugins import Checkpoint, GradClip


def force_fsdp(accelerator, version=2, state_dict_type="SHARDED_STATE_DICT"):
    """Make ``accelerator`` (``Accelerator(cpu=True)``, two processes) an FSDP
    one, as ``accelerate launch --use_fsdp`` would on GPUs.

    Forced, because Accelerate never runs FSDP on a CPU: it turns
    ``Accelerator(cpu=True, fsdp_plugin=...)`` into plain DDP (``MULTI_CPU``).
    ``distributed_type`` is set in both process states: ``AcceleratorState``
    copies ``PartialState``'s whenever it is built again (``prepare`` does), so
    setting only ``accelerator.state.distributed_type`` is undone before
    ``save_state``, which then writes an FSDP model as a plain one (and fails).
    FSDP1 also needs ``device`` without an index (``cpu``, not ``cpu:0``) and
    ``use_orig_params`` (its optimizer is made before the wrapping)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=version, state_dict_type=state_dict_type,
                                            use_orig_params=True if version == 1 else None)
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    if version == 1:
        accelerator.state.device = torch.device("cpu")
    return accelerator


def pause_here(out, rank, what):
    # written whole, then renamed: a test polling for the marker never reads it half-written
    (out / f".paused-{rank}").write_text(json.dumps({"pid": os.getpid(), "at": what}))
    os.replace(out / f".paused-{rank}", out / f"paused-{rank}")
    deadline = time.monotonic() + 120  # the test kills us long before
    while time.monotonic() < deadline:
        time.sleep(0.01)
    sys.exit(f"sharded.py: nobody came to kill the paused run ({what})")


class Probe:
    """Holds the run at ``--pause step:K``; remembers GradClip's norms; sets
    the DistributedSampler's epoch (a plain DataLoader has no set_epoch)."""

    name = "probe"

    def __init__(self, pause, out, sampler=None):
        self.pause = int(pause.split(":")[1]) if pause.startswith("step:") else None
        self.out = out
        self.sampler = sampler
        self.norms = []

    @hookimpl
    def on_fit_start(self, loop):
        if self.sampler is not None:  # a resumed epoch draws its order before on_epoch_start
            self.sampler.set_epoch(loop.state.epoch)

    @hookimpl
    def on_epoch_start(self, loop, epoch):
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)

    @hookimpl
    def after_step(self, loop):
        norm = loop.networks["model"].grad_norm
        if norm is not None and len(self.norms) < 3:
            self.norms.append(type(norm).__name__)
        if self.pause is not None and loop.state.micro_step == self.pause:
            pause_here(self.out, loop.accelerator.process_index, f"step {self.pause}")


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                               torch.nn.Linear(16, 3))


def whole(model) -> dict:
    """Every tensor of ``model``'s state, whole (DTensors gathered: every rank calls)."""
    out = {}
    for k, v in model.state_dict().items():
        full = getattr(v, "full_tensor", None)
        out[k] = (full() if callable(full) else v).detach().clone()
    return out


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--mode", default="accelerate", choices=["accelerate", "fully_shard"])
    parser.add_argument("--fsdp-version", type=int, default=2)
    parser.add_argument("--state-dict", default="SHARDED_STATE_DICT")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--every-steps", type=int, default=3)
    parser.add_argument("--pause", default="")
    parser.add_argument("--gpu", action="store_true",
                        help="on GPUs, launched with --use_fsdp: Accelerate's FSDP as it is, not forced")
    parser.add_argument("--processes", type=int, default=2, help="1: one GPU (benchmarks/gpu_check.sh)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    accelerator = Accelerator(cpu=not args.gpu)
    assert accelerator.num_processes == args.processes, accelerator.num_processes
    rank = accelerator.process_index
    set_seed(0)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    model = mlp()
    sampler = None
    if args.mode == "accelerate":
        if not args.gpu:
            force_fsdp(accelerator, args.fsdp_version, args.state_dict)
        data = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        prepare = True
    else:
        from torch.distributed.fsdp import fully_shard
        from torch.utils.data.distributed import DistributedSampler

        for layer in (model[0], model[3]):
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)  # over the sharded parameters
        sampler = DistributedSampler(TensorDataset(x, y), num_replicas=2, rank=rank, seed=3)
        data = DataLoader(TensorDataset(x, y), batch_size=4, sampler=sampler,
                          generator=torch.Generator().manual_seed(5))
        prepare = False
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    checkpoint = Checkpoint(dir=args.out / "checkpoints", every_steps=args.every_steps, keep_last=3)
    probe = Probe(args.pause, args.out, sampler)
    loop = Loop(model=model, optimizer=optimizer, scheduler=scheduler, train_data=data,
                plugins=[GradClip(max_norm=0.5), checkpoint, probe], accelerator=accelerator,
                block=["progress"], resume_from="latest", prepare=prepare)
    start = loop.state.global_step
    loop.fit(epochs=args.epochs)
    net = loop.networks["model"]
    params = whole(net.model)
    report = {"started_at": start, "resumed_from": str(loop.resumed_from),
              "global_step": loop.state.global_step, "num_processes": accelerator.num_processes,
              "distributed_type": str(accelerator.distributed_type),
              "model_class": type(net.model).__name__, "norms": probe.norms}
    if args.mode == "accelerate":  # evaluate and predict with the sharded model
        eval_data = DataLoader(TensorDataset(x[:32], y[:32]), batch_size=8)
        report["eval"] = {k: float(v) for k, v in loop.evaluate(eval_data).items()}
        predicted = loop.predict(DataLoader(TensorDataset(x[:24], y[:24]), batch_size=4))
        reference = mlp().eval()
        reference.load_state_dict(params)
        with torch.no_grad():
            expected = reference(x[:24])
            loss = torch.nn.functional.cross_entropy(reference(x[:32]), y[:32])
        predicted = predicted[0] if isinstance(predicted, (list, tuple)) else predicted
        report["predict_shape"] = list(predicted.shape)
        report["predict_max_error"] = float((predicted - expected).abs().max())
        report["eval_reference_loss"] = float(loss)
    if accelerator.is_main_process:
        torch.save(params, args.out / "params.pt")
        (args.out / "run.json").write_text(json.dumps(report))
    loop.close()


if __name__ == "__main__":
    from refusals import every_rank_prints_its_refusal

    with every_rank_prints_its_refusal(Path(sys.argv[1])):  # (tests that every rank refuses)
        main()
