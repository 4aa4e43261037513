"""hookloop on Ray Train: report hookloop's checkpoints and metrics to Ray,
resume from the newest checkpoint, Ray's or the ``Checkpoint`` folder's.

    import hookloop_ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def train_func(config):
        loop = Loop(..., accelerator=Accelerator(cpu=not use_gpu),
                    plugins=[Checkpoint(dir=config["checkpoints"], every_steps=100),
                             hookloop_ray.RayReport()],
                    resume_from=hookloop_ray.resume_point())  # Ray's or the folder's newest
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
from hookloop.checkpointing import CheckpointError, list_checkpoints, read_latest, read_manifest

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


def resume_point() -> Path | str:
    """Where this Ray Train attempt resumes, for ``Loop(..., resume_from=...)``:
    the newest checkpoint that exists, Ray's or the ``Checkpoint`` folder's.

    - Ray gives a checkpoint (``ray.train.get_checkpoint()``): its local
      folder (on local storage Ray's copy itself; on remote storage, S3 or
      GCS, downloaded first), unless the folder it was saved in (the
      ``root`` its manifest records) holds a newer one: then that folder,
      whose ``latest`` hookloop resumes (every process the same one);
    - Ray gives none: ``"latest"``, the ``Checkpoint`` folder's newest, or a
      start from scratch if it holds none (the first attempt).

    Ray registers a reported checkpoint when its controller next polls the
    workers (every few seconds); a worker that dies before that leaves the
    checkpoint in the folder (and Ray's copy in its storage) but not in what
    Ray gives back, which is then older, or None. Newer: a later position in
    the checkpoint's manifest (update, then epoch: an epoch-end checkpoint
    after the mid-epoch one of its update); Ray's on a tie. A folder holding
    another run's checkpoints is continued like that run's: give each run
    its own folder."""
    checkpoint = _train().get_checkpoint()
    if checkpoint is None:
        return "latest"
    ray_copy = _local(checkpoint)
    try:
        doc = read_manifest(ray_copy)
        ray_position = _position_of(doc)
    except (CheckpointError, KeyError, TypeError):
        return ray_copy  # (not compared: loading it names what is wrong)
    root = doc.get("root")  # the folder it was saved in, as every checkpoint records it
    folder_position = _newest_in(Path(root)) if isinstance(root, str) else None
    if folder_position is not None and folder_position > ray_position:
        return Path(root)
    return ray_copy


def _local(checkpoint) -> Path:
    """A ``ray.train.Checkpoint`` as a local folder: itself on local storage."""
    try:
        import pyarrow.fs

        if isinstance(checkpoint.filesystem, pyarrow.fs.LocalFileSystem):
            return Path(checkpoint.path)
    except ImportError:
        pass
    return Path(checkpoint.to_directory())


def _newest_in(root: Path) -> tuple[int, int, int] | None:
    """The position of the checkpoint ``resume_from=root`` resumes: the one
    ``latest`` names, else the newest whose manifest reads; None if ``root``
    holds none."""
    try:
        latest = read_latest(root)
    except CheckpointError:  # (unreadable, or names a save in progress: the newest readable instead)
        latest = None
    names = [p.name for p in list_checkpoints(root)]
    for name in ([latest] if latest else []) + [n for n in reversed(names) if n != latest]:
        try:
            return _position_of(read_manifest(root / name))
        except (CheckpointError, KeyError, TypeError):
            continue
    return None


def _position_of(doc: dict) -> tuple[int, int, int]:
    """The order of a checkpoint's position (its manifest's ``loop``): update,
    batch, epoch (an epoch-end checkpoint records the next epoch's start)."""
    loop = doc["loop"]
    return loop["global_step"], loop.get("micro_step", loop["global_step"]), loop["epoch"]
