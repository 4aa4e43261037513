"""Hugging Face ``TrainerCallback``\\ s, unchanged, on a hookloop :class:`~hookloop.Loop`.

    from transformers import EarlyStoppingCallback, TrainingArguments
    from transformers.integrations import TensorBoardCallback
    from hookloop.adapters.transformers import TrainerCallbacks

    loop = Loop(model=model, optimizer=opt, scheduler=sched, train_data=train, eval_data=val,
                plugins=[TrainerCallbacks(
                    [EarlyStoppingCallback(early_stopping_patience=2), TensorBoardCallback()],
                    args=TrainingArguments(output_dir="out", eval_strategy="epoch",
                                           save_strategy="epoch", metric_for_best_model="eval_loss",
                                           load_best_model_at_end=True))])

The plugin keeps a true ``TrainerState`` and a ``TrainerControl`` and fires
the Trainer's events, through the Trainer's own ``CallbackHandler`` (so with
the keyword arguments the Trainer passes), at the points of the loop where
``Trainer.train()`` fires them; what the callbacks ask for through
``TrainerControl`` the loop does (stop, end the epoch, evaluate, save, log).
See ``docs/trainer-callbacks.md`` for the mapping and where it differs from
the Trainer, and why.

``transformers`` is imported when a :class:`TrainerCallbacks` is created,
never by ``import hookloop`` (``pip install hookloop[hf]``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from ..batches import length_of, loader_batch_size
from ..markers import hookimpl


def _transformers():
    try:
        import transformers  # noqa: F401
        from transformers import trainer_callback
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "hookloop.adapters.transformers.TrainerCallbacks needs transformers: "
            "pip install 'hookloop[hf]'"
        ) from exc
    return trainer_callback


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
        tc = _transformers()
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
        report = _reporting_callbacks(args.report_to) if args is not None else []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            #: the Trainer's ``CallbackHandler``: ``callback_handler.callbacks`` are the
            #: callbacks, in call order, as instances
            self.callback_handler = tc.CallbackHandler(
                [*_default_callbacks(tc), *report, *callbacks], None, processing_class, None, None
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
        self._saved_at: dict = {}  # global_step -> the checkpoint saved there
        self._best_step = None
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
        metrics = self._speed_metrics("test", start, num_samples=n, num_steps=length_of(data))
        self._event("on_predict", metrics=metrics)
        return outputs

    # -- state, saved in hookloop checkpoints ---------------------------------------

    def state_dict(self) -> dict:
        """The ``TrainerState`` (with the ``ExportableState`` callbacks' and
        the ``TrainerControl``'s state under ``stateful_callbacks``, as the
        Trainer writes ``trainer_state.json``), as plain data."""
        if self.state is None:
            return {"trainer_state": None}
        state = dataclasses.asdict(self.state)
        state["stateful_callbacks"] = self._callback_states()
        return {"trainer_state": _plain_data(state)}

    def load_state_dict(self, state: dict) -> None:
        """Restore the ``TrainerState`` and every stateful callback (the
        Trainer does the latter only with
        ``restore_callback_states_from_checkpoint=True``; hookloop's resume is
        exact, so always)."""
        self._restored = state.get("trainer_state")
        if self._restored is not None:
            self._restore()

    # -- hooks: the run --------------------------------------------------------------

    @hookimpl(tryfirst=True)  # before any plugin uses the accelerator: check it is whole
    def on_fit_start(self, loop):
        _check_accelerate_state()
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
            self._eval_saved = False
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
        # the learning rate of this update (the scheduler steps next)
        self._lr[network.name] = network.optimizer.param_groups[0]["lr"]
        with self._objects_of(network):
            self._event("on_optimizer_step")
        self._apply(loop)

    @hookimpl(wrapper=True)  # after the other plugins: a Checkpoint plugin's save is seen
    def after_step(self, loop, batch, loss):
        result = yield
        sync = loop.accelerator.sync_gradients
        self._add_loss(loss, sync)
        if self._tokens is not None and isinstance(batch, Mapping):
            inputs = batch.get(self._main_input)
            if isinstance(inputs, torch.Tensor):
                self._tokens += inputs.numel()
        if not sync:
            self._group_pos += 1
            self._event("on_substep_end")
            self._apply(loop)
            return result
        self._group_pos = 0
        self._sync_state(loop)
        self._event("on_step_end")
        self._apply(loop)
        if self.control.should_log and self.state.global_step > self._last_logged:
            self._log_training(loop)
        if self.control.should_evaluate:
            self._evaluate(loop)
        self._saved(loop, epoch_end=False)
        return result

    @hookimpl
    def on_train_epoch_end(self, loop):
        self._eval_saved = False
        self._sync_state(loop)
        self._event("on_epoch_end")
        self._apply(loop)
        if self.control.should_log and self.state.global_step > self._last_logged:
            self._log_training(loop)
        if self.control.should_evaluate and loop.eval_data is None:
            self._evaluate(loop)
        # with eval_data the loop's own evaluation follows: reported by on_eval_end

    @hookimpl(wrapper=True)  # after the other plugins, a Checkpoint plugin's save included
    def on_epoch_end(self, loop):
        result = yield
        self._saved(loop, epoch_end=loop.state.epoch_complete)
        return result

    @hookimpl(wrapper=True)  # after the other plugins' end-of-fit work
    def on_fit_end(self, loop):
        result = yield
        self._new_save()  # a Checkpoint plugin's final save: the Trainer has none to report
        self._training = False
        self._log_train_summary(loop)
        if self.args.load_best_model_at_end and self.state.best_model_checkpoint is not None:
            self._load_best_model(loop)
        self._event("on_train_end")
        return result

    @hookimpl
    def on_exception(self):
        self._training = False

    # -- hooks: evaluation -------------------------------------------------------------

    @hookimpl
    def on_eval_start(self, loop):
        self._setup(loop)  # loop.evaluate() before any fit
        self._eval_start = time.time()
        self._eval_batches = self._eval_examples = 0
        self.callback_handler.eval_dataloader = (
            self._evaluating if self._evaluating is not None else loop.eval_data
        )

    @hookimpl
    def after_eval_step(self, loop, batch):
        if loop.state.stage != "eval":  # not the sanity check
            return None
        self._eval_batches += 1
        self._eval_examples += _examples(batch)
        self._event("on_prediction_step")
        return None

    @hookimpl(wrapper=True)  # the metrics every plugin added; a Checkpoint(monitor=) save seen
    def on_eval_end(self, loop, metrics):
        result = yield
        self._report_evaluation(loop, metrics)
        path = self._new_save() if self._training else None
        if path is not None:  # a Checkpoint plugin saved for this evaluation (monitor=...)
            self._eval_saved = True
            self._report_save(loop, path)
        return result

    def _report_evaluation(self, loop, metrics):
        n = self._eval_examples * loop.accelerator.num_processes
        out = {}
        for key, value in metrics.items():  # the Trainer's metric_key_prefix rule
            out[key if key.startswith("eval_") else f"eval_{key}"] = _number(value)
        out.update(self._speed_metrics("eval", self._eval_start, num_samples=n,
                                       num_steps=self._eval_batches))
        self._log(loop, out)  # adds "epoch", as Trainer.log does to the same dict
        self._event("on_evaluate", metrics=out)
        self._apply(loop)
        is_best = self._determine_best_metric(out)
        if _value(self.args.save_strategy) == "best":
            self.control.should_save = is_best

    # -- the work ----------------------------------------------------------------------

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
            self.args = _default_args(loop)
        if self.state is None:
            acc = loop.accelerator
            stateful = [cb for cb in [*h.callbacks, self.control] if isinstance(cb, self._tc.ExportableState)]
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
        self._lr: dict = {}
        self._group: dict = {}
        self._group_n = 0
        self._group_pos = 0
        self._tr_loss: dict = {}
        self._total_loss: dict = {}
        self._skip_epoch = False
        self._checkpoints: list = []
        self._seen: list = []
        self._eval_saved = False  # a Checkpoint plugin saved for an evaluation in this step
        self._evaluating = None
        self._eval_start = time.time()
        self._eval_batches = self._eval_examples = 0
        self._tokens = None
        self._main_input = "input_ids"
        self._flos_per_token = 0
        self._last_logged = 0

    def _start_training(self, loop):
        """What ``Trainer.train()`` sets up before ``on_train_begin``."""
        from .. import checkpointing

        self._reset_run()
        acc = loop.accelerator
        st = self.state
        st.global_step = loop.state.global_step
        total = loop.total_steps
        st.max_steps = total if total is not None else sys.maxsize  # epochs of unknown length
        length = length_of(loop.train_data)
        self._batches_per_epoch = length
        k = acc.gradient_accumulation_steps
        per_epoch = max(-(-length // k), 1) if length else None
        if loop.state.max_epochs is not None:
            st.num_train_epochs = loop.state.max_epochs
        elif per_epoch is not None:
            st.num_train_epochs = -(-st.max_steps // per_epoch)
        else:
            st.num_train_epochs = sys.maxsize
        st.train_batch_size = loader_batch_size(loop.train_data)
        st.is_local_process_zero = acc.is_local_main_process
        st.is_world_process_zero = acc.is_main_process
        st.compute_steps(self.args, st.max_steps)
        self._checkpoints = checkpointing.checkpoint_plugins(loop)
        self._seen = [p.last_saved for p in self._checkpoints]
        self._last_logged = st.global_step
        self._initial_step = st.global_step
        self._initial_micro = loop.state.micro_step
        self._start_time = time.time()
        model = self._main.unwrapped
        if hasattr(model, "num_parameters"):  # the Trainer's floating_point_ops estimate
            self._tokens = 0
            self._main_input = getattr(model, "main_input_name", "input_ids")
            self._flos_per_token = 6 * model.num_parameters(exclude_embeddings=True)

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

    def _add_loss(self, loss, sync):
        """Keep the loss on the device: per update the mean of its
        micro-batches' losses, summed until the next log."""
        items = loss.items() if isinstance(loss, Mapping) else ((None, loss),)
        group = self._group
        for key, value in items:
            value = value.detach()
            before = group.get(key)
            group[key] = value if before is None else before + value
        self._group_n += 1
        if sync:
            n, tr = self._group_n, self._tr_loss
            for key, value in group.items():
                update = value if n == 1 else value / n
                before = tr.get(key)
                tr[key] = update if before is None else before + update
            group.clear()
            self._group_n = 0

    def _log_training(self, loop):
        """``Trainer._maybe_log_save_evaluate``'s log: the mean loss per
        update since the last log, the gradient norm, the learning rate."""
        st = self.state
        steps = st.global_step - self._last_logged
        logs = {}
        for key, value in self._read_losses(loop).items():
            self._total_loss[key] = self._total_loss.get(key, 0.0) + value
            logs[_named("loss", key)] = value / steps
        for name, network in loop.networks.items():
            if network.grad_norm is not None:
                logs[_named("grad_norm", name if self._several else None)] = _number(network.grad_norm)
        for name, network in loop.networks.items():
            if network.optimizer is None:
                continue
            lr = self._lr.get(name, network.optimizer.param_groups[0]["lr"])
            logs[_named("learning_rate", name if self._several else None)] = _number(lr)
        self._last_logged = st.global_step
        self._store_flos(loop)
        self._log(loop, logs)

    def _read_losses(self, loop) -> dict:
        """The summed losses since the last read, as floats (averaged over
        processes: an all-reduce, every process is here), and reset."""
        acc = loop.accelerator
        tr, self._tr_loss = self._tr_loss, {}
        if not tr:
            return {}
        keys = list(tr)
        values = torch.stack([tr[k].float().reshape(()) for k in keys])
        if acc.num_processes > 1:
            values = acc.reduce(values, reduction="mean")
        return dict(zip(keys, values.tolist()))

    def _log(self, loop, logs):
        """``Trainer.log``: the epoch added, the history kept, ``on_log``."""
        st = self.state
        if st.epoch is not None:
            logs["epoch"] = st.epoch
        st.log_history.append({**logs, "step": st.global_step})
        self._event("on_log", logs=logs)
        self._apply(loop)
        if self.trackers:
            loop.log({k: v for k, v in logs.items() if isinstance(v, (int, float))})

    def _log_train_summary(self, loop):
        """The Trainer's last log: speed, total FLOs, the mean training loss."""
        st = self.state
        steps = st.global_step - self._initial_step
        for key, value in self._read_losses(loop).items():
            self._total_loss[key] = self._total_loss.get(key, 0.0) + value
        batches = loop.state.micro_step - self._initial_micro
        samples = batches * (st.train_batch_size or 1) * loop.accelerator.num_processes
        metrics = self._speed_metrics("train", self._start_time, num_samples=samples, num_steps=steps)
        self._store_flos(loop)
        metrics["total_flos"] = st.total_flos
        for key, total in self._total_loss.items() or {None: 0.0}.items():
            metrics[_named("train_loss", key)] = total / max(steps, 0.001)
        self._log(loop, metrics)

    def _store_flos(self, loop):
        if self._tokens:
            self.state.total_flos += float(self._tokens * self._flos_per_token * loop.accelerator.num_processes)
            self._tokens = 0

    def _speed_metrics(self, split, start, num_samples=None, num_steps=None):
        from transformers.trainer_utils import speed_metrics

        return speed_metrics(split, start, num_samples=num_samples, num_steps=num_steps)

    def _evaluate(self, loop):
        """``control.should_evaluate``: evaluate now (the loop's
        ``eval_data``, else this adapter's); reported by ``on_eval_end``."""
        data = None
        if loop.eval_data is None:
            if self.eval_data is None:
                self._warn_once(
                    "evaluate",
                    "TrainerCallbacks: a callback asked for an evaluation (control.should_evaluate), "
                    "but neither the Loop nor TrainerCallbacks(eval_data=...) has evaluation data",
                )
                self.control.should_evaluate = False
                return
            data = self.eval_data
        self._evaluating = data
        try:
            loop.evaluate(data)
        finally:
            self._evaluating = None
        self.control.should_evaluate = False

    def _determine_best_metric(self, metrics) -> bool:
        """``Trainer._determine_best_metric``."""
        args, st = self.args, self.state
        wanted = args.metric_for_best_model
        if wanted is None:
            return False
        key = wanted if wanted.startswith("eval_") else f"eval_{wanted}"
        if key not in metrics:
            raise KeyError(
                f"TrainingArguments.metric_for_best_model is {wanted!r}, but the evaluation "
                f"metrics have no {key!r}: they are {sorted(metrics)} (hookloop's metrics, "
                "named eval_<name> as the Trainer names them)"
            )
        value = metrics[key]
        better = (lambda a, b: a > b) if args.greater_is_better else (lambda a, b: a < b)
        if st.best_metric is None:
            st.best_metric = float("-inf") if args.greater_is_better else float("inf")
        if better(value, st.best_metric):
            st.best_metric = value
            if _value(args.save_strategy) in ("steps", "epoch", "best"):
                self._best_step = st.global_step
                if hasattr(st, "best_global_step"):
                    st.best_global_step = st.global_step
            return True
        return False

    def _new_save(self):
        """The checkpoint a Checkpoint plugin wrote since the last look, if any."""
        now = [p.last_saved for p in self._checkpoints]
        path = next((n for n, seen in zip(now, self._seen) if n is not None and n != seen), None)
        self._seen = now
        return path

    def _saved(self, loop, epoch_end):
        """After a step or epoch end: the checkpoint a Checkpoint plugin
        wrote meanwhile, else the one ``control.should_save`` asks for; then
        ``on_save``."""
        path = self._new_save()
        saved_for_evaluation, self._eval_saved = self._eval_saved, False
        if path is None and self.control.should_save:
            if saved_for_evaluation:  # this step's evaluation was saved (and reported) already
                self.control.should_save = False
                return
            path = self._save(loop, epoch_end)
            self._seen = [p.last_saved for p in self._checkpoints]
        if path is not None:
            self._report_save(loop, path)

    def _report_save(self, loop, path):
        st = self.state
        self._saved_at[st.global_step] = str(path)
        best = getattr(st, "best_global_step", None) or self._best_step
        if best and best in self._saved_at and Path(self._saved_at[best]).is_dir():
            st.best_model_checkpoint = self._saved_at[best]
        self._best_from_checkpoint_plugins()
        self._event("on_save")
        self._apply(loop)

    def _save(self, loop, epoch_end):
        """A checkpoint now, by the first Checkpoint plugin
        (:meth:`hookloop.plugins.Checkpoint.save`: its directory, rotation and
        best-k ranking)."""
        if not self._checkpoints:
            self._warn_once(
                "save",
                "TrainerCallbacks: a callback asked for a checkpoint (control.should_save, e.g. "
                "TrainingArguments(save_strategy=...)), but the loop has no "
                "hookloop.plugins.Checkpoint plugin: nothing is saved. Add Checkpoint(...) to the "
                "plugins, or set save_strategy='no'",
            )
            self.control.should_save = False
            return None
        # as the plugin's own saves: its directory, rotation, best-k ranking, and
        # no second save of this position at the fit's end
        return self._checkpoints[0].save(loop, reason="trainer_callbacks", epoch_end=epoch_end)

    def _best_from_checkpoint_plugins(self):
        """A Checkpoint plugin that keeps the best checkpoints (``best``:
        path and value) names the best model."""
        wanted = self.args.metric_for_best_model
        names = (None,) if wanted is None else (wanted, wanted if wanted.startswith("eval_") else f"eval_{wanted}")
        for plugin in self._checkpoints:
            best = getattr(plugin, "best", None)
            if best is None or (wanted is not None and getattr(plugin, "monitor", None) not in names):
                continue  # it keeps the best by another metric than metric_for_best_model
            if isinstance(best, Mapping):
                path, value = best.get("path"), best.get("value")
            elif isinstance(best, (tuple, list)) and len(best) == 2:
                path, value = best
            else:
                path, value = getattr(best, "path", best), getattr(best, "value", None)
            if path is not None:
                self.state.best_model_checkpoint = str(path)
                if value is not None and self.args.metric_for_best_model is None:
                    self.state.best_metric = _number(value)
            return

    def _load_best_model(self, loop):
        """``load_best_model_at_end``: the best checkpoint's model weights
        (only those, as the Trainer loads them) into every network."""
        from safetensors.torch import load_file

        from .. import checkpointing

        path = Path(self.state.best_model_checkpoint)
        doc = checkpointing.read_manifest(path)
        for name, network in loop.networks.items():
            file = (doc.get("networks", {}).get(name) or {}).get("model")
            if not file:
                continue
            model = network.unwrapped
            missing, unexpected = model.load_state_dict(load_file(str(path / file)), strict=False)
            # safetensors keeps one name of tied (shared) weights: those come back with it
            shared = {id(t.untyped_storage()) for k, t in model.state_dict().items() if k not in missing}
            lost = [k for k in missing if id(model.state_dict()[k].untyped_storage()) not in shared]
            if unexpected or lost:
                raise RuntimeError(
                    f"TrainerCallbacks: load_best_model_at_end: {path / file} does not fit network "
                    f"{name!r} (missing {lost}, unexpected {unexpected})"
                )
        loop.print(f"hookloop: loaded the best model ({self.args.metric_for_best_model} = "
                   f"{self.state.best_metric}) from {path}")

    def _callback_states(self) -> dict:
        """``TrainerState.stateful_callbacks``, as ``Trainer._save_checkpoint``
        fills it: by class name, a list for several of one class."""
        out: dict = {}
        for cb in [*self.callback_handler.callbacks, self.control]:
            if not isinstance(cb, self._tc.ExportableState):
                continue
            name, state = type(cb).__name__, cb.state()
            if name in out:
                if not isinstance(out[name], list):
                    out[name] = [out[name]]
                out[name].append(state)
            else:
                out[name] = state
        return out

    def _restore(self):
        saved, self._restored = self._restored, None
        known = {f.name for f in dataclasses.fields(self._tc.TrainerState)}
        state = self._tc.TrainerState(**{k: v for k, v in saved.items() if k in known})
        if state.best_model_checkpoint is not None and not Path(state.best_model_checkpoint).is_dir():
            state.best_model_checkpoint = None
        self.state = state
        seen: dict = {}
        for cb in [*self.callback_handler.callbacks, self.control]:
            if not isinstance(cb, self._tc.ExportableState):
                continue
            name = type(cb).__name__
            entry = state.stateful_callbacks.get(name)
            if isinstance(entry, list):
                i = seen[name] = seen.get(name, -1) + 1
                entry = entry[i] if i < len(entry) else None
            if not isinstance(entry, Mapping):
                continue
            for key, value in (entry.get("args") or {}).items():
                if hasattr(cb, key):
                    setattr(cb, key, value)
            for key, value in (entry.get("attributes") or {}).items():
                setattr(cb, key, value)

    def _warn_once(self, key, message):
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)


# -- helpers -------------------------------------------------------------------------------


def _default_callbacks(tc):
    from transformers import trainer

    return list(getattr(trainer, "DEFAULT_CALLBACKS", [tc.DefaultFlowCallback]))


def _reporting_callbacks(report_to):
    from transformers.integrations import get_reporting_integration_callbacks

    return get_reporting_integration_callbacks(report_to)


def _default_args(loop):
    """``TrainingArguments`` describing the loop (see :class:`TrainerCallbacks`)."""
    from transformers import TrainingArguments

    from ..plugins.logger import Logger

    acc = loop.accelerator
    state = loop.state
    every = next((p.every for _, p in loop.plugins.pm.list_name_plugin() if isinstance(p, Logger)), 50)
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    eval_key = "eval_strategy" if "eval_strategy" in fields else "evaluation_strategy"
    wanted = {
        "output_dir": acc.project_dir or ".",
        "report_to": [],
        eval_key: "epoch" if loop.eval_data is not None else "no",
        "save_strategy": "no",
        "logging_strategy": "steps",
        "logging_steps": every,
        "gradient_accumulation_steps": acc.gradient_accumulation_steps,
        "per_device_train_batch_size": loader_batch_size(loop.train_data) or 8,
        "per_device_eval_batch_size": loader_batch_size(loop.eval_data) or 8,
        "num_train_epochs": float(state.max_epochs or 1),
        "max_steps": state.max_steps or -1,
        "use_cpu": acc.device.type == "cpu",
        # else TrainingArguments resets Accelerate's state, under the loop's Accelerator
        "accelerator_config": {"use_configured_state": True},
    }
    return TrainingArguments(**{k: v for k, v in wanted.items() if k in fields})


def _check_accelerate_state():
    """``TrainingArguments(...)`` resets Accelerate's process-wide state
    when it is created (unless ``accelerator_config={"use_configured_state":
    True}``): created after the loop's ``Accelerator``, it leaves that
    accelerator without a state, and every later use fails obscurely."""
    from accelerate.state import AcceleratorState

    if not AcceleratorState._shared_state:
        raise RuntimeError(
            "TrainerCallbacks: Accelerate's state was reset after the loop's Accelerator was "
            "created: creating transformers.TrainingArguments does that. Create the "
            "TrainingArguments before the Accelerator, or pass them "
            "accelerator_config={'use_configured_state': True}"
        )


def _value(option):
    """An enum option (``SaveStrategy.EPOCH``) as its string."""
    return getattr(option, "value", option)


def _named(base, key):
    return base if key is None else f"{base}/{key}"


def _number(value):
    if isinstance(value, torch.Tensor):
        return value.item()
    try:
        import numpy as np

        if isinstance(value, np.generic):
            return value.item()
    except ImportError:  # pragma: no cover
        pass
    return value


def _plain_data(obj):
    """Numbers as Python numbers (numpy scalars, 0-d tensors from callbacks)."""
    if isinstance(obj, Mapping):
        return {k: _plain_data(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain_data(v) for v in obj)
    return _number(obj)


def _examples(batch) -> int:
    """Examples in a batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.ndim else 1
    if isinstance(batch, Mapping):
        values = batch.values()
    elif isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        values = batch
    else:
        return 0
    for value in values:
        n = _examples(value) if isinstance(value, (torch.Tensor, Mapping, Sequence)) else 0
        if n:
            return n
    return 0


__all__ = ["TrainerCallbacks"]
