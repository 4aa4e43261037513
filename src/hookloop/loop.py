"""The loop: phases, state and hook calls. It owns *when*; plugins own *what*.

Nothing here logs, clips, computes a loss or writes a file: each of those is
a plugin. Read :meth:`Loop.fit` top to bottom to see the whole of training.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import weakref
from collections.abc import Mapping

import torch
from accelerate import Accelerator

from . import checkpointing
from . import manager as plugin_manager
from .accelerate_fastpath import FastPath
from .errors import HookError, PluginLoadError, PluginValidationError
from .network import Network
from .plugins import BUILTINS, FiniteCheck, ProgressBar
from .state import LoopState
from .strategies import Supervised

_NULL = contextlib.nullcontext()


class Loop:
    """A training loop on ``accelerate.Accelerator`` that calls plugins.

    One network::

        Loop(model=model, optimizer=optimizer, scheduler=scheduler,
             train_data=train_dataloader, eval_data=eval_dataloader,
             plugins=[GradClip(max_norm=1.0)])

    Several networks, with a strategy that knows what to do with them::

        Loop(networks={"generator": Network(G, opt_g),
                       "discriminator": Network(D, opt_d)},
             strategy=GAN(latent_dim=64), train_data=real_images)

    :param plugins: plugin objects, built-in or installed plugin names
        (``"gradclip"``, ``"ema"``) or ``(name, {options})`` pairs; called
        in this order. A plugin whose name is that of a built-in default
        (``"progress"``, ``"loss"``) replaces it.
    :param accelerator: default ``Accelerator()``.
    :param block: plugin names never to run (added to
        ``HOOKLOOP_BLOCK_PLUGINS``), built-in defaults included.
    :param prepare: pass the models, optimizers, schedulers and dataloaders
        through ``accelerator.prepare`` (set False if you prepared them).
    :param resume_from: restore a checkpoint now (see :meth:`load_checkpoint`):
        ``"latest"`` (nothing saved yet: start from scratch), a checkpoint
        directory, or a checkpoint root (its latest).
    """

    def __init__(
        self,
        model=None,
        optimizer=None,
        scheduler=None,
        *,
        networks: Mapping[str, Network] | None = None,
        strategy=None,
        train_data=None,
        eval_data=None,
        plugins=(),
        accelerator: Accelerator | None = None,
        block=(),
        prepare: bool = True,
        resume_from=None,
    ):
        self.networks = _networks(model, optimizer, scheduler, networks)
        self.strategy = strategy if strategy is not None else Supervised()
        self.strategy.check_networks(self.networks)
        self.accelerator = accelerator if accelerator is not None else Accelerator()
        self.train_data = train_data
        self.eval_data = eval_data
        self.state = LoopState()
        self.plugins = plugin_manager.PluginManager()
        self._register_plugins(list(plugins), block)
        if prepare:
            self._prepare()
        self._accumulating = self.accelerator.gradient_accumulation_steps > 1
        self._fastpath = FastPath(self.accelerator)
        self._in_guard = False
        self._epoch_rng = None  # what this epoch's data iterator started from (for resume)
        self._resume = None  # how to continue after load_checkpoint, used by fit
        #: the checkpoint directory the last :meth:`load_checkpoint` restored
        self.resumed_from = None
        _close_at_exit(self)
        if resume_from is not None:
            self.load_checkpoint(resume_from)

    # -- what plugins use -------------------------------------------------

    @property
    def hook(self):
        """Call a hook: ``loop.hook.compute_loss(loop=loop, network=..., ...)``."""
        return self.plugins.hook

    def print(self, *args, **kwargs):
        """``print`` on the main process only."""
        self.accelerator.print(*args, **kwargs)

    def stop(self, reason: str | None = None):
        """Ask the loop to end after the current step (or epoch end)."""
        self.state.should_stop = True
        self.state.stop_reason = reason

    def skip_batch(self):
        """From ``before_step``: do not train on the current batch."""
        self.state.skip_batch = True

    def accumulate(self, *models):
        """``accelerator.accumulate(*models)`` when gradient accumulation is
        on, else a context that does nothing (and costs nothing).

        Enter it once per batch with every model the batch trains: Accelerate
        counts one micro-step per entry."""
        return self.accelerator.accumulate(*models) if self._accumulating else _NULL

    @property
    def total_steps(self) -> int | None:
        """The ``global_step`` at which the current ``fit`` ends, if known."""
        state = self.state
        if state.max_steps is not None:
            return state.max_steps
        try:
            per_epoch = len(self.train_data)
        except TypeError:
            return None
        return state.max_epochs * per_epoch if state.max_epochs is not None else None

    # -- training ---------------------------------------------------------

    def fit(self, epochs: int | None = None, *, max_steps: int | None = None,
            resume_from=None) -> dict:
        """Train until ``state.epoch == epochs`` or ``state.global_step ==
        max_steps`` (exactly one of them), or until a plugin calls
        :meth:`stop`. Counts are totals over the run, so a second ``fit``
        (or a resumed one) continues where the state is.

        :param resume_from: first restore this checkpoint, as
            :meth:`load_checkpoint` does.

        :return: the metrics of the last completed epoch (``{}`` if none).
        """
        state = self.state
        _check_run_length(epochs, max_steps)
        _check_data(self.train_data)
        if resume_from is not None:
            self.load_checkpoint(resume_from)
        state.max_epochs, state.max_steps = epochs, max_steps
        state.should_stop, state.stop_reason, state.skip_batch = False, None, False
        metrics: dict = {}
        with self._guard():
            self.hook.on_fit_start(loop=self)
            self._fastpath = FastPath(self.accelerator)  # after plugins set up
            hook = self.hook  # fixed for the run: plugins are set by now
            while not self._finished():
                epoch = state.epoch
                for network in self.networks.values():
                    network.model.train()
                resume, self._resume = self._resume, None
                if resume is not None and not state.step_in_epoch:
                    resume.restore_now(self.train_data)  # resumed at an epoch boundary
                if hasattr(self.train_data, "set_epoch"):
                    self.train_data.set_epoch(epoch)
                hook.on_epoch_start(loop=self, epoch=epoch)
                if state.step_in_epoch:  # continuing mid-epoch: same batches, none replayed
                    batches = self._rest_of_epoch(resume)
                else:
                    self._epoch_rng = checkpointing.capture_epoch(self.train_data)
                    batches = self.train_data
                for batch in batches:
                    hook.before_step(loop=self, batch=batch)
                    state.step_in_epoch += 1
                    if state.skip_batch:
                        state.skip_batch = False
                        continue
                    result = hook.training_step(loop=self, batch=batch)
                    state.global_step += 1
                    hook.after_step(loop=self, batch=batch, outputs=result.outputs, loss=result.loss)
                    if state.should_stop or state.global_step == max_steps:
                        break
                else:  # the epoch ran to its end
                    metrics = self.evaluate() if self.eval_data is not None else {}
                    hook.on_epoch_end(loop=self, epoch=epoch, metrics=metrics)
                    state.epoch += 1
                    state.step_in_epoch = 0
            hook.on_fit_end(loop=self)
        return metrics

    def _rest_of_epoch(self, resume):
        """The batches of the current epoch after ``state.step_in_epoch``, in
        the order the epoch drew: its iterator is started from the random
        state the epoch started from, then the random state is put back
        where the run stopped."""
        if resume is None:  # a second fit() in this process
            resume = checkpointing.Resume(epoch_start=self._epoch_rng, rng=checkpointing.capture_rng())
        self._epoch_rng = resume.epoch_start
        return resume.batches(self.accelerator, self.train_data, self.state.step_in_epoch)

    def load_checkpoint(self, path="latest", *, strict: bool = True):
        """Restore a checkpoint written by :class:`hookloop.plugins.Checkpoint`:
        every network's model, optimizer and scheduler, every process's
        random states, the loop position and each stateful plugin's state;
        the next :meth:`fit` continues exactly where that run was.

        Everything is checked before anything changes; a missing, foreign or
        truncated checkpoint, one from another model shape, another number
        of processes or another set of stateful plugins raises
        :class:`hookloop.checkpointing.CheckpointError` naming the culprit
        (``strict=False``: plugin mismatches only warn, naming the plugins).

        :param path: ``"latest"``: the newest checkpoint in the checkpoint
            plugin's directory (default ``<project_dir>/checkpoints``), or
            nothing if none was ever saved there; a checkpoint directory; or
            a checkpoint root (its newest).
        :return: the checkpoint directory, or None (``"latest"``, none saved).
        """
        root = self._checkpoint_root()
        resolved = checkpointing.resolve(path, root)
        if resolved is None:
            self.print(f"hookloop: no checkpoint in {root} yet: starting from scratch")
            return None
        self._resume = checkpointing.load(self, resolved, strict=strict)
        self.resumed_from = resolved
        return resolved

    def _checkpoint_root(self):
        plugin = self.plugins.get("checkpoint")
        if plugin is not None and callable(getattr(plugin, "directory", None)):
            return plugin.directory(self)
        return checkpointing.default_directory(self.accelerator)

    def _finished(self) -> bool:
        state = self.state
        return (
            state.should_stop
            or (state.max_steps is not None and state.global_step >= state.max_steps)
            or (state.max_epochs is not None and state.epoch >= state.max_epochs)
        )

    def evaluate(self) -> dict:
        """Run ``eval_data`` through the ``eval_step`` hook, without gradients,
        and return each metric averaged over every example (on every process).
        """
        if self.eval_data is None:
            raise ValueError("this Loop has no eval_data: pass eval_data=... to Loop(...)")
        hook = self.hook
        with self._guard():
            was_training = {name: n.model.training for name, n in self.networks.items()}
            for network in self.networks.values():
                network.model.eval()
            hook.on_eval_start(loop=self)
            sums: dict = {}
            counts: dict = {}
            with torch.no_grad():
                for batch in self.eval_data:
                    values = hook.eval_step(loop=self, batch=batch)
                    if values is None:
                        raise TypeError(
                            f"no plugin returned a result from eval_step (strategy "
                            f"{self.strategy.name!r}): implement eval_step to evaluate"
                        )
                    for key, value in values.items():
                        value = value.detach().to(torch.float64)
                        sums[key] = sums.get(key, 0.0) + value.sum()
                        counts[key] = counts.get(key, 0) + value.numel()
            metrics = {key: (sums[key] / max(counts[key], 1)).item() for key in sums}
            hook.on_eval_end(loop=self, metrics=metrics)
            for name, network in self.networks.items():
                network.model.train(was_training[name])
        return metrics

    @contextlib.contextmanager
    def _guard(self):
        """Call ``on_exception`` for anything that escapes, and name the
        plugin and hook an exception came out of. Only the outermost guard
        (``fit``, or a lone ``evaluate``) acts."""
        if self._in_guard:
            yield
            return
        self._in_guard = True
        try:
            yield
        except BaseException as exc:
            try:
                self.plugins.hook.on_exception(loop=self, exception=exc)
            except Exception as hook_exc:  # keep the original error first
                exc.__context__ = hook_exc
            culprit = self.plugins.culprit(exc) if isinstance(exc, Exception) else None
            if culprit is not None and not isinstance(exc, (HookError, PluginValidationError)):
                raise HookError(*culprit, exc) from exc
            raise
        finally:
            self._in_guard = False

    # -- set-up -------------------------------------------------------------

    def _register_plugins(self, given, block):
        """Register built-ins, switched-on installed plugins and the plugins
        given in code, so that calls go: given (in order), installed,
        built-in. pluggy calls the last registered first, hence reversed."""
        blocked = plugin_manager.blocked_names(block)
        if self.strategy.name in blocked:
            raise PluginValidationError(
                self.strategy, f"the strategy {self.strategy.name!r} cannot be blocked"
            )
        installed = None
        user = []
        for item in given:
            if isinstance(item, (str, tuple)):
                if installed is None:
                    installed = {i.name: i for i in plugin_manager.discover()}
                plugin, source = _resolve_named(item, installed)
            else:
                plugin, source = item, "code"
            user.append((plugin, plugin_manager.plugin_name(plugin), source))
        user_names = {name for _, name, _ in user}
        if installed is None and not os.environ.get(plugin_manager.ENV_DISABLE_AUTOLOAD):
            installed = {i.name: i for i in plugin_manager.discover()}
        auto = []
        for item in (installed or {}).values():
            if item.name in user_names or not plugin_manager.autoload_considered(item.name, block):
                continue
            if item.error is not None:  # one broken distribution does not stop the others
                plugin_manager.warn_broken(item)
            elif plugin_manager.autoload_decision(item, block)[0]:
                auto.append((item.instantiate(), item.name, item.describe()))
        defaults = [self.strategy, *self.strategy.default_plugins(), ProgressBar(), FiniteCheck()]
        builtin = [(p, plugin_manager.plugin_name(p), "built-in") for p in defaults]
        builtin = [b for b in builtin if b[1] not in user_names or b[0] is self.strategy]
        for plugin, name, source in [*builtin, *reversed(auto), *reversed(user)]:
            if name in blocked:
                continue
            self.plugins.register(plugin, name, source)

    def _prepare(self):
        networks = list(self.networks.values())
        with_opt = [n for n in networks if n.optimizer is not None]
        with_sched = [n for n in networks if n.scheduler is not None]
        data = [d for d in (self.train_data, self.eval_data) if d is not None]
        prepared = self.accelerator.prepare(
            *(n.model for n in networks),
            *(n.optimizer for n in with_opt),
            *data,
            *(n.scheduler for n in with_sched),
        )
        if not isinstance(prepared, tuple):
            prepared = (prepared,)
        it = iter(prepared)
        for n in networks:
            n.model = next(it)
        for n in with_opt:
            n.optimizer = next(it)
        if self.train_data is not None:
            self.train_data = next(it)
        if self.eval_data is not None:
            self.eval_data = next(it)
        for n in with_sched:
            n.scheduler = next(it)

    def close(self):
        """Release the prepared objects and end Accelerate's trackers.

        Called at interpreter exit. Several gloo processes with a DDP-wrapped
        model otherwise abort in about 1 run in 3 while the interpreter tears
        down ("terminate called without an active exception"); dropping every
        reference first avoids it."""
        for network in self.networks.values():
            network.model = network.unwrapped
            network.optimizer = network.scheduler = None
        self.train_data = self.eval_data = None
        self._fastpath.forget()
        try:
            self.accelerator.free_memory()
            self.accelerator.end_training()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
        gc.collect()


def _networks(model, optimizer, scheduler, networks) -> dict[str, Network]:
    if networks is not None:
        if model is not None or optimizer is not None or scheduler is not None:
            raise ValueError("pass either model=/optimizer=/scheduler= or networks=, not both")
        if not isinstance(networks, Mapping) or not networks:
            raise ValueError("networks= must be a non-empty dict of name -> Network(...)")
        out = {}
        for name, network in networks.items():
            if not isinstance(network, Network):
                raise TypeError(
                    f"networks[{name!r}] is a {type(network).__name__}: wrap it as "
                    f"Network(model, optimizer, scheduler=None)"
                )
            network.name = name
            out[name] = network
    else:
        if model is None:
            raise ValueError("Loop needs model=... (one network) or networks={...}")
        out = {"model": Network(model, optimizer, scheduler, name="model")}
    for name, network in out.items():
        if not isinstance(network.model, torch.nn.Module):
            raise TypeError(
                f"network {name!r}: model is a {type(network.model).__name__}, "
                "not a torch.nn.Module"
            )
        if network.optimizer is None:
            raise ValueError(f"network {name!r} has no optimizer")
    return out


def _resolve_named(item, installed):
    name, options = (item, None) if isinstance(item, str) else item
    if not isinstance(name, str) or (options is not None and not isinstance(options, Mapping)):
        raise PluginValidationError(
            item, f"plugin given as {item!r}: expected 'name' or ('name', {{options}})"
        )
    if name in BUILTINS:
        try:
            return BUILTINS[name](**(options or {})), "built-in"
        except TypeError as exc:
            raise PluginValidationError(
                item, f"built-in plugin {name!r} cannot be created with {options or {}}: {exc}"
            ) from exc
    if name in installed:
        entry = installed[name]
        plugin = entry.instantiate(options)
        if plugin_manager.plugin_name(plugin) != name:
            try:
                plugin.name = name  # the entry-point name is the one users see
            except AttributeError:
                pass
        return plugin, entry.describe()
    known = sorted(set(BUILTINS) | set(installed))
    raise PluginLoadError(
        f"no plugin named {name!r}: not built in and not installed "
        f"(entry-point group 'hookloop'). Known: {', '.join(known)}"
    )


def _check_run_length(epochs, max_steps):
    if (epochs is None) == (max_steps is None):
        raise ValueError(
            f"fit() takes exactly one of epochs=N or max_steps=N (got epochs={epochs!r}, "
            f"max_steps={max_steps!r})"
        )
    for label, value in (("epochs", epochs), ("max_steps", max_steps)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"fit(): {label} must be a positive int, got {value!r}")


def _check_data(data):
    if data is None:
        raise ValueError("this Loop has no train_data: pass train_data=... to Loop(...)")
    try:
        n = len(data)
    except TypeError:
        return
    if n == 0:
        raise ValueError("train_data is empty (0 batches): check the dataset and batch_size")


_open_loops: "weakref.WeakSet[Loop]" = weakref.WeakSet()


def _close_at_exit(loop):
    _open_loops.add(loop)


@atexit.register
def _close_open_loops():
    for loop in list(_open_loops):
        try:
            loop.close()
        except Exception:  # noqa: BLE001
            pass
