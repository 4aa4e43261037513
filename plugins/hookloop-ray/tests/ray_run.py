"""A hookloop run on Ray Train: ``TorchTrainer`` with two CPU workers
(``ray.init(num_cpus=2)``, gloo), for test_ray.py.

    python ray_run.py OUT [--fail]

``train_func`` trains hookloop's usual tiny run (64 examples in batches of 8
per worker, an MLP, Adam, a schedule, an evaluation each epoch) with
``Checkpoint(every_steps=3)``, ``hookloop_ray.RayReport()`` and
``resume_from=hookloop_ray.resume_point()``; every start appends a line to
OUT/starts.jsonl (rank 0: the update it starts at, what ``resume_point()``
gave, the checkpoint it resumed). With ``--fail`` the rank-1 worker dies (``os._exit(1)``) twice, at once, without
waiting for Ray to register what was reported: in the first attempt right
after its first report (in ``after_save_checkpoint``), in the second at the
first safe point two updates after its first report (before that safe
point's save); ``FailureConfig(max_failures=2)`` lets Ray restart the group.
Each death appends to OUT/failures.jsonl the update and the newest
checkpoint published by then. OUT/result.json: ``Result.metrics``, the
checkpoint's path, the error; OUT/params.pt: the final parameters.
"""

import json
import sys
from pathlib import Path


def train_func(config):
    import os

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

    class Fail:
        """Rank 1 dies at once after a report: in the first attempt right after
        it, in the second at the first safe point two updates after it."""

        def __init__(self):
            self.first_report = self.last_saved = None
            log = out / "failures.jsonl"
            self.failures = len(log.read_text().splitlines()) if log.exists() else 0

        def die(self, loop):
            with open(out / "failures.jsonl", "a") as f:
                f.write(json.dumps({"global_step": loop.state.global_step, "last_saved": self.last_saved}) + "\n")
            os._exit(1)

        def dies_here(self, loop):
            return config["fail"] and loop.accelerator.process_index == 1 and report.reports >= 1

        @hookimpl(trylast=True)  # after RayReport's report
        def after_save_checkpoint(self, loop, checkpoint, reason):
            self.last_saved = Path(checkpoint).name
            if self.first_report is None:
                self.first_report = loop.state.global_step
            if self.failures == 0 and self.dies_here(loop):
                self.die(loop)

        @hookimpl  # (before Checkpoint's save at this safe point)
        def on_safe_point(self, loop, epoch_end, fit_end):
            if (self.failures == 1 and self.dies_here(loop)
                    and loop.state.global_step >= self.first_report + 2):
                self.die(loop)

    resume = hookloop_ray.resume_point()
    loop = Loop(model=model, optimizer=optimizer, scheduler=scheduler, train_data=data, eval_data=eval_data,
                plugins=[Checkpoint(dir=out / "checkpoints", every_steps=3, keep_last=None), report, Fail()],
                accelerator=Accelerator(cpu=True), block=["progress"], resume_from=resume)
    acc = loop.accelerator
    if acc.is_main_process:
        with open(out / "starts.jsonl", "a") as f:
            f.write(json.dumps({"global_step": loop.state.global_step, "resume_point": str(resume),
                                "resumed_from": str(loop.resumed_from),
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
        train_func, train_loop_config={"out": str(out), "fail": "--fail" in argv},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="hookloop", storage_path=str(out / "ray"),
                             failure_config=FailureConfig(max_failures=2)))
    result = trainer.fit()
    (out / "result.json").write_text(json.dumps({
        "metrics": result.metrics, "checkpoint": result.checkpoint and result.checkpoint.path,
        "error": result.error and repr(result.error)}, default=str))
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
