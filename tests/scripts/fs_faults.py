"""File operations that fail, for the checkpoint tests, injected at the
calls every implementation of a checkpoint store must make (the package's
own function names are its business and change):

- a checkpoint folder is deleted by renaming it away first (a kill during
  the deletion must never leave a valid name on half a folder), or removed
  with ``shutil.rmtree``: ``undeletable`` folders make ``os.rename`` (their
  path as the source) and ``shutil.rmtree`` (their path) raise
  ``OSError(EACCES)``;
- ``latest`` is replaced atomically (a temporary file renamed over it,
  ``os.replace`` or ``os.rename``): ``latest_naming`` names make replacing
  ``<root>/latest`` with a file that names one of them raise ``OSError(EIO)``.

:func:`use` installs them in this process (undone with the test's
``monkeypatch``) and in an asynchronous save's writer process: a forked one
has them already; one started as a new interpreter runs :func:`setup`
(``HOOKLOOP_WRITER_SETUP``, as tests/scripts/writer_setup.py does), which
installs them from ``HOOKLOOP_TEST_FS_FAULTS``. Every message says
``injected``.
"""

from __future__ import annotations

import errno
import json
import os
import shutil

CONFIG = "HOOKLOOP_TEST_FS_FAULTS"
SETUP_ENV = "HOOKLOOP_WRITER_SETUP"  # (the writer process runs module:function when it starts)
LATEST = "latest"


def _real(path) -> str:
    return os.path.realpath(os.fspath(path))


def patched(config: dict) -> dict:
    """``{name: replacement}`` of the ``os`` and ``shutil`` functions that fail as ``config`` says."""
    undeletable = {_real(p) for p in config.get("undeletable", ())}
    latest_naming = set(config.get("latest_naming", ()))
    rename, replace, rmtree = os.rename, os.replace, shutil.rmtree

    def refuse_deletion(path, how):
        if _real(path) in undeletable:
            raise OSError(errno.EACCES, f"Permission denied (injected: {how} of {os.fspath(path)})")

    def refuse_latest(src, dst, how):
        if os.path.basename(os.fspath(dst)) != LATEST or not latest_naming:
            return
        try:
            with open(src, encoding="utf-8") as f:
                names = f.read().strip()
        except (OSError, UnicodeDecodeError):
            return
        if names in latest_naming:
            raise OSError(errno.EIO, f"Input/output error (injected: {how} of {os.fspath(dst)} naming {names})")

    def failing_rename(src, dst, *args, **kwargs):
        refuse_deletion(src, "os.rename")
        refuse_latest(src, dst, "os.rename")
        return rename(src, dst, *args, **kwargs)

    def failing_replace(src, dst, *args, **kwargs):
        refuse_latest(src, dst, "os.replace")
        return replace(src, dst, *args, **kwargs)

    def failing_rmtree(path, *args, **kwargs):
        refuse_deletion(path, "shutil.rmtree")
        return rmtree(path, *args, **kwargs)

    for function in (failing_rename, failing_replace, failing_rmtree):
        function.fs_fault = True  # type: ignore[attr-defined]
    return {"rename": failing_rename, "replace": failing_replace, "rmtree": failing_rmtree}


def use(monkeypatch, **config) -> None:
    """Install the faults of ``config`` here and in the writer processes
    started from now on; ``monkeypatch`` undoes them."""
    functions = patched(config)
    monkeypatch.setattr(os, "rename", functions["rename"])
    monkeypatch.setattr(os, "replace", functions["replace"])
    monkeypatch.setattr(shutil, "rmtree", functions["rmtree"])
    monkeypatch.setenv(CONFIG, json.dumps(config))
    monkeypatch.setenv(SETUP_ENV, f"{os.path.abspath(__file__)}:setup")


def setup() -> None:
    """In a writer process: the faults of ``HOOKLOOP_TEST_FS_FAULTS``, unless
    it was forked with them."""
    if getattr(os.rename, "fs_fault", False):
        return
    functions = patched(json.loads(os.environ[CONFIG]))
    os.rename, os.replace, shutil.rmtree = functions["rename"], functions["replace"], functions["rmtree"]
