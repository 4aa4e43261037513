"""Trackers: the one Accelerate lacks (JSON lines in a file, readable by
anything), and the session that starts and finishes a loop's trackers."""

import json
import os

from accelerate.tracking import GeneralTracker, on_main_process


class JSONLinesTracker(GeneralTracker):
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
    def __init__(self, run_name: str, logging_dir: str | os.PathLike):
        super().__init__()
        self.path = os.path.join(logging_dir, f"{run_name}.jsonl")

    @property
    def tracker(self):
        return self.path

    @on_main_process
    def store_init_configuration(self, values: dict):
        self._write({"config": values})

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        self._write({"step": step, **values})

    def _write(self, record):
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=_plain) + "\n")


def _plain(value):
    """JSON for what ``json`` does not know: numbers (tensors, numpy) as
    floats, anything else (paths, dtypes) as its string."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


class TrackerSession:
    """The accelerator's trackers during a loop's fits: started once (by the
    loop after ``on_fit_start``, or earlier by a plugin), finished when the
    fit that started them ends, by any path (``accelerator.end_training()``
    would also destroy the process group, which a second loop still needs)."""

    def __init__(self, accelerator):
        self.accelerator = accelerator
        #: inside a fit: ``loop.log`` may start the trackers
        self.fitting = False
        self._started = False

    def start(self, project_name="hookloop", config=None, init_kwargs=None) -> bool:
        """``accelerator.init_trackers`` if trackers are configured and none
        runs; whether trackers are running (on every process alike)."""
        acc = self.accelerator
        if acc.trackers or not acc.log_with:
            return bool(acc.trackers)
        acc.init_trackers(project_name, config=config, init_kwargs=init_kwargs or {})
        self._started = True
        return bool(acc.trackers) or not acc.is_main_process

    def end(self) -> None:
        """Finish the trackers this session started; the next fit starts them afresh."""
        if self._started:
            self._started = False
            acc = self.accelerator
            for tracker in acc.trackers:
                tracker.finish()
            acc.trackers = []

    def for_fit(self):
        """A context for one fit: trackers end when it does."""
        import contextlib

        @contextlib.contextmanager
        def session():
            self.fitting = True
            try:
                yield
            finally:
                self.fitting = False
                self.end()

        return session()
