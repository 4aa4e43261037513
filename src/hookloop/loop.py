"""The loop: phases, state and hook calls. It owns *when*; plugins own *what*.

Nothing here logs, clips, computes a loss or writes a file: each of those is
a plugin. Read :meth:`Loop.fit` top to bottom to see the whole of training:
it begins the fit, runs and ends epochs until the run is finished, and ends
the fit. Everything a restart needs is in ``loop.state``
(:class:`~hookloop.state.LoopState`); checkpoints are written by plugins at
the loop's *safe points* (``on_safe_point``): after an update and every
evaluation scheduled at it, and after each epoch's end, with the random
states as training continues from them.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.data_loader import DataLoaderStateMixin

from . import checkpointing, checks, evaluation, rng, schedules
from . import manager as plugin_manager
from .accelerate_fastpath import FastPath
from .agreement import Agreement
from .lifetime import _open_loops
from .batches import abandon, length_of, updates_per_epoch
from .logbook import Logbook, Metrics
from .lr_finder import LRFinderResult
from .lr_finder import find_lr as _find_lr
from .network import Network, networks_from
from .network import prepare as prepare_networks
from .plugins import BUILTINS, loop_defaults
from .state import DATA, END_EPOCH, MAX_STEPS, STOP, LoopState
from .strategies import StepOutput, Supervised
from .strategies.base import step_epoch_schedulers

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
             strategy=GAN(latent_dim=64), train_data=real_image_loader)  # a DataLoader

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
        checkpoint directory, a checkpoint root (its latest), or a folder of
        ``accelerator.save_state`` named ``epoch_<e>`` or ``step_<n>``.
    :param scheduler_interval: ``"step"`` (every update) or ``"epoch"``, and
        ``scheduler_frequency``, for ``scheduler=`` (Lightning's ``interval``
        and ``frequency``; with ``networks=``, on each :class:`Network`).
    """

    def __init__(
        self,
        model: Any = None,
        optimizer: Any = None,
        scheduler: Any = None,
        *,
        networks: Mapping[str, Network] | None = None,
        strategy: Any = None,
        train_data: Any = None,
        eval_data: Any = None,
        plugins: Iterable[Any] = (),
        accelerator: Accelerator | None = None,
        block: Iterable[str] = (),
        prepare: bool = True,
        resume_from: Any = None,
        scheduler_interval: str = "step",
        scheduler_frequency: int = 1,
    ) -> None:
        self.strategy = strategy if strategy is not None else Supervised()
        schedule = ({} if (scheduler_interval, scheduler_frequency) == ("step", 1) else
                    {"scheduler_interval": scheduler_interval, "scheduler_frequency": scheduler_frequency})
        self.networks = networks_from(model, optimizer, scheduler, networks, self.strategy, schedule)
        self.strategy.check_networks(self.networks)
        frozen = set(getattr(self.strategy, "frozen_networks", ()))
        #: the networks ``fit`` puts in train mode (not a strategy's frozen ones)
        self._trainable = [n for name, n in self.networks.items() if name not in frozen]
        if accelerator is not None:
            checks.accelerator_state(accelerator)
        self.accelerator = accelerator if accelerator is not None else Accelerator()
        checks.launch(self.accelerator)  # launch mistakes, before anything is prepared
        evaluation.check_eval_data(eval_data)
        self.train_data = train_data
        #: one evaluation set (a ``DataLoader``), or several by name (a dict
        #: ``{"val": ..., "test": ...}``, a list: ``"0"``, ``"1"`` ...)
        self.eval_data = eval_data
        #: the run state: position, run identity, what a restart needs
        self.state = LoopState()
        self.plugins = plugin_manager.PluginManager()
        self.plugins.register_all(
            list(plugins), strategy=self.strategy, builtins=BUILTINS, block=block,
            defaults=[*self.strategy.default_plugins(), *loop_defaults()],
        )
        self._closed = False
        self.hook.on_loop_start(loop=self)
        self._prepare_data = prepare
        self._prepared: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # DataLoader -> prepared, for evaluate/predict
        if prepare:
            sets = evaluation.eval_sets(eval_data) if eval_data is not None else []
            self.train_data, loaders = prepare_networks(
                self.accelerator, self.networks, frozen, self.train_data, [loader for _, loader in sets])
            self.eval_data = evaluation.with_sets(eval_data, loaders) if sets else None
        #: ``gradient_accumulation_steps`` as the loop was built (a checkpoint
        #: records it); a plugin may change it at update boundaries during a fit
        self.configured_accumulation: int = self.accelerator.gradient_accumulation_steps
        self._start_accumulation()  # read again when fit() starts
        self._resume: rng.Resume | None = None  # how to continue after load_checkpoint, used by the next epoch
        self._logbook = Logbook(self.accelerator, self.plugins)  # loop.log, trackers, metrics
        self._agreement = Agreement(self.accelerator)  # stops asked on some processes only
        self._safe = False  # inside on_safe_point
        self._discarded = False  # a network's update of the current batch was discarded (commit_update)
        #: batches whose update a ``commit_update`` hook discarded (not counted in ``global_step``)
        self.discarded_updates = 0
        #: the checkpoint directory the last :meth:`load_checkpoint` restored
        self.resumed_from: Path | None = None
        _open_loops.add(self)
        if resume_from is not None:
            try:
                self.load_checkpoint(resume_from)
            except BaseException:  # not half-built on the accelerator: a second Loop may follow
                self.close()
                raise

    # -- what plugins use -------------------------------------------------

    @property
    def hook(self) -> Any:
        """Call a hook: ``loop.hook.compute_loss(loop=loop, network=..., ...)``."""
        return self.plugins.hook

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` once per job: on the main process of the whole job
        (``accelerator.is_main_process``, rank 0), not once per machine as
        ``accelerator.print`` does (local main processes). Other processes
        print nothing; they need not call it together (no communication)."""
        if self.accelerator.is_main_process:
            print(*args, **kwargs)

    def stop(self, reason: str | None = None, *, every_rank: bool = False) -> None:
        """Ask the loop to end the epoch at the next update boundary (at
        once, without accumulation) and finish the fit: the epoch's
        evaluation and ``on_epoch_end`` still run; the next ``fit``
        continues the epoch where it stopped. With several processes a stop
        asked on some of them takes effect on all at the next point where
        they agree (after an evaluation, at an epoch end, every 10 updates:
        :mod:`hookloop.agreement`), never a hang; ``every_rank=True``: every
        process calls it here (a decision taken together): at once."""
        self._agreement.stop(self.state, reason, every_rank)

    def skip_batch(self) -> None:
        """From ``before_step``: do not train on the current batch."""
        self.state.skip_batch = True

    def discard_update(self) -> None:
        """The current batch's update is not counted (a strategy's ``update``
        calls it when a ``commit_update`` hook returned False): no
        ``global_step``, no safe point; :attr:`discarded_updates` counts it."""
        self._discarded = True

    def end_epoch(self, *, every_rank: bool = False) -> None:
        """End the current epoch at the next update boundary, as if its data
        had run out (the Hugging Face Trainer's ``should_epoch_stop``): its
        evaluation and ``on_epoch_end`` run, then the next epoch starts with
        its first batch; the rest of this epoch's batches are not trained.
        Several processes agree on it as on :meth:`stop`."""
        self._agreement.end_epoch(self.state, every_rank)

    @property
    def at_safe_point(self) -> bool:
        """Whether a checkpoint written now would resume exactly: inside
        ``on_safe_point``, or outside ``fit`` / ``evaluate`` / ``predict``."""
        return self._safe or self.state.stage is None

    def log(self, values: Mapping[str, Any], *, on_step: bool = True, on_epoch: bool = False,
            reduce: str = "mean") -> None:
        """Log ``values`` (numbers or tensors, by name) from any hook, on
        every process.

        :param on_step: write them now to every tracker of the accelerator
            (``Accelerator(log_with=...)``, :class:`~hookloop.trackers.JSONLinesTracker`
            included), from the main process (its values: reduce them first
            for a mean over processes), at the number of the update being
            trained (every value logged while a batch trains shares it;
            elsewhere ``loop.state.global_step``). Without trackers nothing
            is read (no device sync).
        :param on_epoch: reduce them over the epoch and over processes
            (``reduce``: ``"mean"``, ``"sum"``, ``"max"``, ``"min"``; a
            tensor of several values counts each) and put the result under
            the same key into the ``metrics`` of the epoch
            (``on_epoch_end``, the epoch-end ``on_eval_end``, what ``fit``
            returns). Logged during an evaluation, they go into that
            evaluation's metrics. Tensors stay on the device until the end
            of the epoch: no sync per step. The epoch's values so far are
            part of every checkpoint: an epoch interrupted and resumed
            reduces the same values as one that was not.

        An ``on_step`` value is one number: a tensor or array of several
        values is an error naming its key (``on_step=False, on_epoch=True``
        reduces every value; images go through :meth:`log_images`).
        Two plugins logging one key is an error naming both
        (:mod:`hookloop.logbook`): name per-instance keys with
        ``loop.plugins.name_of(self)``.
        """
        self._logbook.log(self.state, values, on_step, on_epoch, reduce, self._logbook.writer(1))

    def log_images(self, images: Mapping[str, Any]) -> None:
        """Send images, by name, to every tracker of the accelerator that takes
        images (TensorBoard, W&B, Aim, ClearML, SwanLab: those with a
        ``log_images`` method), from the main process, at the step number
        :meth:`log` uses. Call it on any process (the others send nothing
        and read nothing from the device).

        Each value is one image or a batch: a tensor or numpy array ``(H,
        W)``, ``(C, H, W)`` or ``(N, C, H, W)``, channels first, 1 (grey) or
        3 (RGB) of them, floats in [0, 1] or ``uint8``; a PIL image; or a
        list of those. A tracker without ``log_images``
        (:class:`~hookloop.trackers.JSONLinesTracker`, MLflow) is named once.
        """
        self._logbook.log_images(self.state, images)

    def start_trackers(self, project_name: str = "hookloop", config: dict[str, Any] | None = None,
                       init_kwargs: dict[str, Any] | None = None) -> bool:
        """Start the accelerator's trackers (``accelerator.init_trackers``)
        if it has some configured and none started; the loop finishes the
        trackers it started when the fit ends, by any path.

        ``fit`` calls it with the defaults after ``on_fit_start``; a plugin
        calls it in ``on_fit_start`` to choose the project name or store a
        run configuration. Returns whether trackers are running."""
        return self._logbook.trackers.start(project_name, config, init_kwargs)

    def accumulate(self, *models: Any) -> contextlib.AbstractContextManager[Any]:
        """``accelerator.accumulate(*models)`` when gradient accumulation is
        on, else a context that does nothing (and costs nothing).

        Enter it once per batch with every model the batch trains: Accelerate
        counts one micro-step per entry."""
        return self.accelerator.accumulate(*models) if self.accumulating else _NULL

    @property
    def total_steps(self) -> int | None:
        """The ``global_step`` (optimizer updates) at which the current
        ``fit`` ends, if known."""
        state = self.state
        if state.max_steps is not None:
            return state.max_steps
        per_epoch = updates_per_epoch(self.train_data, self._accumulation)
        if per_epoch is None or state.max_epochs is None:
            return None
        return state.max_epochs * per_epoch

    # -- training: fit and its phases ------------------------------------------

    def fit(self, epochs: int | None = None, *, max_steps: int | None = None,
            eval_every: int | None = None, sanity_check: bool = True,
            resume_from: Any = None) -> dict[str, Any]:
        """Train until ``state.epoch == epochs`` or ``state.global_step ==
        max_steps`` (exactly one of them; steps are optimizer updates), or
        until a plugin calls :meth:`stop`. Counts are totals over the run, so
        a second ``fit`` (or a resumed one) continues where the state is; a
        run already there trains nothing (a warning names its position).

        Every epoch ends the same way, whether its data ran out or a stop or
        ``max_steps`` ended it early: ``on_train_epoch_end``, the evaluation
        (with ``eval_data``), ``on_epoch_end``, then a safe point. An epoch
        ended early stays the current epoch: the next ``fit`` continues it.
        ``hookspecs.py`` has the table of which hooks run for each way a fit
        or an epoch ends.

        :param eval_every: also evaluate every N updates (``on_eval_start`` /
            ``on_eval_end``, not the epoch hooks); not again at an epoch's
            last update, whose epoch-end evaluation follows.
        :param sanity_check: before the first training step, evaluate one
            batch of ``eval_data`` (``on_eval_start`` ... ``on_eval_end``, with
            ``loop.state.stage == "sanity"``), so that a wrong evaluation set,
            metric plugin or ``monitor`` fails in seconds, not after an epoch.
            Its metrics go nowhere; the random states are put back.
        :param resume_from: first restore this checkpoint, as
            :meth:`load_checkpoint` does.

        :return: the metrics of the run's last epoch (``{}`` without
            ``eval_data`` or ``loop.log(on_epoch=True)`` values).
        """
        checks.run_length(epochs, max_steps)
        checks.positive("eval_every", eval_every)
        checks.train_data(self.train_data)
        if eval_every is not None and self.eval_data is None:
            raise ValueError("fit(eval_every=...) needs eval_data: pass eval_data=... to Loop(...)")
        if resume_from is not None:
            self.load_checkpoint(resume_from)
        state = self.state
        state.start_fit(epochs, max_steps)
        self._agreement.start_fit()
        if state.stopped is not None and self._resume is not None:
            state.stop(state.stopped)  # resumed where a stop ended the fit: it stays stopped
        state.stopped = None
        if state.finished:
            checks.warn_nothing_to_do(state, epochs, max_steps)
        elif self._resume is not None:  # the first fit after a resume: past the end of a schedule?
            schedules.warn_past_plan(self, self._resume.manifest)
        # trackers end last, after on_exception: a plugin may still log there
        with self._logbook.trackers.for_fit(), self.plugins.guard(self), self._stage("train"):
            self._begin_fit(sanity_check and not state.finished)
            while not state.finished:
                reason = self._run_epoch(eval_every)
                self._end_epoch(reason)
            self._end_fit()
        return dict(state.last_metrics)

    def _begin_fit(self, sanity_check: bool) -> None:
        """``on_fit_start``, trackers, this fit's accumulation, the sanity check."""
        self._logbook.start_fit()
        self.hook.on_fit_start(loop=self)
        self.start_trackers()  # unless a plugin started them in on_fit_start
        self._start_accumulation()  # after on_fit_start: a plugin may set it there
        if sanity_check and self.eval_data is not None:
            with self._stage("sanity"):
                evaluation.sanity_check(self, self.eval_data, self._logbook)

    def _run_epoch(self, eval_every: int | None) -> str:
        """Train the current epoch, or the rest of it; return why it ended
        (:data:`~hookloop.state.DATA`, ``END_EPOCH``, ``STOP``, ``MAX_STEPS``)."""
        state = self.state
        for network in self._trainable:
            network.model.train()
        resume, self._resume = self._resume, None
        if resume is not None and not state.step_in_epoch:
            resume.restore_now(self.train_data)  # resumed at an epoch boundary
        if hasattr(self.train_data, "set_epoch"):
            self.train_data.set_epoch(state.epoch)
        state.end_epoch = False  # asked after the last epoch's training: nothing to end
        loaders_before = list(self.accelerator.gradient_state.dataloader_references)
        if state.step_in_epoch:  # continuing an epoch: the same batches, none replayed
            batches = rng.rest_of_epoch(self.accelerator, state, self.train_data, resume)
            if batches is None:
                return DATA  # nothing was left of it
            self.hook.on_epoch_start(loop=self, epoch=state.epoch)
        else:
            self.hook.on_epoch_start(loop=self, epoch=state.epoch)
            state.epoch_start = rng.capture_epoch(self.train_data)
            batches = self.fastpath.batches(self.train_data)
        return self._train(batches, eval_every, loaders_before)

    def _train(self, batches: Iterable[Any], eval_every: int | None, loaders_before: list[Any]) -> str:
        """The batch loop: every batch, then at each update its scheduled
        evaluation and its safe point. Returns why the epoch ended."""
        state, hook = self.state, self.hook
        gradient_state = self.accelerator.gradient_state
        settings = gradient_state.plugin_kwargs  # holds gradient_accumulation_steps
        k = self._accumulation
        in_group = 0  # batches of the current accumulation group trained so far
        length = length_of(self.train_data)  # batches in a whole epoch, if known
        prepared = isinstance(self.train_data, DataLoaderStateMixin)  # knows its last batch
        logbook, agreement, at_end = self._logbook, self._agreement, self.fastpath.end_of_dataloader
        # calls of nothing left out (the relay is this epoch's: see relay.unimplemented)
        quiet_before, quiet_safe = hook.unimplemented(("before_step",)), hook.unimplemented(("on_safe_point",))
        for batch in batches:
            logbook.step = state.global_step + 1  # what this batch's values are logged at
            if not quiet_before:
                hook.before_step(loop=self, batch=batch)
            state.step_in_epoch += 1
            state.epoch_ended = False
            if settings.get("num_steps", 1) != k:  # set by a plugin since the last batch
                k = self._change_accumulation(settings.get("num_steps", 1), in_group)
            updated = False
            if state.skip_batch:
                state.skip_batch = False
            else:
                result = hook.training_step(loop=self, batch=batch)
                if type(result) is not StepOutput:
                    result = checks.step_output(self, result)
                if settings.get("num_steps", 1) != k:
                    checks.accumulation_changed_inside_step(k, settings.get("num_steps", 1))
                state.micro_step += 1
                if self._discarded:  # (commit_update said no: the batch is consumed, not counted)
                    self._discarded, in_group = False, 0
                    self.discarded_updates += 1
                elif k == 1 or gradient_state.sync_gradients:
                    state.global_step += 1
                    in_group, updated = 0, True
                else:
                    in_group += 1
                hook.after_step(loop=self, batch=batch, outputs=result.outputs, loss=result.loss)
            logbook.step = None
            if in_group:
                continue  # a stop, an evaluation, a safe point: at the end of the accumulation group
            last = ((length is not None and state.step_in_epoch >= length)
                    or (prepared and at_end()))  # gradient_state.end_of_dataloader
            if agreement.several and updated and not last and agreement.due(state.global_step):
                agreement.agree(state)  # a stop asked on some processes only: on all, here
            reason = None if last else self._early_end()
            if reason is None and updated:
                if (eval_every is not None and not last and state.global_step % eval_every == 0
                        and state.global_step != state.evaluated_at):
                    state.evaluation = self._evaluate(self.eval_data, keep_rng=True, scheduled="every")
                    state.evaluated_at = state.global_step
                    agreement.agree(state)
                    reason = self._early_end()  # asked by the evaluation (early stopping)
                if reason is None:
                    if last:  # the epoch's end follows; its evaluation is this update's
                        state.epoch_end_reason = DATA
                    if not quiet_safe:  # else no hook ran since the last _early_end()
                        self._safe_point(epoch_end=False)
                        reason = None if last else self._early_end()
            if reason is not None:
                abandon(batches, self.accelerator, loaders_before)
                return reason
        return DATA

    def _early_end(self) -> str | None:
        """Why the epoch ends at this update boundary before its data ran
        out, or None: it goes on."""
        state = self.state
        if state.end_epoch:
            return END_EPOCH
        if state.should_stop:
            return STOP
        if state.max_steps is not None and state.global_step >= state.max_steps:
            return MAX_STEPS
        return None

    def _end_epoch(self, reason: str) -> None:
        """``on_train_epoch_end``, the evaluation, ``on_epoch_end``; the next
        epoch's start when this one is over; the epoch's safe point."""
        state, hook = self.state, self.hook
        if reason == DATA and state.epoch_ended:
            # continued an epoch whose end already ran (a stop at a stream's
            # last batch, whose length is unknown) and found nothing left
            state.new_epoch()
            return
        epoch = state.epoch
        complete = reason in (DATA, END_EPOCH)
        state.epoch_complete, state.epoch_end_reason = complete, reason
        hook.on_train_epoch_end(loop=self, epoch=epoch)
        # an epoch ended early keeps its loop.log values: the next fit continues it
        owners = dict(state.logged.owners)
        metrics: dict[str, Any] = Metrics(state.logged.reduce(self.accelerator, clear=complete),
                          plugins=self.plugins, owners=owners)
        if self.eval_data is not None:
            if state.evaluated_at == state.global_step and state.evaluated_at is not None:
                metrics.update(state.evaluation)  # this update's evaluation (eval_every)
            else:
                # an epoch ended early evaluates without a trace in the random
                # states: the next fit continues the epoch as if it had not stopped
                metrics = self._evaluate(self.eval_data, keep_rng=not complete, metrics=metrics,
                                         scheduled="epoch")
        if complete:
            step_epoch_schedulers(self, self._trainable, metrics)
        hook.on_epoch_end(loop=self, epoch=epoch, metrics=metrics)
        state.last_metrics = dict(metrics)
        if reason == STOP:
            state.stopped = state.stop_reason or "loop.stop()"
        state.epoch_complete = False
        if complete:
            state.new_epoch()
        else:
            state.epoch_ended = True
        self._agreement.agree(state)  # the fit ends here on every process, or on none
        self._safe_point(epoch_end=True, fit_end=state.finished)
        state.epoch_end_reason = None

    def _end_fit(self) -> None:
        self.hook.on_fit_end(loop=self)

    def _safe_point(self, epoch_end: bool, fit_end: bool = False) -> None:
        """``on_safe_point``: a checkpoint written now resumes exactly."""
        self._safe = True
        try:
            self.hook.on_safe_point(loop=self, epoch_end=epoch_end, fit_end=fit_end)
        finally:
            self._safe = False

    def _start_accumulation(self) -> None:
        """Read ``gradient_accumulation_steps`` for this fit (a plugin may set
        it in ``on_fit_start``). Accelerate's micro-step counter restarts:
        a fit starts at an update boundary."""
        acc = self.accelerator
        self._accumulation: int = acc.gradient_accumulation_steps
        #: whether this fit accumulates gradients (``loop.accumulate`` enters Accelerate's then)
        self.accumulating = self._accumulation > 1
        acc.step = 0
        #: the accelerator's per-step calls without their per-call lookups
        #: (:class:`~hookloop.accelerate_fastpath.FastPath`: ``backward``, ``step``,
        #: ``scheduler_step``, ``zero_grad``, ``update``), what the strategy kit
        #: steps with; a new one whenever the accumulation changes
        self.fastpath = FastPath(acc)

    def _change_accumulation(self, new: int, in_group: int) -> int:
        """``gradient_accumulation_steps`` changed between two batches: taken
        from this batch on if it starts an accumulation group, else refused
        (the open group would be divided by one number and synchronised at
        another)."""
        if in_group:
            checks.accumulation_changed_in_group(self._accumulation, new, in_group,
                                                 self.state.global_step + 1)
        self._start_accumulation()
        return self._accumulation

    # -- checkpoints ---------------------------------------------------------------

    def load_checkpoint(self, path: Any = "latest", *, strict: bool = True, trust_pickles: Iterable[str] = (),
                        weights_only: bool = False, position: Any = None
                        ) -> Path | checkpointing.WeightsLoaded | None:
        """Restore a checkpoint written by :class:`hookloop.plugins.Checkpoint`:
        every network's model, optimizer and scheduler, every process's
        random states, the run state and each stateful plugin's state; the
        next :meth:`fit` continues exactly where that run was. A folder of a
        plain ``accelerator.save_state`` continues as its script would
        (``docs/checkpoints.md``, Continuing a hand-written script's run).

        Everything is checked before anything changes; a missing, foreign or
        truncated checkpoint, one from another model shape or another set of
        stateful plugins raises :class:`hookloop.checkpointing.CheckpointError`
        naming the culprit and what to change (``strict=False``: plugin and
        run-setting mismatches only warn). Another number of processes or
        batch size: ``docs/checkpoints.md``, Another number of processes.

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
        :param weights_only: a new run from the checkpoint's weights alone
            (every network's model; also of Accelerate's plain format), on any
            number of processes; the loop keeps its position and run id. The
            best weights after early stopping: ``load_checkpoint("best",
            weights_only=True)`` (Lightning's ``ckpt_path="best"``, the
            Trainer's ``load_best_model_at_end``). With ``strict=False``, the
            tensors that fit (name and shape) are loaded and the others stay
            as they are (fine-tuning into another head, as torch's
            ``load_state_dict(strict=False)`` and transformers'
            ``ignore_mismatched_sizes=True`` do); it returns a
            :class:`~hookloop.checkpointing.WeightsLoaded` naming, per network,
            the ``missing``, ``unexpected`` and ``mismatched`` tensors, also
            said in a warning.
        :param position: where an ``accelerator.save_state`` folder's run was, if
            its name does not say (``epoch_<e>``, ``step_<n>``): the same strings,
            or ``{"epoch": e, "step_in_epoch": batches}``.
        :return: the checkpoint directory, or None (``"latest"``, none saved).
        """
        roots = checkpointing.checkpoint_roots(self)
        if path == "best":
            path = checkpointing.best_checkpoint_path(self)
        found, staged = checkpointing.find(path, roots)
        if found is None:
            self.print(f"hookloop: no checkpoint in {roots[0]} yet: starting from scratch")
            return None
        if weights_only:  # a new run from the weights: the loop's state, run id and plugins stay
            loaded: Path | checkpointing.WeightsLoaded = checkpointing.load_weights(
                self, found, staged=staged, strict=strict)
            return loaded
        trusted = list(trust_pickles) or None
        script = checkpointing.script_folder(found)  # a hand-written script's save_state
        if script is not None or position is not None:
            self._resume = checkpointing.load_script(self, script or found, position=position,
                                                     strict=strict, trust_pickles=trusted)
        else:
            self._resume = checkpointing.load(self, found, strict=strict, staged=staged, trust_pickles=trusted)
        self.resumed_from = self._resume.path
        self.hook.after_load_checkpoint(loop=self, checkpoint=self.resumed_from, manifest=self._resume.manifest)
        return self.resumed_from

    # -- evaluation and prediction -------------------------------------------

    def evaluate(self, data: Any = None) -> dict[str, Any]:
        """Evaluate on ``data`` (default ``eval_data``; a ``DataLoader`` is
        prepared for you) without gradients, in eval mode: ``on_eval_start``,
        per batch ``eval_step`` then ``after_eval_step``, ``on_eval_end``.
        The random states are put back afterwards: calling it from a hook
        does not change the rest of training.

        :return: the metrics: each value ``after_eval_step`` implementations
            returned, averaged over every example (the same on every
            process), plus what ``on_eval_end`` implementations added.
        """
        data = evaluation.loader_for(self, data)
        with self.plugins.guard(self):
            metrics = self._evaluate(data, keep_rng=True)
        if self.state.stage == "train":  # from a hook: every process evaluated here
            self._agreement.agree(self.state)
        return metrics

    def predict(self, data: Any, *, pad_index: float | None = -100) -> Any:
        """The outputs of ``eval_step`` (the model's forward outputs, for the
        built-in strategies) for every example of ``data``, in data order,
        gathered over processes with ``gather_for_metrics`` (every process
        gets all of them; tensors concatenated on dim 0, inside tuples and
        dicts too). No gradients; the networks' train/eval modes are
        restored afterwards. ``loop.state.stage`` is ``"predict"`` meanwhile.

        :param pad_index: outputs whose sizes after the first dimension
            differ between batches or processes (per-token outputs of
            batches padded to their own longest sequence) are padded with it,
            at the end of each dimension, to the largest size seen, as the
            Hugging Face Trainer's ``predict`` does (its ``padding_index``,
            -100; Lightning's ``predict`` returns a list per batch instead).
            ``None``: such outputs are an error. Outputs that cannot be
            joined (other numbers of dimensions, keys) are an error naming
            the output and the shapes.
        """
        data = evaluation.loader_for(self, data, required=True)
        with self.plugins.guard(self), self._stage("predict"):
            return evaluation.predict(self, data, pad_index)

    def _evaluate(self, data: Any, keep_rng: bool, metrics: dict[str, Any] | None = None,
                  scheduled: str | None = None) -> dict[str, Any]:
        """One evaluation. ``keep_rng``: put the global random states back
        afterwards (iterating a DataLoader draws a seed from them), so that
        an evaluation in the middle of an epoch changes nothing in training.
        Only the evaluation at the end of a whole epoch draws, as the
        hand-written Accelerate loop's does. ``metrics``: entries to start
        from (the epoch's ``loop.log(on_epoch=True)`` values). ``scheduled``:
        ``loop.state.scheduled_eval`` meanwhile (``"every"``, ``"epoch"``)."""
        state = self.state
        before, state.scheduled_eval = state.scheduled_eval, scheduled
        try:
            with self._stage("eval"), (rng.keep_rng() if keep_rng else _NULL):
                return evaluation.run(self, data, self._logbook, metrics)
        finally:
            state.scheduled_eval = before

    # -- tuning ----------------------------------------------------------------------

    def find_lr(self, *, min_lr: float = 1e-8, max_lr: float = 1.0, num_training: int = 100,
                mode: str = "exponential", early_stop_threshold: float | None = 4.0,
                networks: str | Iterable[str] | None = None, monitor: str | None = None) -> LRFinderResult:
        """A learning-rate range test (Lightning's ``Tuner(trainer).lr_find(model)``,
        with its defaults): up to ``num_training`` optimizer updates of this
        loop's own training step, the learning rate of every param group of
        the swept networks going from ``min_lr`` to ``max_lr``, the loss of
        each update recorded (smoothed); then the run is put back bitwise as
        it was (parameters, optimizer and scheduler states, random states,
        data position, ``loop.state``): a ``fit`` afterwards is the ``fit``
        without it. :mod:`hookloop.lr_finder` says which hooks run (the step's,
        not the observers'; never the epoch, evaluation or checkpoint hooks).

        :param mode: ``"exponential"`` (evenly spaced in log10) or ``"linear"``.
        :param early_stop_threshold: stop when the smoothed loss exceeds this
            many times the best so far (while that best is positive; a
            non-finite loss always stops); None: never.
        :param networks: the networks whose learning rates are swept
            (default: every trained one); the others train as in a fit.
        :param monitor: the network whose loss the curve follows when the
            strategy returns one per network (a GAN); default: the one swept.
        :return: an :class:`~hookloop.lr_finder.LRFinderResult`: ``.lrs``,
            ``.losses``, ``.suggestion`` (where the loss falls fastest, or
            None with ``.reason``), ``.plot(path)`` (a PNG).
        """
        return _find_lr(self, min_lr=min_lr, max_lr=max_lr, num_training=num_training, mode=mode,
                        early_stop_threshold=early_stop_threshold, networks=networks, monitor=monitor)

    # -- context of a fit ------------------------------------------------------------

    @contextlib.contextmanager
    def _stage(self, stage: str) -> Iterator[None]:
        state = self.state
        before, state.stage = state.stage, stage
        try:
            yield
        finally:
            state.stage = before

    def close(self) -> None:
        """Release the prepared objects (the loop cannot train afterwards).

        The process group stays: a second ``Loop`` in the same script (a
        cross-validation fold) keeps working with several processes. Called
        for every open loop at interpreter exit, which then also destroys the
        process group: several gloo processes with a DDP-wrapped model
        otherwise abort in about 1 run in 3 while the interpreter tears down
        ("terminate called without an active exception")."""
        if self._closed:
            return
        self._closed = True
        try:
            self.hook.on_loop_end(loop=self)
        finally:
            self._release()

    def _release(self) -> None:
        for network in self.networks.values():
            network.model = network.unwrapped
            network.optimizer = network.scheduler = None
        self.train_data = self.eval_data = None
        self._prepared = weakref.WeakKeyDictionary()
        self.fastpath.forget()
        try:
            self._logbook.trackers.end()
            self.accelerator.free_memory()
        except Exception:  # noqa: BLE001 - best effort
            pass
        gc.collect()
