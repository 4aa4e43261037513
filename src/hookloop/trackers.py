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
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

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
