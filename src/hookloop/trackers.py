"""Trackers: the one Accelerate lacks (JSON lines in a file, readable by
anything), the session that starts and finishes a loop's trackers, and the
run configuration as each tracker can store it.

A run configuration (``Logger(config=...)``, ``loop.start_trackers(name,
config)``) may nest dicts: ``{"optimizer": {"name": "adam", "lr": 1e-3}}``.
W&B and :class:`JSONLinesTracker` store it as given; MLflow's parameters and
TensorBoard's hyperparameters are flat, so those trackers get it flattened
to dotted keys (``optimizer.name``, ``optimizer.lr``), with values MLflow
and TensorBoard take (numbers, strings, booleans; anything else as its
string): Accelerate would give MLflow ``"{'name': 'adam', ...}"`` as one
parameter and fail in TensorBoard's ``add_hparams``.

Step numbers need no mapping: every tracker gets ``loop.log`` values at the
number of the update they belong to, never a smaller one than a value logged
before in the same fit, which W&B requires (it drops a value logged at a step
below its current one) and which puts the values of one update in one W&B
history row and at one MLflow and TensorBoard step.

Images (``loop.log_images``) go to the trackers that have a ``log_images``
method, each in the form it takes (:func:`send_images`): Accelerate's
trackers disagree (TensorBoard's ``add_images`` wants a batch ``(N, C, H,
W)``; W&B and SwanLab a list of images per key; Aim and ClearML one image
per key).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from accelerate.tracking import GeneralTracker, on_main_process

#: trackers whose run configuration is flat (one level of scalar values)
FLAT_CONFIG_TRACKERS = frozenset({"mlflow", "tensorboard"})


# accelerate ships no type information: GeneralTracker and on_main_process are Any
class JSONLinesTracker(GeneralTracker):  # type: ignore[misc]
    """``Accelerator(log_with=[JSONLinesTracker("run", "logs")])`` appends one
    JSON object per ``accelerator.log`` call to ``logs/run.jsonl``:
    ``{"step": 50, "loss": 0.69, ...}``; the run configuration goes on a
    first line ``{"config": {...}}``. Main process only."""

    name = "jsonl"
    requires_logging_directory = True
    main_process_only = True

    # No @on_main_process here: it would create Accelerate's PartialState
    # before the user's Accelerator(cpu=True, ...) and silently make a
    # multi-process launch non-distributed. The directory appears on the
    # first write, on the main process.
    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = os.path.join(logging_dir, f"{run_name}.jsonl")

    @property
    def tracker(self) -> str:
        return self.path

    @on_main_process  # type: ignore[untyped-decorator]  # accelerate's: no type information
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self._write({"config": values})

    @on_main_process  # type: ignore[untyped-decorator]  # accelerate's: no type information
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self._write({"step": step, **values})

    def _write(self, record: dict[str, Any]) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=_plain) + "\n")


def _plain(value: Any) -> float | str:
    """JSON for what ``json`` does not know: numbers (tensors, numpy) as
    floats, anything else (paths, dtypes) as its string."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def flat_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with nested mappings flattened to dotted keys
    (``{"opt": {"lr": 0.1}}`` -> ``{"opt.lr": 0.1}``) and every value that is
    not a number, string or boolean as its string (``None``, lists, paths).
    A dotted key given and also made by flattening is an error naming it."""
    flat: dict[str, Any] = {}

    def add(prefix: str, values: Mapping[Any, Any]) -> None:
        for key, value in values.items():
            name = f"{prefix}{key}"
            if isinstance(value, Mapping) and value:
                add(f"{name}.", value)
                continue
            if name in flat:
                raise ValueError(
                    f"run configuration key {name!r} is given twice, once nested and once "
                    "dotted: MLflow and TensorBoard store a flat configuration; rename one")
            flat[name] = value if isinstance(value, (bool, int, float, str)) else str(value)

    add("", config)
    return flat


def config_for(tracker: GeneralTracker, config: Any) -> Any:
    """The run configuration as ``tracker`` stores it: a dict flat
    (:func:`flat_config`) for MLflow and TensorBoard; as given otherwise
    (also what is not a mapping, as Accelerate passes it on)."""
    if isinstance(config, Mapping) and getattr(tracker, "name", None) in FLAT_CONFIG_TRACKERS:
        return flat_config(config)
    return config


#: Accelerate's trackers whose ``log_images`` takes one image per key
ONE_IMAGE_TRACKERS = frozenset({"aim", "clearml"})


def image_batch(key: str, value: Any) -> torch.Tensor:
    """``value``, one image or a batch, as an ``(N, C, H, W)`` tensor (a view
    of a tensor given: no copy, no device sync): a tensor or numpy array of
    shape ``(H, W)``, ``(C, H, W)`` or ``(N, C, H, W)``, channels first, 1
    (grey) or 3 (RGB) of them, floats in [0, 1] or ``uint8`` in [0, 255]; a
    PIL image; a list of those, of one shape. Anything else is an error
    naming ``key``."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"loop.log_images: {key!r} is an empty {type(value).__name__}: give images")
        parts = [image_batch(key, v) for v in value]
        kinds = {(tuple(p.shape[1:]), p.dtype) for p in parts}
        if len(kinds) > 1:
            raise ValueError(
                f"loop.log_images: the images of {key!r} are of several shapes or dtypes "
                f"({', '.join(f'{list(s)} {d}' for s, d in sorted(kinds, key=str))}): "
                "a key's images are of one shape and dtype")
        return torch.cat(parts)
    given = value
    if type(value).__module__.startswith("PIL."):  # (H, W) or (H, W, C) pixels
        import numpy as np

        pixels = np.asarray(value if value.mode in ("L", "RGB") else value.convert("RGB"))
        value = torch.from_numpy(pixels.copy())
        value = value if value.ndim == 2 else value.permute(2, 0, 1)
    elif not isinstance(value, torch.Tensor):
        if type(value).__module__ != "numpy":
            raise TypeError(f"loop.log_images: {key!r} is a {type(value).__module__}.{type(value).__qualname__}: "
                            "give a tensor, a numpy array or a PIL image (or a list of them)")
        value = torch.as_tensor(value)
    shape = list(value.shape)
    problem = None
    if value.ndim not in (2, 3, 4):
        problem = "an image is (H, W), (C, H, W) or a batch (N, C, H, W)"
    elif value.ndim > 2 and shape[-3] not in (1, 3):
        problem = "channels come first, 1 (grey) or 3 (RGB) of them"
        if shape[-1] in (1, 3):
            problem += (": for channels last use .permute(2, 0, 1)" if value.ndim == 3
                        else ": for channels last use .permute(0, 3, 1, 2)")
    elif not (value.is_floating_point() or value.dtype == torch.uint8):
        problem = "pixels are floats in [0, 1] or uint8 in [0, 255]"
    if problem is not None:
        what = "tensor" if isinstance(given, torch.Tensor) else type(given).__name__
        raise ValueError(f"loop.log_images: {key!r} is a {what} of shape {shape} ({value.dtype}): {problem}")
    batch: torch.Tensor = value
    while batch.ndim < 4:
        batch = batch.unsqueeze(0)
    return batch


def image_list(batch: torch.Tensor) -> list[Any]:
    """An ``(N, C, H, W)`` CPU batch as the list of images most trackers take
    (Accelerate's ``log_images`` convention): ``uint8`` numpy arrays ``(H,
    W, 3)``, or ``(H, W)`` for grey; floats scaled as TensorBoard scales them
    (``x * 255``, clipped), so that every tracker shows the same pixels."""
    if batch.dtype != torch.uint8:
        batch = (batch.float() * 255).clamp(0, 255).to(torch.uint8)
    pixels = batch.permute(0, 2, 3, 1).numpy()
    return [image[..., 0] if image.shape[-1] == 1 else image for image in pixels]


def send_images(trackers: Sequence[Any], images: Mapping[str, torch.Tensor], step: int) -> list[str]:
    """Each of ``images`` (``(N, C, H, W)`` CPU tensors) to every tracker with
    a ``log_images`` method, in the form it takes: TensorBoard the batch
    (``add_images``), Aim and ClearML one image per key (``key/0``,
    ``key/1``, ... for a batch of several), the others (W&B, SwanLab, a
    tracker of your own) a list of images per key (:func:`image_list`).
    Returns the names of the trackers that take no images."""
    refused: list[str] = []
    lists: dict[str, list[Any]] | None = None  # made once, for the trackers that take lists
    for tracker in trackers:
        name = getattr(tracker, "name", None) or type(tracker).__name__
        log_images = getattr(tracker, "log_images", None)
        if log_images is None:
            refused.append(name)
            continue
        if name == "tensorboard":
            log_images(dict(images), step=step)
            continue
        if lists is None:
            lists = {key: image_list(batch) for key, batch in images.items()}
        if name in ONE_IMAGE_TRACKERS:
            log_images({key if len(each) == 1 else f"{key}/{i}": image
                        for key, each in lists.items() for i, image in enumerate(each)}, step=step)
        else:
            log_images(lists, step=step)
    return refused


class TrackerSession:
    """The accelerator's trackers during a loop's fits: started once (by the
    loop after ``on_fit_start``, or earlier by a plugin), finished when the
    fit that started them ends, by any path (``accelerator.end_training()``
    would also destroy the process group, which a second loop still needs)."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        #: inside a fit: ``loop.log`` may start the trackers
        self.fitting = False
        self._started = False

    def start(self, project_name: str = "hookloop", config: Mapping[str, Any] | None = None,
              init_kwargs: dict[str, Any] | None = None) -> bool:
        """``accelerator.init_trackers`` if trackers are configured and none
        runs, then the run configuration to each tracker as it can store it
        (:func:`config_for`); whether trackers are running (on every process
        alike)."""
        acc = self.accelerator
        if acc.trackers or not acc.log_with:
            return bool(acc.trackers)
        names = {t.name if isinstance(t, GeneralTracker) else str(t) for t in acc.log_with}
        if isinstance(config, Mapping) and names & FLAT_CONFIG_TRACKERS:
            flat_config(config)  # a bad key fails on every process, not the main one alone
        acc.init_trackers(project_name, config=None, init_kwargs=init_kwargs or {})
        self._started = True
        if config is not None:  # what init_trackers(config=...) does, per tracker
            for tracker in acc.trackers:  # (none on other processes than the main one)
                tracker.store_init_configuration(config_for(tracker, config))
        return bool(acc.trackers) or not acc.is_main_process

    def end(self) -> None:
        """Finish the trackers this session started; the next fit starts them afresh."""
        if self._started:
            self._started = False
            acc = self.accelerator
            for tracker in acc.trackers:
                tracker.finish()
            acc.trackers = []

    def for_fit(self) -> AbstractContextManager[None]:
        """A context for one fit: trackers end when it does."""
        import contextlib

        @contextlib.contextmanager
        def session() -> Iterator[None]:
            self.fitting = True
            try:
                yield
            finally:
                self.fitting = False
                self.end()

        return session()
