"""The plugin: :class:`TrainerCallbacks`, its hooks, which fire the
Trainer's events through the Trainer's ``CallbackHandler`` at the points of
the loop where ``Trainer.train()`` fires them (events in), and do what the
callbacks ask through ``TrainerControl`` (control out). Its helpers: the training log
(:class:`~.logs.TrainingLog`), the evaluations (:class:`~.evaluation.Evaluations`),
the checkpoints and best model (:class:`~.saves.Saves`), the state codec
(:mod:`.codec`), what the Trainer sets up (:mod:`.defaults`)."""

from __future__ import annotations

import contextlib
import time
import warnings

from ...batches import length_of
from ...markers import hookimpl
from . import codec
from .defaults import (check_accelerate_state, default_args, default_callbacks, load_transformers,
                       reporting_callbacks, start_state)
from .evaluation import Evaluations
from .logs import TrainingLog, speed_metrics
from .saves import Saves


class TrainerCallbacks:
    """Run Hugging Face ``transformers.TrainerCallback`` objects (instances
    or classes, as ``Trainer(callbacks=...)`` takes them) as one hookloop
    plugin.

    :param callbacks: the callbacks. The Trainer's ``DefaultFlowCallback``
        (which turns the ``*_strategy`` / ``*_steps`` arguments into
        ``TrainerControl`` requests) comes first, then the integrations
        ``args.report_to`` names, then these, as in ``Trainer``.
        ``ProgressCallback`` is not added (hookloop has its own bar).
    :param args: a ``transformers.TrainingArguments``; default: built from
        the loop at every fit: ``output_dir`` the accelerator's
        ``project_dir`` (else ``.``), evaluation at every epoch end when the
        loop has ``eval_data``, no saving, logging every ``Logger(every=N)``
        updates (N = 50 without a Logger), nothing in ``report_to``, and the
        loop's batch size, accumulation, epochs or ``max_steps``. Callbacks
        read the fields they read (``metric_for_best_model``,
        ``greater_is_better``, ``load_best_model_at_end``, ``logging_dir``,
        ``report_to`` ...); the adapter honours ``logging_*``, ``eval_*``,
        ``save_*`` (through ``DefaultFlowCallback``), ``metric_for_best_model``,
        ``greater_is_better``, ``load_best_model_at_end`` and ``report_to``.
    :param network: the network whose ``model``, ``optimizer`` and
        ``lr_scheduler`` the events carry (default: ``"model"``, else the
        first network). ``on_pre_optimizer_step`` / ``on_optimizer_step``
        fire once per network updated, with that network's objects.
    :param eval_data: data for the evaluations the callbacks ask for
        (``control.should_evaluate``) when the loop has no ``eval_data`` of
        its own: give the evaluation set here rather than to the ``Loop`` to
        evaluate exactly when ``eval_strategy`` says, as the Trainer does.
    :param processing_class: passed to every event as ``processing_class``
        (a tokenizer, an image processor).
    :param trackers: also send every ``on_log`` dict to ``loop.log`` (the
        accelerator's trackers).

    Every evaluation the loop runs (at an epoch end with ``eval_data``,
    ``fit(eval_every=N)``, :meth:`Loop.evaluate`) is an evaluation for the
    callbacks: ``on_log`` and ``on_evaluate`` with the metrics named as the
    Trainer names them (``eval_<name>``, plus ``eval_runtime``,
    ``eval_samples_per_second``, ``eval_steps_per_second``). Every checkpoint
    a :class:`~hookloop.plugins.Checkpoint` plugin writes at a step or epoch
    end is an ``on_save``; ``control.should_save`` makes one (the loop needs
    a ``Checkpoint`` plugin for that).

    Costs nothing when not used; when used, per batch a few hook calls and
    one tensor addition (the loss kept for ``on_log``, on the device); the
    loss is read (one device sync, an all-reduce with several processes) only
    when logging.
    """

    name = "trainer-callbacks"
    #: callbacks stop training, end epochs, load the best model at the end
    changes_training = True

    def __init__(self, callbacks=(), args=None, *, network: str | None = None, eval_data=None,
                 processing_class=None, trackers: bool = False):
        tc = load_transformers()
        from transformers import TrainingArguments

        if isinstance(callbacks, tc.TrainerCallback) or isinstance(callbacks, type):
            callbacks = [callbacks]
        callbacks = list(callbacks)
        for cb in callbacks:
            cls = cb if isinstance(cb, type) else type(cb)
            if not (isinstance(cls, type) and issubclass(cls, tc.TrainerCallback)):
                raise TypeError(
                    f"TrainerCallbacks: {cb!r} is not a transformers.TrainerCallback (instance or "
                    "class); a hookloop plugin goes into Loop(plugins=[...]) directly"
                )
        if args is not None and not isinstance(args, TrainingArguments):
            raise TypeError(
                f"TrainerCallbacks: args must be a transformers.TrainingArguments, got "
                f"{type(args).__name__}"
            )
        self._tc = tc
        self._given_args = args
        #: the ``TrainingArguments`` the callbacks see (built at the first fit if not given)
        self.args = args
        self.network = network
        self.eval_data = eval_data
        self.processing_class = processing_class
        self.trackers = bool(trackers)
        #: with ``trackers``, every evaluation's metrics reach the trackers from here, as the
        #: Trainer logs them: the built-in default ``track-metrics`` then writes none
        self.replaces = ("track-metrics",) if self.trackers else ()
        report = reporting_callbacks(args.report_to) if args is not None else []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            #: the Trainer's ``CallbackHandler``: ``callback_handler.callbacks`` are the
            #: callbacks, in call order, as instances
            self.callback_handler = tc.CallbackHandler(
                [*default_callbacks(tc), *report, *callbacks], None, processing_class, None, None
            )
        #: the ``TrainerControl`` the callbacks change
        self.control = tc.TrainerControl()
        #: the ``TrainerState`` the callbacks read (None until the first fit or evaluation)
        self.state = None
        self._loop = None
        self._restored = None
        self._training = False
        self._init_sent = False
        self._warned: set[str] = set()
        self._saves = Saves(self)  # checkpoints (on_save) and the best model, over every fit
        self._reset_run()

    # -- the Trainer's callback API ------------------------------------------------

    @property
    def callbacks(self) -> list:
        """The callbacks, in call order (``DefaultFlowCallback`` first)."""
        return self.callback_handler.callbacks

    def add_callback(self, callback):
        """As ``Trainer.add_callback``: an instance or a class."""
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback):
        """As ``Trainer.pop_callback``: remove and return it."""
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback):
        """As ``Trainer.remove_callback``."""
        self.callback_handler.remove_callback(callback)

    def predict(self, loop, data):
        """``loop.predict(data)``, then the callbacks' ``on_predict`` with the
        Trainer's speed metrics (``test_runtime``, ...): :meth:`Loop.predict`
        has no hook at its end."""
        self._setup(loop)
        self.callback_handler.eval_dataloader = data
        start = time.time()
        outputs = loop.predict(data)
        n = length_of(getattr(data, "dataset", None))
        metrics = speed_metrics("test", start, num_samples=n, num_steps=length_of(data))
        self._event("on_predict", metrics=metrics)
        return outputs

    # -- state, saved in hookloop checkpoints ---------------------------------------

    def state_dict(self) -> dict:
        """The ``TrainerState`` (with the ``ExportableState`` callbacks' and
        the ``TrainerControl``'s state under ``stateful_callbacks``, as the
        Trainer writes ``trainer_state.json``), as plain data."""
        if self.state is None:
            return {"trainer_state": None}
        return {"trainer_state": codec.encode(self._tc, self.state, self._stateful_objects())}

    def load_state_dict(self, state: dict) -> None:
        """Restore the ``TrainerState`` and every stateful callback (the
        Trainer does the latter only with
        ``restore_callback_states_from_checkpoint=True``; hookloop's resume is
        exact, so always)."""
        self._restored = state.get("trainer_state")
        if self._restored is not None:
            self._restore()

    def _stateful_objects(self) -> list:
        """Where ``ExportableState``\\ s may be: the callbacks, then the control."""
        return [*self.callback_handler.callbacks, self.control]

    def _restore(self):
        saved, self._restored = self._restored, None
        self.state = codec.decode(self._tc, saved, self._stateful_objects())

    # -- hooks: the run --------------------------------------------------------------

    @hookimpl(tryfirst=True)  # before any plugin uses the accelerator: check it is whole
    def on_fit_start(self, loop):
        check_accelerate_state()
        self._setup(loop, fit=True)
        self._start_training(loop)
        self._training = True
        self._event("on_train_begin")
        self._apply(loop)

    @hookimpl
    def on_epoch_start(self, loop):
        self._group_pos = 0
        self._skip_epoch = False
        self._event("on_epoch_begin")
        self._apply(loop)

    @hookimpl(tryfirst=True)
    def training_step(self, loop):
        # before the strategy (and only for batches that are trained)
        if self._group_pos == 0:
            self._event("on_step_begin")
            self._apply(loop)
        return None  # firstresult: the strategy's result follows

    @hookimpl
    def before_optimizer_step(self, loop, network):
        with self._objects_of(network):
            self._event("on_pre_optimizer_step")
        self._apply(loop)

    @hookimpl
    def after_optimizer_step(self, loop, network):
        self._logs.note_lr(network)
        with self._objects_of(network):
            self._event("on_optimizer_step")
        self._apply(loop)

    @hookimpl(wrapper=True)  # after the other plugins: a Checkpoint plugin's save is seen
    def after_step(self, loop, batch, loss):
        result = yield
        sync = loop.accelerator.sync_gradients
        self._logs.add_batch(batch, loss, sync)
        if not sync:
            self._group_pos += 1
            self._event("on_substep_end")
            self._apply(loop)
            return result
        self._group_pos = 0
        self._sync_state(loop)
        self._event("on_step_end")
        self._apply(loop)
        if self.control.should_log and self.state.global_step > self._logs.last_logged:
            self._logs.log_training(loop, self._several)
        if self.control.should_evaluate:
            self._evals.run(loop)
        return result  # a save control.should_save asks for is taken at the safe point

    @hookimpl
    def on_train_epoch_end(self, loop):
        self._sync_state(loop)
        self._event("on_epoch_end")
        self._apply(loop)
        if self.control.should_log and self.state.global_step > self._logs.last_logged:
            self._logs.log_training(loop, self._several)
        if self.control.should_evaluate and loop.eval_data is None:
            self._evals.run(loop)
        # with eval_data the loop's own evaluation follows: reported by on_eval_end

    @hookimpl(wrapper=True)  # around the Checkpoint plugin, which saves here
    def on_safe_point(self, loop, fit_end):
        self._saves.before_safe_point(loop)  # control.should_save: ask the Checkpoint plugin
        result = yield
        self._saves.after_safe_point(loop, fit_end)  # what it saved is an on_save
        return result

    @hookimpl(wrapper=True)  # after the other plugins' end-of-fit work
    def on_fit_end(self, loop):
        result = yield
        self._saves.fit_ended()
        self._training = False
        self._logs.log_train_summary(loop)
        if self.args.load_best_model_at_end and self.state.best_model_checkpoint is not None:
            self._saves.load_best_model(loop)
        self._event("on_train_end")
        return result

    @hookimpl
    def on_exception(self):
        self._training = False

    # -- hooks: evaluation -------------------------------------------------------------

    @hookimpl
    def on_eval_start(self, loop):
        if loop.state.stage == "sanity":
            return  # the sanity check is no evaluation for the callbacks
        self._setup(loop)  # loop.evaluate() before any fit
        self.callback_handler.eval_dataloader = self._evals.started(loop)

    @hookimpl
    def after_eval_step(self, loop, batch):
        if loop.state.stage != "eval":  # not the sanity check
            return None
        self._evals.count(batch)
        self._event("on_prediction_step")
        return None

    @hookimpl(wrapper=True)  # the metrics every plugin added
    def on_eval_end(self, loop, metrics):
        result = yield
        if loop.state.stage == "sanity":
            return result
        out = self._evals.metrics(loop, metrics)
        self._logs.log(loop, out)  # adds "epoch", as Trainer.log does to the same dict
        self._event("on_evaluate", metrics=out)
        self._apply(loop)
        self._saves.evaluated(out)
        return result

    # -- meeting the loop --------------------------------------------------------------

    def _setup(self, loop, fit=False):
        """Meet the loop: the objects the events carry, the state, the
        arguments; ``on_init_end`` once."""
        if self._loop is not loop:
            self._loop = loop
            names = list(loop.networks)
            name = self.network if self.network is not None else ("model" if "model" in names else names[0])
            if name not in loop.networks:
                raise ValueError(f"TrainerCallbacks(network={name!r}): the loop's networks are {names}")
            self._main = loop.networks[name]
            self._several = len(names) > 1
        h = self.callback_handler
        h.model, h.optimizer, h.lr_scheduler = self._main.unwrapped, self._main.optimizer, self._main.scheduler
        h.processing_class = self.processing_class
        h.train_dataloader = loop.train_data
        if self._given_args is None and (fit or self.args is None):
            self.args = default_args(loop)
        if self.state is None:
            acc = loop.accelerator
            stateful = [cb for cb in self._stateful_objects() if isinstance(cb, self._tc.ExportableState)]
            self.state = self._tc.TrainerState(
                is_local_process_zero=acc.is_local_main_process,
                is_world_process_zero=acc.is_main_process,
                stateful_callbacks=stateful,
            )
        if self._restored is not None:
            self._restore()
        if not self._init_sent:
            self._init_sent = True
            self._event("on_init_end")

    def _reset_run(self):
        self._group_pos = 0
        self._skip_epoch = False
        self._evals = Evaluations(self)
        self._logs = TrainingLog(self)  # the Trainer's training log, of one fit
        self._saves.new_run()

    def _start_training(self, loop):
        """What ``Trainer.train()`` sets up before ``on_train_begin``."""
        self._reset_run()
        self._batches_per_epoch = start_state(self.state, loop, self.args)
        self._saves.start(loop)
        self._logs.start(loop, self._main.unwrapped)

    # -- events in, control out ----------------------------------------------------------

    def _event(self, name, **kwargs):
        self.control = getattr(self.callback_handler, name)(self.args, self.state, self.control, **kwargs)

    def _apply(self, loop):
        """What the callbacks asked for that takes effect later."""
        control = self.control
        if not self._training:
            return
        if control.should_training_stop and not loop.state.should_stop:
            loop.stop("a Trainer callback set control.should_training_stop")
        if control.should_epoch_stop:
            self._skip_epoch = True  # the epoch's fraction stays where training stopped
            loop.end_epoch()  # at the next update boundary, as if the data had run out

    @contextlib.contextmanager
    def _objects_of(self, network):
        """The events of one network's update carry its objects."""
        if not self._several or network is self._main:
            yield
            return
        h = self.callback_handler
        before = h.model, h.optimizer, h.lr_scheduler
        h.model, h.optimizer, h.lr_scheduler = network.unwrapped, network.optimizer, network.scheduler
        try:
            yield
        finally:
            h.model, h.optimizer, h.lr_scheduler = before

    def _sync_state(self, loop):
        st = self.state
        st.global_step = loop.state.global_step
        if self._skip_epoch:
            return  # the epoch ended where training stopped (loop.end_epoch)
        length = self._batches_per_epoch
        st.epoch = loop.state.epoch + (loop.state.step_in_epoch / length if length else 0.0)

    def _warn_once(self, key, message):
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
