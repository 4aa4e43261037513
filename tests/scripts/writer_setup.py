"""What the tests do inside an asynchronous save's writer process, a process
of its own (on Linux a fork of the training process, made when the fit
starts: it has the monkeypatches made before then, and none made after;
elsewhere a new ``python``, which has none). :func:`use` (in the training
process, before its fit or its first asynchronous save) makes the writer
run :func:`setup`, configured by JSON in ``HOOKLOOP_TEST_WRITER``:

- ``events``: a file where the writer appends one JSON line per event:
  ``["ready", pid]`` (this setup ran: the writer waits for work),
  ``["write", name]`` (its model file begins), ``["held", name]``,
  ``["published", name]`` (the training process appends its own with
  :func:`record`, so that both are in one order);
- ``hold``: names whose ``optimizer.bin`` the writer holds, once their model
  file is written, until the file ``<events>.release`` exists (or
  ``release_after`` seconds);
- ``pause``: ``[out, name]``: hold that checkpoint forever, after writing
  ``out/paused-0`` (``{"pid": <the writer's>, "at": ...}``), for a kill;
- ``fail``: ``[name, rel]``: writing that file fails as a full disk does;
- ``slow``: seconds every file operation (a file, the rename into place,
  ``latest``) takes first, as on slow or network storage.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

CONFIG = "HOOKLOOP_TEST_WRITER"
SETUP_ENV = "HOOKLOOP_WRITER_SETUP"  # (hookloop.checkpointing.writer.SETUP_ENV)


def use(environ, **config) -> None:
    """Configure the writer processes started from now on (``environ``:
    ``os.environ``, or a pytest ``monkeypatch``)."""
    setenv = environ.setenv if hasattr(environ, "setenv") else environ.__setitem__
    setenv(SETUP_ENV, f"{__file__}:setup")
    setenv(CONFIG, json.dumps(config))


def record(events, *event) -> None:
    """Append ``event`` to the ``events`` file (one write: whole lines from
    either process)."""
    fd = os.open(events, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(list(event)) + "\n").encode())
    finally:
        os.close(fd)


def read(events) -> list:
    path = Path(events)
    return [tuple(json.loads(line)) for line in path.read_text().splitlines()] if path.exists() else []


def name_of(folder) -> str:
    """``step-00000004`` from ``.tmp-step-00000004-<run>-<pid>``."""
    name = Path(folder).name
    return name[len(".tmp-"):].rsplit("-", 2)[0] if name.startswith(".tmp-") else name


def setup() -> None:
    from hookloop.checkpointing import store as layout, writer

    config = json.loads(os.environ[CONFIG])
    events, slow = config.get("events"), config.get("slow", 0)
    hold, pause, fail = set(config.get("hold", ())), config.get("pause"), config.get("fail")
    write_file, publish, write_latest = writer.write_file, writer.publish, layout.write_latest
    written: set = set()

    def note(*event):
        if events:
            record(events, *event)

    def held_write(folder, rel, *args, **kwargs):
        time.sleep(slow)
        name = name_of(folder)
        if rel == "model.safetensors":
            note("write", name)
        if rel == "optimizer.bin" and (name in hold or (pause and name == pause[1])):
            deadline = time.monotonic() + 60
            while (name, "model.safetensors") not in written and time.monotonic() < deadline:
                time.sleep(0.005)  # (written in parallel: the model's file first, whole)
            note("held", name)
            if pause and name == pause[1]:
                out = Path(pause[0])
                (out / ".paused-0").write_text(json.dumps({"pid": os.getpid(), "at": f"background write {name}"}))
                os.replace(out / ".paused-0", out / "paused-0")
                time.sleep(120)  # the test kills us long before
                raise SystemExit("writer_setup: nobody came to kill the held writer")
            until = time.monotonic() + config.get("release_after", 60)
            while not Path(f"{events}.release").exists() and time.monotonic() < until:
                time.sleep(0.005)
        if fail and [name, rel] == fail:
            raise OSError(28, "No space left on device")
        out = write_file(folder, rel, *args, **kwargs)
        written.add((name, rel))
        return out

    def slow_publish(tmp, final, *args, **kwargs):
        time.sleep(slow)
        out = publish(tmp, final, *args, **kwargs)
        note("published", final.name)
        return out

    def slow_latest(*args, **kwargs):
        time.sleep(slow)
        return write_latest(*args, **kwargs)

    writer.write_file, writer.publish, layout.write_latest = held_write, slow_publish, slow_latest
    note("ready", os.getpid())  # (set up: next, it waits for work)
