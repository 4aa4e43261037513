"""hookloop on Ray Train: report hookloop's checkpoints and metrics to Ray,
resume from the checkpoint Ray gives back.

    import hookloop_ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def train_func(config):
        loop = Loop(..., accelerator=Accelerator(cpu=not use_gpu),
                    plugins=[Checkpoint(dir=config["checkpoints"], every_steps=100),
                             hookloop_ray.RayReport()],
                    resume_from=hookloop_ray.resume_point())
        loop.fit(epochs=3)

    TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=2),
                 run_config=RunConfig(failure_config=FailureConfig(max_failures=3))).fit()

Ray starts ``torch.distributed`` in every worker before ``train_func``
runs; Accelerate takes that process group as it is (hookloop's launch checks
see a launched job of ``WORLD_SIZE`` processes).
"""

from __future__ import annotations

import math
from pathlib import Path

from hookloop import hookimpl

__all__ = ["RayReport", "resume_point"]
__version__ = "0.1.0"


def _train():
    import ray.train

    return ray.train


class RayReport:
    """Reports to Ray Train (``ray.train.report``) what a run publishes:

    - every checkpoint a ``Checkpoint`` plugin publishes, as
      ``ray.train.Checkpoint.from_directory(<its folder>)`` (the main
      process's; the others report the metrics with it, as Ray asks of
      every worker), with the metrics of the position it was saved at;
    - an epoch's end without a checkpoint: its metrics only.

    The metrics: ``global_step``, ``epoch``, the last evaluation's metrics
    (not the sanity check's) and the epoch's (``loop.log(..., on_epoch=True)`` values and the
    evaluation), floats. Every worker reports at the same points, the same
    number of times: the loop's saves and epoch ends happen on every
    process together (an asynchronous save's is reported where every
    process settles it).
    """

    name = "ray-report"

    def __init__(self):
        self.metrics: dict[str, float] = {}
        self.reports = 0  #: how many times this worker reported
        self._epoch_pending = False  # an epoch ended; reported with its checkpoint, or alone
        self._saved_at: dict[str, dict] = {}  # checkpoint folder -> the metrics it was saved with

    @hookimpl
    def on_eval_end(self, loop, metrics):
        if loop.state.stage != "sanity":  # (the sanity check's one batch is not an evaluation of the run)
            self.metrics.update(_floats(metrics))

    @hookimpl
    def on_epoch_end(self, loop, metrics):
        self.metrics.update(_floats(metrics))
        self._epoch_pending = True

    @hookimpl
    def before_save_checkpoint(self, loop, checkpoint, reason):
        self._saved_at[Path(checkpoint).name] = self._position(loop)
        self._epoch_pending = False  # (this epoch's metrics go with its checkpoint)

    @hookimpl
    def after_save_checkpoint(self, loop, checkpoint, reason):
        checkpoint = Path(checkpoint)
        base = checkpoint.name.split(".")[0]  # (a later generation of the same name: step-40.1)
        metrics = self._saved_at.pop(checkpoint.name, None) or self._saved_at.pop(base, None) \
            or self._position(loop)
        train = _train()
        mine = train.Checkpoint.from_directory(str(checkpoint)) if loop.accelerator.is_main_process else None
        train.report(metrics, checkpoint=mine)
        self.reports += 1

    @hookimpl(wrapper=True)  # after every plugin's work at the safe point: a save started there or not
    def on_safe_point(self, loop, epoch_end, fit_end):
        result = yield
        if epoch_end and self._epoch_pending:
            self._epoch_pending = False
            _train().report(self._position(loop))
            self.reports += 1
        return result

    def _position(self, loop) -> dict:
        return {**self.metrics, "global_step": loop.state.global_step, "epoch": loop.state.epoch}


def _floats(metrics) -> dict:
    out = {}
    for key, value in metrics.items():
        try:
            value = float(value)
        except (TypeError, ValueError):
            continue
        if not math.isnan(value):
            out[key] = value
    return out


def resume_point() -> Path | None:
    """The checkpoint Ray Train gives this attempt (``ray.train.get_checkpoint()``)
    as a local folder for ``Loop(..., resume_from=...)``: None on the first
    attempt. On local storage it is Ray's copy itself; on remote storage
    (S3, GCS) it is downloaded into a local folder first."""
    train = _train()
    checkpoint = train.get_checkpoint()
    if checkpoint is None:
        return None
    try:
        import pyarrow.fs

        if isinstance(checkpoint.filesystem, pyarrow.fs.LocalFileSystem):
            return Path(checkpoint.path)
    except ImportError:
        pass
    return Path(checkpoint.to_directory())
