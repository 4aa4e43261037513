"""What the checkpoint I/O needs from the policy (the ``Checkpoint``
plugin, :class:`hookloop.plugins.Checkpoint`), as a base class that the
plugin subclasses: the I/O layer imports no plugin, it finds the registered
instances of :class:`CheckpointPolicy`.
"""

from __future__ import annotations

from pathlib import Path

from .layout import default_directory
from .runs import newest_run


class CheckpointPolicy:
    """Decides when, where, how many and which is best; the checkpoint
    package asks it only what this class declares."""

    #: names of ``custom_checkpoint_<i>.pkl`` files that loading may unpickle
    trust_pickles: tuple = ()
    #: the metric the best checkpoints are ranked by (None: none)
    monitor: str | None = None

    def directory(self, loop) -> Path:
        """The checkpoint root for ``loop``: where saves go and where
        ``resume_from="latest"`` looks."""
        raise NotImplementedError(f"{type(self).__name__}.directory(loop)")

    def best_checkpoint(self, loop, mine: bool = True):
        """``(value, path)`` of the best checkpoint by :attr:`monitor` (only
        this run's unless ``mine`` is False), or None."""
        return None


def checkpoint_plugins(loop) -> list:
    """The :class:`CheckpointPolicy` plugins of ``loop`` (the
    :class:`~hookloop.plugins.Checkpoint` ones, found by type, whatever
    their names), in call order: the first one given in ``plugins=[...]``
    first."""
    found = [p for _, p in loop.plugins.pm.list_name_plugin() if isinstance(p, CheckpointPolicy)]
    return found[::-1]  # pluggy calls the last registered first; user plugins are registered reversed


def checkpoint_root(loop) -> Path:
    """Where ``resume_from="latest"`` looks: the directory of the first
    ``Checkpoint`` plugin (by type), else :func:`default_directory`."""
    plugins = checkpoint_plugins(loop)
    if plugins:
        return plugins[0].directory(loop)
    legacy = loop.plugins.get("checkpoint")  # a plugin of another class named "checkpoint"
    if legacy is not None and callable(getattr(legacy, "directory", None)):
        return legacy.directory(loop)
    base = default_directory(loop.accelerator)
    return newest_run(base) or base


def best_checkpoint_path(loop) -> Path:
    """``load_checkpoint("best")``: the best checkpoint by the ``monitor`` of
    the loop's first Checkpoint plugin that has one, whichever run wrote it."""
    from .errors import CheckpointError

    plugin = next((p for p in checkpoint_plugins(loop) if getattr(p, "monitor", None)), None)
    if plugin is None:
        raise CheckpointError(
            "load_checkpoint('best') needs a Checkpoint(monitor=...) plugin: it ranks the "
            "checkpoints by the metric they were saved with"
        )
    found = plugin.best_checkpoint(loop, mine=False)
    if found is None:
        raise CheckpointError(
            f"load_checkpoint('best'): no checkpoint in {plugin.directory(loop)} "
            f"records {plugin.monitor!r} yet"
        )
    return found[1]
