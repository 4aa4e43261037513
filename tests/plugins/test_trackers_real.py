"""The Logger and loop.log into real trackers, read back with each tracker's
own reader: MLflow (a local file store, ``MlflowClient``), W&B (offline, its
``.wandb`` run log decoded with W&B's own protobuf records) and TensorBoard
(``EventAccumulator``). Each run is compared with what hookloop sent (a
JSONLinesTracker beside it) and with what the run did: update numbers as
steps, the values of one update at one step, the run configuration (nested
for W&B, dotted keys for MLflow and TensorBoard)."""

import glob
import json
import math
import os
import struct
import time

import pytest
from accelerate import Accelerator

from hookloop import hookimpl
from hookloop.plugins import Logger
from hookloop.trackers import JSONLinesTracker

CONFIG = {"lr": 0.01, "optimizer": {"name": "adam", "betas": [0.9, 0.999]}, "seed": 0,
          "note": None}
#: the configuration as a flat store keeps it (MLflow parameters are strings)
FLAT = {"lr": "0.01", "optimizer.name": "adam", "optimizer.betas": "[0.9, 0.999]", "seed": "0",
        "note": "None"}
UPDATES = 16  # 2 epochs of 8 updates (tiny_loop: 64 examples, batches of 8)
EVERY = 4


class Probe:
    """Logs from before_step, after_step (on_step and on_epoch) and records
    what the run did, to compare the trackers with."""

    def __init__(self):
        self.losses = {}  # update -> loss of the batch that completed it
        self.epoch_metrics = {}  # update at the epoch's end -> its metrics

    @hookimpl
    def before_step(self, loop, batch):
        loop.log({"probe/batch": float(len(batch[0]))})

    @hookimpl
    def after_step(self, loop, loss):
        step = loop.state.global_step
        loop.log({"probe/update": float(step)})
        loop.log({"probe_mean": float(step)}, on_step=False, on_epoch=True)
        if step % EVERY == 0:
            self.losses[step] = loss.item()

    @hookimpl
    def on_epoch_end(self, loop, epoch, metrics):
        self.epoch_metrics[loop.state.global_step] = dict(metrics, epoch=epoch)


def fit(tiny_loop, tmp_path, log_with, **accelerator_kwargs):
    """A 2-epoch fit logging into ``log_with`` and a JSONLinesTracker; the
    probe and what hookloop sent, as ``{key: [(step, value), ...]}``."""
    probe = Probe()
    accelerator = Accelerator(log_with=[*log_with, JSONLinesTracker("sent", tmp_path)],
                              **accelerator_kwargs)
    loop = tiny_loop([Logger(every=EVERY, console=False, project_name="proj", config=CONFIG),
                      probe], accelerator=accelerator, eval_data=True)
    loop.fit(epochs=2)
    sent = {}
    for line in (tmp_path / "sent.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "config" in record:
            assert record["config"] == CONFIG  # JSON lines keep the configuration nested
            continue
        step = record.pop("step")
        for key, value in record.items():
            sent.setdefault(key, []).append((step, value))
    return probe, sent


def check_run(probe, sent, history):
    """``history`` (``{key: [(step, value), ...]}``, read back from a tracker)
    holds what hookloop sent, at the run's update numbers."""
    assert sorted(history) == sorted(sent)
    for key, points in sent.items():
        got = history[key]
        assert [s for s, _ in got] == [s for s, _ in points], key
        assert all(math.isclose(g, v, rel_tol=1e-6) for (_, g), (_, v) in zip(got, points)), key
    steps = list(range(1, UPDATES + 1))
    # one point per update, each at the number of the update it belongs to
    assert history["probe/update"] == [(s, float(s)) for s in steps]
    assert history["probe/batch"] == [(s, 8.0) for s in steps]  # logged before the update
    assert [s for s, _ in history["loss"]] == list(range(EVERY, UPDATES + 1, EVERY))
    assert all(math.isclose(v, probe.losses[s], rel_tol=1e-6) for s, v in history["loss"])
    assert [s for s, _ in history["probe_mean"]] == [8, 16]
    assert [v for _, v in history["probe_mean"]] == [4.5, 12.5]  # the epochs' means
    for key in ("eval_loss", "epoch"):
        assert history[key] == [(s, pytest.approx(m[key])) for s, m in probe.epoch_metrics.items()]


# -- MLflow -----------------------------------------------------------------------


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    store = tmp_path / "mlruns"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    # the file store is in maintenance mode in MLflow 3 (refused unless asked
    # for), but needs no database: the light mlflow-skinny reads and writes it
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    return store


def test_mlflow_gets_every_update_s_values_at_its_step_and_a_flat_config(
        tiny_loop, tmp_path, mlflow_store):
    from mlflow.tracking import MlflowClient

    probe, sent = fit(tiny_loop, tmp_path, ["mlflow"])
    client = MlflowClient(tracking_uri=mlflow_store.as_uri())
    experiment = client.get_experiment_by_name("proj")  # the Logger's project name
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"  # finished when the fit ended
    assert run.data.params == FLAT  # nested keys dotted, not one "{'name': ...}" string
    history = {key: [(m.step, m.value) for m in
                     sorted(client.get_metric_history(run.info.run_id, key),
                            key=lambda m: (m.step, m.timestamp))]
               for key in run.data.metrics}
    check_run(probe, sent, history)


# -- W&B ----------------------------------------------------------------------------


@pytest.fixture
def wandb_dir(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("wandb.proto.wandb_internal_pb2")
    folder = tmp_path / "wandb-home"
    folder.mkdir()
    for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(folder),
                        "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(folder / "config"),
                        "WANDB_CACHE_DIR": str(folder / "cache"),
                        "WANDB_DATA_DIR": str(folder / "data"),
                        "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true",
                        "WANDB_CONSOLE": "off", "WANDB_X_DISABLE_STATS": "true"}.items():
        monkeypatch.setenv(name, value)
    for name in ("WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    return folder


def wandb_records(path):
    """The records of a ``.wandb`` run log, as W&B's own protobuf messages.

    The file is W&B's header (``:W&B``, a 2-byte magic, a version byte) and
    LevelDB's log format: 32 KiB blocks of chunks, each a 7-byte header
    (CRC-32C, length, type: full, first, middle, last); wandb 0.31 has no
    Python reader of its own any more (wandb-core reads it)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run log"
    position, block, parts = 7, 32 * 1024, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if position + 7 + length > len(data):
            return  # a chunk still being written
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind == 0:
            continue
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            yield wandb_internal_pb2.Record.FromString(parts)
            parts = b""


def finished_run(path, timeout=30.0):
    """The records of a finished run: the run log is written by W&B's own
    process (wandb-core), which may still be writing its end when
    ``finish()`` has returned."""
    deadline = time.monotonic() + timeout
    while True:
        records = list(wandb_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{path}: W&B never wrote the run's end"
        time.sleep(0.1)


def test_wandb_offline_gets_one_row_per_update_at_its_step_and_the_nested_config(
        tiny_loop, tmp_path, wandb_dir):
    probe, sent = fit(tiny_loop, tmp_path, ["wandb"])
    (log,) = glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb"))
    rows, config, project = [], {}, None
    for record in finished_run(type(tmp_path)(log)):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            project = project or record.run.project  # (later run records may leave it out)
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            row = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                   for item in record.history.item}
            rows.append((record.history.step.num, row))
    assert project == "proj"
    assert {k: v for k, v in config.items() if not k.startswith("_")} == CONFIG  # nested, as given
    # one history row per update, in order: W&B drops a value logged at a
    # step below its current one, and merges the values of one step
    assert [step for step, _ in rows] == list(range(1, UPDATES + 1))
    assert all(row["_step"] == step for step, row in rows)
    history = {}
    for step, row in rows:
        for key, value in row.items():
            if not key.startswith("_"):
                history.setdefault(key, []).append((step, value))
    check_run(probe, sent, history)


# -- TensorBoard --------------------------------------------------------------------


def test_tensorboard_gets_the_scalars_at_update_steps_and_a_flat_config(tiny_loop, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    probe, sent = fit(tiny_loop, tmp_path, ["tensorboard"], project_dir=tmp_path / "tb")
    history, hparams = {}, {}
    for events in glob.glob(str(tmp_path / "tb" / "**" / "events.out.tfevents.*"), recursive=True):
        accumulator = EventAccumulator(events, size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            history[tag] = [(e.step, e.value) for e in accumulator.Scalars(tag)]
        try:
            contents = accumulator.PluginTagToContent("hparams").values()
        except KeyError:  # an events file without the configuration
            contents = []
        for content in contents:
            info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
            for name, value in info.hparams.items():
                hparams[name] = getattr(value, value.WhichOneof("kind"))
    check_run(probe, sent, history)
    assert hparams == {"lr": 0.01, "optimizer.name": "adam", "optimizer.betas": "[0.9, 0.999]",
                       "seed": 0.0, "note": "None"}


def test_a_config_key_given_nested_and_dotted_is_refused_naming_it(tiny_loop, tmp_path):
    pytest.importorskip("tensorboard")
    accelerator = Accelerator(log_with=["tensorboard"], project_dir=tmp_path)
    config = {"optimizer.name": "sgd", "optimizer": {"name": "adam"}}
    loop = tiny_loop([Logger(console=False, config=config)], accelerator=accelerator)
    with pytest.raises(ValueError, match=r"'optimizer\.name' is given twice"):
        loop.fit(max_steps=1)
