"""The loop: phases, state and hook calls. It owns *when*; plugins own *what*.

Nothing here logs, clips, computes a loss or writes a file: each of those is
a plugin. Read :meth:`Loop.fit` top to bottom to see the whole of training.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import sys
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.data_loader import DataLoaderStateMixin
from torch.utils.data import DataLoader

from . import checkpointing
from . import manager as plugin_manager
from .accelerate_fastpath import FastPath
from .batches import length_of
from .epoch_values import EpochValues
from .network import Network
from .plugins import BUILTINS, FiniteCheck, ProgressBar
from .state import LoopState
from .strategies import StepOutput, Supervised

_NULL = contextlib.nullcontext()
_END = object()


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
        ``"latest"`` (nothing saved yet: start from scratch), ``"best"``, a
        checkpoint directory, or a checkpoint root (its latest).
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
        self.strategy = strategy if strategy is not None else Supervised()
        self.networks = _networks(model, optimizer, scheduler, networks, self.strategy)
        self.strategy.check_networks(self.networks)
        frozen = set(getattr(self.strategy, "frozen_networks", ()))
        #: the networks ``fit`` puts in train mode (not a strategy's frozen ones)
        self._trainable = [n for name, n in self.networks.items() if name not in frozen]
        if accelerator is not None:
            _check_state_of(accelerator)
        self.accelerator = accelerator if accelerator is not None else Accelerator()
        self.train_data = train_data
        self.eval_data = eval_data
        self.state = LoopState()
        self.plugins = plugin_manager.PluginManager()
        self.plugins.register_all(
            list(plugins), strategy=self.strategy, builtins=BUILTINS, block=block,
            defaults=[*self.strategy.default_plugins(), ProgressBar(), FiniteCheck()],
        )
        self._prepare_data = prepare
        self._prepared = weakref.WeakKeyDictionary()  # DataLoader -> prepared, for evaluate/predict
        if prepare:
            self._prepare(frozen)
        #: ``gradient_accumulation_steps`` as the loop was built (a checkpoint
        #: records it); a plugin may change it at update boundaries during a fit
        self.configured_accumulation = self.accelerator.gradient_accumulation_steps
        self._start_accumulation()  # read again when fit() starts
        self._in_group = 0  # batches of the current accumulation group trained so far
        self._evaluated_at = None  # the global_step of the last eval_every evaluation
        self._in_guard = False
        self._train_values = EpochValues()  # loop.log(on_epoch=True) while training
        self._eval_values = EpochValues()  # ... while evaluating
        self._started_trackers = False
        self._fitting = False
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
        """Ask the loop to end the epoch at the next update boundary (at
        once, without accumulation) and finish the fit: the epoch's
        evaluation and ``on_epoch_end`` still run; the next ``fit``
        continues the epoch where it stopped."""
        self.state.should_stop = True
        self.state.stop_reason = reason

    def skip_batch(self):
        """From ``before_step``: do not train on the current batch."""
        self.state.skip_batch = True

    def end_epoch(self):
        """End the current epoch at the next update boundary, as if its data
        had run out (the Hugging Face Trainer's ``should_epoch_stop``): its
        evaluation and ``on_epoch_end`` run, then the next epoch starts with
        its first batch; the rest of this epoch's batches are not trained."""
        self.state.end_epoch = True

    def log(self, values: Mapping[str, Any], *, on_step: bool = True, on_epoch: bool = False,
            reduce: str = "mean") -> None:
        """Log ``values`` (numbers or tensors, by name) from any hook, on
        every process.

        :param on_step: write them now to every tracker of the accelerator
            (``Accelerator(log_with=...)``, :class:`~hookloop.trackers.JSONLinesTracker`
            included) at ``step=loop.state.global_step``, from the main
            process (its values: reduce them first for a mean over
            processes). Without trackers nothing is read (no device sync).
        :param on_epoch: reduce them over the epoch and over processes
            (``reduce``: ``"mean"``, ``"sum"``, ``"max"``, ``"min"``; a
            tensor of several values counts each) and put the result under
            the same key into the ``metrics`` of the epoch
            (``on_epoch_end``, the epoch-end ``on_eval_end``, what ``fit``
            returns). Logged during an evaluation, they go into that
            evaluation's metrics. Tensors stay on the device until the end
            of the epoch: no sync per step.
        """
        if on_epoch:
            stage = self.state.stage
            if stage == "eval":
                self._eval_values.add(values, reduce)
            elif stage not in ("sanity_check", "predict"):
                self._train_values.add(values, reduce)
        if on_step:
            acc = self.accelerator
            if not acc.is_main_process:
                return
            if not acc.trackers and not (self._fitting and self.start_trackers()):
                return  # nobody to write to: nothing read
            acc.log({k: v.item() if isinstance(v, torch.Tensor) else v for k, v in values.items()},
                    step=self.state.global_step)

    def start_trackers(self, project_name: str = "hookloop", config: dict | None = None,
                       init_kwargs: dict | None = None) -> bool:
        """Start the accelerator's trackers (``accelerator.init_trackers``)
        if it has some configured and none started; the loop finishes the
        trackers it started when the fit ends, by any path.

        ``fit`` calls it with the defaults after ``on_fit_start``; a plugin
        calls it in ``on_fit_start`` to choose the project name or store a
        run configuration. Returns whether trackers are running."""
        acc = self.accelerator
        if acc.trackers or not acc.log_with:
            return bool(acc.trackers)
        acc.init_trackers(project_name, config=config, init_kwargs=init_kwargs or {})
        self._started_trackers = True
        return bool(acc.trackers) or not acc.is_main_process

    def _end_trackers(self):
        if self._started_trackers:
            self._started_trackers = False
            acc = self.accelerator
            for tracker in acc.trackers:
                tracker.finish()
            # the next fit starts them afresh; not accelerator.end_training(),
            # which also destroys the process group
            acc.trackers = []

    def accumulate(self, *models):
        """``accelerator.accumulate(*models)`` when gradient accumulation is
        on, else a context that does nothing (and costs nothing).

        Enter it once per batch with every model the batch trains: Accelerate
        counts one micro-step per entry."""
        return self.accelerator.accumulate(*models) if self._accumulating else _NULL

    @property
    def total_steps(self) -> int | None:
        """The ``global_step`` (optimizer updates) at which the current
        ``fit`` ends, if known."""
        state = self.state
        if state.max_steps is not None:
            return state.max_steps
        per_epoch = length_of(self.train_data)
        if per_epoch is None or state.max_epochs is None:
            return None
        k = self._accumulation  # the last partial group of an epoch is one update too
        updates = -(-per_epoch // k) if isinstance(self.train_data, DataLoaderStateMixin) else per_epoch // k
        return state.max_epochs * updates

    # -- training ---------------------------------------------------------

    def fit(self, epochs: int | None = None, *, max_steps: int | None = None,
            eval_every: int | None = None, sanity_check: bool = True,
            resume_from=None) -> dict:
        """Train until ``state.epoch == epochs`` or ``state.global_step ==
        max_steps`` (exactly one of them; steps are optimizer updates), or
        until a plugin calls :meth:`stop`. Counts are totals over the run, so
        a second ``fit`` (or a resumed one) continues where the state is.

        Every epoch ends the same way, whether its data ran out or a stop or
        ``max_steps`` ended it early: ``on_train_epoch_end``, the evaluation
        (with ``eval_data``), ``on_epoch_end``. An epoch ended early stays
        the current epoch: the next ``fit`` continues it.

        :param eval_every: also evaluate every N updates (``on_eval_start`` /
            ``on_eval_end``, not the epoch hooks); not again at an epoch's
            last update, whose epoch-end evaluation follows.
        :param sanity_check: before the first training step, run one batch of
            ``eval_data`` through ``eval_step`` and ``after_eval_step``, so
            that a wrong evaluation set or metric plugin fails in seconds,
            not after an epoch. It changes nothing (the random states are put
            back) and calls neither ``on_eval_start`` nor ``on_eval_end``.
        :param resume_from: first restore this checkpoint, as
            :meth:`load_checkpoint` does.

        :return: the metrics of the last epoch (``{}`` without ``eval_data``).
        """
        state = self.state
        _check_run_length(epochs, max_steps)
        _check_positive("eval_every", eval_every)
        _check_data(self.train_data)
        if eval_every is not None and self.eval_data is None:
            raise ValueError("fit(eval_every=...) needs eval_data: pass eval_data=... to Loop(...)")
        if resume_from is not None:
            self.load_checkpoint(resume_from)
        state.max_epochs, state.max_steps = epochs, max_steps
        state.should_stop, state.stop_reason, state.skip_batch = False, None, False
        state.end_epoch = False
        metrics: dict = {}
        # trackers end last, after on_exception: a plugin may still log there
        with self._trackers_for_fit(), self._guard(), self._stage("train"):
            self._train_values.clear()
            self.hook.on_fit_start(loop=self)
            self.start_trackers()  # unless a plugin started them in on_fit_start
            self._start_accumulation()  # after on_fit_start: a plugin may set it there
            self._in_group, self._evaluated_at = 0, None
            if sanity_check and self.eval_data is not None:
                self._sanity_check()
            hook = self.hook  # fixed for the run: plugins are set by now
            while not self._finished():
                epoch = state.epoch
                for network in self._trainable:
                    network.model.train()
                resume, self._resume = self._resume, None
                if resume is not None and not state.step_in_epoch:
                    resume.restore_now(self.train_data)  # resumed at an epoch boundary
                if hasattr(self.train_data, "set_epoch"):
                    self.train_data.set_epoch(epoch)
                state.end_epoch = False  # asked after the last epoch's training: nothing to end
                hook.on_epoch_start(loop=self, epoch=epoch)
                loaders_before = list(self.accelerator.gradient_state.dataloader_references)
                if state.step_in_epoch:  # continuing mid-epoch: same batches, none replayed
                    batches = self._rest_of_epoch(resume)
                else:
                    self._epoch_rng = checkpointing.capture_epoch(self.train_data)
                    batches = self._fastpath.batches(self.train_data)
                state.epoch_complete = self._train_epoch(hook, batches, max_steps, eval_every,
                                                         loaders_before)
                hook.on_train_epoch_end(loop=self, epoch=epoch)
                metrics = self._train_values.reduce(self.accelerator)  # loop.log(on_epoch=True)
                if self.eval_data is not None:
                    # an epoch ended early evaluates without a trace in the random
                    # states: the next fit continues the epoch as if it had not stopped
                    metrics = self._evaluate(self.eval_data, keep_rng=not state.epoch_complete,
                                             metrics=metrics)
                hook.on_epoch_end(loop=self, epoch=epoch, metrics=metrics)
                if state.epoch_complete:
                    state.epoch += 1
                    state.step_in_epoch = 0
                state.epoch_complete = False
            hook.on_fit_end(loop=self)
        return metrics

    def _train_epoch(self, hook, batches, max_steps, eval_every, loaders_before) -> bool:
        """Train on ``batches``; True if they ran out, False if a stop or
        ``max_steps`` ended the epoch (always at an update boundary)."""
        state = self.state
        gradient_state = self.accelerator.gradient_state
        settings = gradient_state.plugin_kwargs  # holds gradient_accumulation_steps
        k = self._accumulation
        length = length_of(self.train_data)  # batches in a whole epoch, if known
        for batch in batches:
            hook.before_step(loop=self, batch=batch)
            state.step_in_epoch += 1
            if settings.get("num_steps", 1) != k:  # set by a plugin since the last batch
                k = self._change_accumulation(settings.get("num_steps", 1))
            if state.skip_batch:
                state.skip_batch = False
            else:
                result = hook.training_step(loop=self, batch=batch)
                if type(result) is not StepOutput:
                    result = _step_output(self, result)
                if settings.get("num_steps", 1) != k:
                    _accumulation_changed_inside_step(k, settings.get("num_steps", 1))
                state.micro_step += 1
                if k == 1 or gradient_state.sync_gradients:
                    state.global_step += 1
                    self._in_group = 0
                else:
                    self._in_group += 1
                hook.after_step(loop=self, batch=batch, outputs=result.outputs, loss=result.loss)
            if self._in_group:
                continue  # a stop or an evaluation waits for the end of the accumulation group
            if state.should_stop or state.end_epoch or (
                    max_steps is not None and state.global_step >= max_steps):
                _abandon(batches, self.accelerator, loaders_before)
                if state.end_epoch:
                    state.end_epoch = False
                    return True  # over, as if the data had run out
                return length is not None and state.step_in_epoch >= length
            if (eval_every is not None and state.global_step % eval_every == 0
                    and state.global_step != self._evaluated_at
                    and not (length is not None and state.step_in_epoch >= length)):
                self._evaluate(self.eval_data, keep_rng=True)
                self._evaluated_at = state.global_step
        return True

    def _start_accumulation(self):
        """Read ``gradient_accumulation_steps`` for this fit (a plugin may set
        it in ``on_fit_start``). Accelerate's micro-step counter restarts:
        a fit starts at an update boundary."""
        acc = self.accelerator
        self._accumulation = acc.gradient_accumulation_steps
        self._accumulating = self._accumulation > 1
        acc.step = 0
        self._fastpath = FastPath(acc)

    def _change_accumulation(self, new: int) -> int:
        """``gradient_accumulation_steps`` changed between two batches: taken
        from this batch on if it starts an accumulation group, else refused
        (the open group would be divided by one number and synchronised at
        another)."""
        if self._in_group:
            raise ValueError(
                f"gradient_accumulation_steps changed from {self._accumulation} to {new} "
                f"{self._in_group} batch(es) into an accumulation group (update "
                f"{self.state.global_step + 1}): change it only at an update boundary, e.g. in "
                "on_epoch_start, or in after_step when loop.accelerator.sync_gradients is true"
            )
        self._start_accumulation()
        return self._accumulation

    def _rest_of_epoch(self, resume):
        """The batches of the current epoch after ``state.step_in_epoch``, in
        the order the epoch drew: its iterator is started from the random
        state the epoch started from, then the random state is put back
        where the run stopped."""
        if resume is None:  # a second fit() in this process
            resume = checkpointing.Resume(epoch_start=self._epoch_rng, rng=checkpointing.capture_rng())
        self._epoch_rng = resume.epoch_start
        return resume.batches(self.accelerator, self.train_data, self.state.step_in_epoch)

    def load_checkpoint(self, path="latest", *, strict: bool = True, trust_pickles=()):
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
            plugin's directory (by default the newest run folder,
            ``<project_dir>/checkpoints/version_<N>``), or nothing if none was
            ever saved there; ``"best"``: the best by the ``monitor`` of a
            ``Checkpoint(monitor=...)`` plugin; a checkpoint directory; or a
            checkpoint root (its newest).
        :param trust_pickles: names of ``custom_checkpoint_<i>.pkl`` files
            (objects given to ``accelerator.register_for_checkpointing``) that
            may be unpickled; any other pickle is refused (see
            ``docs/checkpoints.md``).
        :return: the checkpoint directory, or None (``"latest"``, none saved).
        """
        root = self._checkpoint_root()
        if path == "best":
            path = self._best_checkpoint(root)
        resolved = checkpointing.resolve(path, root)
        if resolved is None:
            self.print(f"hookloop: no checkpoint in {root} yet: starting from scratch")
            return None
        self._resume = checkpointing.load(self, resolved, strict=strict,
                                          trust_pickles=list(trust_pickles) or None)
        self.resumed_from = resolved
        return resolved

    def _best_checkpoint(self, root):
        plugin = next((p for p in checkpointing.checkpoint_plugins(self) if getattr(p, "monitor", None)),
                      None)
        if plugin is None:
            raise checkpointing.CheckpointError(
                "load_checkpoint('best') needs a Checkpoint(monitor=...) plugin: it ranks the "
                "checkpoints by the metric they were saved with"
            )
        found = plugin.best_checkpoint(self, mine=False)
        if found is None:
            raise checkpointing.CheckpointError(
                f"load_checkpoint('best'): no checkpoint in {plugin.directory(self)} "
                f"records {plugin.monitor!r} yet"
            )
        return found[1]

    def _checkpoint_root(self):
        # the first Checkpoint plugin found by type, whatever its name (issue 11)
        return checkpointing.checkpoint_root(self)

    def _finished(self) -> bool:
        state = self.state
        return (
            state.should_stop
            or (state.max_steps is not None and state.global_step >= state.max_steps)
            or (state.max_epochs is not None and state.epoch >= state.max_epochs)
        )

    # -- evaluation and prediction -------------------------------------------

    def evaluate(self, data=None) -> dict:
        """Evaluate on ``data`` (default ``eval_data``; a ``DataLoader`` is
        prepared for you) without gradients, in eval mode: ``on_eval_start``,
        per batch ``eval_step`` then ``after_eval_step``, ``on_eval_end``.
        The random states are put back afterwards: calling it from a hook
        does not change the rest of training.

        :return: the metrics: each value ``after_eval_step`` implementations
            returned, averaged over every example (the same on every
            process), plus what ``on_eval_end`` implementations added.
        """
        data = self._eval_loader(data)
        with self._guard(), self._stage("eval"):
            return self._evaluate(data, keep_rng=True)

    def predict(self, data) -> Any:
        """The outputs of ``eval_step`` (the model's forward outputs, for the
        built-in strategies) for every example of ``data``, in data order,
        gathered over processes with ``gather_for_metrics`` (every process
        gets all of them; tensors concatenated on dim 0, inside tuples and
        dicts too). No gradients; the networks' train/eval modes are
        restored afterwards. ``loop.state.stage`` is ``"predict"`` meanwhile.
        """
        data = self._eval_loader(data, required=True)
        gather = self.accelerator.gather_for_metrics
        parts = []
        with self._guard(), self._stage("predict"), self._eval_mode(), torch.no_grad():
            for batch in data:
                parts.append(gather(self._eval_outputs(batch)))
        return _concat(parts)

    def _evaluate(self, data, keep_rng: bool, metrics: dict | None = None) -> dict:
        """One evaluation. ``keep_rng``: put the global random states back
        afterwards (iterating a DataLoader draws a seed from them), so that
        an evaluation in the middle of an epoch changes nothing in training.
        Only the evaluation at the end of a whole epoch draws, as the
        hand-written Accelerate loop's does. ``metrics``: entries to start
        from (the epoch's ``loop.log(on_epoch=True)`` values)."""
        hook = self.hook
        state = self.state
        stage, state.stage = state.stage, "eval"
        sums: dict = {}
        counts: dict = {}
        rng = checkpointing.capture_rng() if keep_rng else None
        self._eval_values.clear()
        try:
            with self._eval_mode():
                hook.on_eval_start(loop=self)
                with torch.no_grad():
                    for batch in data:
                        outputs = self._eval_outputs(batch)
                        for values in hook.after_eval_step(loop=self, batch=batch, outputs=outputs):
                            _add_metrics(self, values, sums, counts)
                means = [sums[key] / max(counts[key], 1) for key in sums]
                metrics = {**(metrics or {}), **self._eval_values.reduce(self.accelerator)}
                metrics.update(zip(sums, torch.stack(means).tolist()) if means else ())
                hook.on_eval_end(loop=self, metrics=metrics)
        finally:
            state.stage = stage
            if rng is not None:
                checkpointing.restore_rng(rng)
        return metrics

    def _eval_outputs(self, batch):
        outputs = self.hook.eval_step(loop=self, batch=batch)
        if outputs is None:
            raise TypeError(
                f"no plugin returned a result from eval_step for strategy "
                f"{self.strategy.name!r}: implement eval_step (return the model's outputs for "
                "the batch) to evaluate or predict"
            )
        return outputs

    def _sanity_check(self):
        """One batch of ``eval_data`` through ``eval_step`` and
        ``after_eval_step``, with every random state put back afterwards."""
        data = self.eval_data
        state = self.state
        rng = checkpointing.capture_rng()
        generators = {path: g.get_state() for path, g in checkpointing.data_generators(data).items()}
        stage, state.stage = state.stage, "sanity_check"
        loaders_before = list(self.accelerator.gradient_state.dataloader_references)
        batches = iter(data)
        try:
            batch = next(batches, _END)
            if batch is _END:
                raise ValueError("eval_data is empty (0 batches): check the dataset and batch_size")
            with self._eval_mode(), torch.no_grad():
                outputs = self._eval_outputs(batch)
                for values in self.hook.after_eval_step(loop=self, batch=batch, outputs=outputs):
                    _add_metrics(self, values, {}, {})
        finally:
            state.stage = stage
            _abandon(batches, self.accelerator, loaders_before)
            checkpointing.restore_rng(rng)
            checkpointing._restore_generators(data, generators)

    def _eval_loader(self, data, required=False):
        if data is None:
            if required or self.eval_data is None:
                raise ValueError(
                    "no data to evaluate: pass evaluate(data=...), or eval_data=... to Loop(...)"
                    if not required else "predict(data) needs data: a DataLoader"
                )
            return self.eval_data
        if not self._prepare_data or not isinstance(data, DataLoader) or isinstance(data, DataLoaderStateMixin):
            return data
        prepared = self._prepared.get(data)
        if prepared is None:
            prepared = self._prepared[data] = self.accelerator.prepare_data_loader(data)
        return prepared

    @contextlib.contextmanager
    def _eval_mode(self):
        """Every network in eval mode; the modes they had put back after."""
        modes = [(n.model, n.model.training) for n in self.networks.values()]
        for model, _ in modes:
            model.eval()
        try:
            yield
        finally:
            for model, training in modes:
                model.train(training)

    @contextlib.contextmanager
    def _trackers_for_fit(self):
        self._fitting = True
        try:
            yield
        finally:
            self._fitting = False
            self._end_trackers()

    @contextlib.contextmanager
    def _stage(self, stage):
        state = self.state
        before, state.stage = state.stage, stage
        try:
            yield
        finally:
            state.stage = before

    @contextlib.contextmanager
    def _guard(self):
        """Call ``on_exception`` for anything that escapes, and name the
        plugin and hook an exception came out of in a note on the exception
        (``except ValueError`` around ``fit`` still catches a model's
        ``ValueError``). Only the outermost guard (``fit``, or a lone
        ``evaluate`` / ``predict``) acts."""
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
            if culprit is not None:
                plugin, hook = culprit
                _add_note(exc, f"hookloop: raised in hook {hook!r} of plugin {plugin!r} "
                               f"({self.plugins.sources.get(plugin, '?')})")
            raise  # the same exception object, its type and traceback unchanged
        finally:
            self._in_guard = False

    # -- set-up -------------------------------------------------------------

    def _prepare(self, frozen):
        for name in frozen:  # evaluation_mode: no DDP wrapper, nothing to synchronise
            network = self.networks[name]
            network.model = self.accelerator.prepare_model(network.model, evaluation_mode=True)
            network.model.eval()
        networks = [n for name, n in self.networks.items() if name not in frozen]
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
        """Release the prepared objects (the loop cannot train afterwards).

        The process group stays: a second ``Loop`` in the same script (a
        cross-validation fold) keeps working with several processes. Called
        for every open loop at interpreter exit, which then also destroys the
        process group: several gloo processes with a DDP-wrapped model
        otherwise abort in about 1 run in 3 while the interpreter tears down
        ("terminate called without an active exception")."""
        for network in self.networks.values():
            network.model = network.unwrapped
            network.optimizer = network.scheduler = None
        self.train_data = self.eval_data = None
        self._prepared = weakref.WeakKeyDictionary()
        self._fastpath.forget()
        try:
            self._end_trackers()
            self.accelerator.free_memory()
        except Exception:  # noqa: BLE001 - best effort
            pass
        gc.collect()


def _networks(model, optimizer, scheduler, networks, strategy) -> dict[str, Network]:
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
        if network.optimizer is None and name not in getattr(strategy, "frozen_networks", ()):
            raise ValueError(
                f"network {name!r} has no optimizer, and the strategy {strategy.name!r} trains "
                "it (only a strategy's frozen_networks may have none)"
            )
    return out


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
    if not _open_loops:
        return
    for loop in list(_open_loops):
        try:
            loop.close()
        except Exception:  # noqa: BLE001
            pass
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        try:  # at exit only: Loop.close keeps the group for later loops
            torch.distributed.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def _check_state_of(accelerator):
    """An ``Accelerator`` whose process-wide state was reset after it was
    made (creating ``transformers.TrainingArguments`` does that) fails later
    with an obscure ``AttributeError``: say what happened instead."""
    from accelerate.state import AcceleratorState

    if not AcceleratorState._shared_state:
        raise RuntimeError(
            "accelerator=: Accelerate's process-wide state was reset after this Accelerator was "
            "created (creating transformers.TrainingArguments does that). Create the "
            "TrainingArguments first, or pass them accelerator_config={'use_configured_state': True}"
        )


def _check_positive(label, value):
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"fit(): {label} must be a positive int or None, got {value!r}")


def _abandon(batches, accelerator, before):
    """Stop iterating prepared dataloaders before their end. Accelerate
    unregisters a dataloader from its gradient state only when its iteration
    runs out; an abandoned one would stay the "active" dataloader. ``before``:
    the gradient state's dataloaders before the iteration began (the ones
    since are ended: the loader itself, or the copy that skips a resumed
    epoch's first batches)."""
    close = getattr(batches, "close", None)
    if close is not None:
        close()
    references = accelerator.gradient_state.dataloader_references
    for loader in [r for r in references if r is not None and all(r is not b for b in before)]:
        if isinstance(loader, DataLoaderStateMixin):
            loader.end()


def _step_output(loop, result):
    if isinstance(result, StepOutput):
        return result
    impls = [i.plugin_name for i in reversed(loop.plugins.pm.hook.training_step.get_hookimpls())]
    what = "no plugin returned a result" if result is None else f"it returned {type(result).__name__}"
    raise TypeError(
        f"training_step must return hookloop.StepOutput(outputs, loss): {what} "
        f"(training_step plugins, first called first: {', '.join(impls)})"
    )


def _accumulation_changed_inside_step(before, now):
    raise ValueError(
        f"gradient_accumulation_steps changed from {before} to {now} inside training_step: "
        "this batch's loss was already divided by one and synchronised at the other. Change it "
        "only at an update boundary, e.g. in on_epoch_start, or in after_step when "
        "loop.accelerator.sync_gradients is true"
    )


def _add_metrics(loop, values, sums, counts):
    """Add one ``after_eval_step`` result (per-example values) to the sums."""
    if not isinstance(values, Mapping) or not all(isinstance(v, torch.Tensor) for v in values.values()):
        impls = [i.plugin_name for i in reversed(loop.plugins.pm.hook.after_eval_step.get_hookimpls())]
        raise TypeError(
            "after_eval_step must return None or a dict {metric name: tensor of per-example "
            f"values}}, got {type(values).__name__} {_short(values)} (after_eval_step plugins: "
            f"{', '.join(impls)})"
        )
    for key, value in values.items():
        value = value.detach().to(torch.float64)
        sums[key] = sums.get(key, 0.0) + value.sum()
        counts[key] = counts.get(key, 0) + value.numel()


def _short(value) -> str:
    text = repr(value)
    return text if len(text) < 60 else text[:57] + "..."


def _concat(parts):
    """Batches of gathered outputs joined into one: tensors on dim 0, the
    same structure around them."""
    if not parts:
        return None
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat([p.reshape(1) if p.ndim == 0 else p for p in parts])
    if isinstance(first, Mapping):
        joined = {key: _concat([p[key] for p in parts]) for key in first}
        try:
            return type(first)(**joined)  # a Hugging Face ModelOutput, a dict subclass
        except TypeError:
            return type(first)(joined)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(_concat([p[i] for p in parts]) for i in range(len(first))))
    if isinstance(first, Sequence) and not isinstance(first, (str, bytes)):
        return type(first)(_concat([p[i] for p in parts]) for i in range(len(first)))
    if first is None:
        return None
    return list(parts)


def _add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``; on Python 3.10 the same ``__notes__`` list,
    which the ``exceptiongroup`` backport prints in tracebacks."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
        return
    notes = getattr(exc, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
    notes.append(note)
    exc.__notes__ = notes
    if sys.version_info < (3, 11):
        try:
            import exceptiongroup  # noqa: F401 - patches traceback printing of __notes__
        except ImportError:
            pass
