"""A hookloop run on Ray Train: ``TorchTrainer`` with two CPU workers
(``ray.init(num_cpus=2)``, gloo), for test_ray.py.

    python ray_run.py OUT [--fail-once]

``train_func`` trains hookloop's usual tiny run (64 examples in batches of 8
per worker, an MLP, Adam, a schedule, an evaluation each epoch) with
``Checkpoint(every_steps=3)``, ``hookloop_ray.RayReport()`` and
``resume_from=hookloop_ray.resume_point()``; every start appends a line to
OUT/starts.jsonl (rank 0: the update it starts at, what it resumed). With
``--fail-once`` the rank-1 worker dies (``os._exit(1)``) in the first update
after the first reported checkpoint, once, and ``FailureConfig(max_failures=1)``
lets Ray restart the group. OUT/result.json: ``Result.metrics``, the
checkpoint's path, the error; OUT/params.pt: the final parameters.
"""

import json
import sys
from pathlib import Path


def train_func(config):
    import os
    import time

    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader, TensorDataset

    import hookloop_ray
    from hookloop import Loop, hookimpl
    from hookloop.plugins import Checkpoint

    out = Path(config["out"])
    torch.set_num_threads(1)
    set_seed(0)
    g = torch.Generator().manual_seed(1234)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)
    data = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    eval_data = DataLoader(TensorDataset(x[:32], y[:32]), batch_size=8)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.1 * s))
    report = hookloop_ray.RayReport()

    class FailOnce:
        """Rank 1 dies in the first update after the first reported checkpoint."""

        @hookimpl
        def after_step(self, loop):
            marker = out / "failed"
            if (config["fail_once"] and loop.accelerator.process_index == 1 and report.reports >= 1
                    and not marker.exists()):
                marker.write_text(str(loop.state.global_step))
                time.sleep(3)  # (Ray's controller registers a reported checkpoint when it next polls)
                os._exit(1)

    resume = hookloop_ray.resume_point()
    loop = Loop(model=model, optimizer=optimizer, scheduler=scheduler, train_data=data, eval_data=eval_data,
                plugins=[Checkpoint(dir=out / "checkpoints", every_steps=3, keep_last=None), report, FailOnce()],
                accelerator=Accelerator(cpu=True), block=["progress"], resume_from=resume)
    acc = loop.accelerator
    if acc.is_main_process:
        with open(out / "starts.jsonl", "a") as f:
            f.write(json.dumps({"global_step": loop.state.global_step, "resumed_from": str(resume),
                                "num_processes": acc.num_processes,
                                "distributed_type": acc.distributed_type.value}) + "\n")
    loop.fit(epochs=3)
    if acc.is_main_process:
        torch.save({k: v.detach().clone() for k, v in loop.networks["model"].unwrapped.state_dict().items()},
                   out / "params.pt")
    loop.close()


def main(argv):
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = Path(argv[0]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    trainer = TorchTrainer(
        train_func, train_loop_config={"out": str(out), "fail_once": "--fail-once" in argv},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="hookloop", storage_path=str(out / "ray"),
                             failure_config=FailureConfig(max_failures=1)))
    result = trainer.fit()
    (out / "result.json").write_text(json.dumps({
        "metrics": result.metrics, "checkpoint": result.checkpoint and result.checkpoint.path,
        "error": result.error and repr(result.error)}, default=str))
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
