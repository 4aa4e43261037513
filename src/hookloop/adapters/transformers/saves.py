"""Checkpoints as the callbacks see them, and the best model: which
checkpoint a :class:`~hookloop.plugins.Checkpoint` plugin wrote (and when it
is an ``on_save``), the save ``control.should_save`` asks for, the best
metric (``Trainer._determine_best_metric``) and checkpoint, and
``load_best_model_at_end``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from .values import number, value


class Saves:
    """The checkpoints and the best model of a
    :class:`~hookloop.adapters.transformers.TrainerCallbacks` ``plugin``:
    it reads the plugin's ``args``, ``state`` and ``control`` and fires
    ``on_save`` through it.

    How the adapter learns that a Checkpoint plugin saved is here alone.
    Checkpoints are written at the loop's safe points (after an update and
    its evaluations, after an epoch end), so that is where a save
    ``control.should_save`` asks for is handed to the first Checkpoint
    plugin (:meth:`before_safe_point`) and where what a Checkpoint plugin
    wrote becomes an ``on_save`` (:meth:`after_safe_point`): after the
    step's ``on_step_end``, log and evaluation, or after the epoch's
    ``on_epoch_end``, as ``Trainer._maybe_log_save_evaluate`` orders them.
    """

    def __init__(self, plugin):
        self._plugin = plugin
        #: global_step -> the checkpoint saved there (every fit of the plugin)
        self.saved_at: dict = {}
        self._best_step = None
        self.new_run()

    def new_run(self):
        """Forget the last fit's Checkpoint plugins."""
        self._checkpoints: list = []
        self._seen: list = []
        self._asked = False  # this adapter asked for the save of this safe point

    def start(self, loop):
        """A fit starts: the loop's Checkpoint plugins, and what they saved so far."""
        from ... import checkpointing

        self._checkpoints = checkpointing.checkpoint_plugins(loop)
        self._seen = [p.last_saved for p in self._checkpoints]

    # -- when a Checkpoint plugin saved ------------------------------------------------

    def _new_save(self):
        """The checkpoint a Checkpoint plugin wrote since the last look, if any."""
        now = [p.last_saved for p in self._checkpoints]
        path = next((n for n, seen in zip(now, self._seen) if n is not None and n != seen), None)
        self._seen = now
        return path

    def before_safe_point(self, loop):
        """``control.should_save`` (from ``save_steps``, ``save_strategy``, a
        callback): the first Checkpoint plugin saves at this safe point."""
        self._asked = False
        if not self._plugin.control.should_save:
            return
        if not self._checkpoints:
            self._plugin._warn_once(
                "save",
                "TrainerCallbacks: a callback asked for a checkpoint (control.should_save, e.g. "
                "TrainingArguments(save_strategy=...)), but the loop has no "
                "hookloop.plugins.Checkpoint plugin: nothing is saved. Add Checkpoint(...) to the "
                "plugins, or set save_strategy='no'",
            )
            self._plugin.control.should_save = False
            return
        # as the plugin's own saves: its directory, rotation, best-k ranking
        self._checkpoints[0].request(reason="trainer_callbacks")
        self._asked = True

    def after_safe_point(self, loop, fit_end):
        """What a Checkpoint plugin saved at this safe point is an ``on_save``
        (but not the loop's own last checkpoint of the fit, which the
        Trainer does not have)."""
        path = self._new_save()
        asked, self._asked = self._asked, False
        if path is None and asked:  # this position was saved already: that checkpoint
            path = self._checkpoints[0].last_saved
        if path is None:
            return
        if fit_end and not asked and all(getattr(p, "last_reason", None) == "fit_end"
                                         for p in self._checkpoints if p.last_saved == path):
            return
        self._report_save(loop, path)

    def fit_ended(self):
        """Anything saved since the last safe point: the Trainer has nothing to report."""
        self._new_save()

    # -- saving and reporting ------------------------------------------------------------

    def _report_save(self, loop, path):
        plugin = self._plugin
        st = plugin.state
        self.saved_at[st.global_step] = str(path)
        best = getattr(st, "best_global_step", None) or self._best_step
        if best and best in self.saved_at and Path(self.saved_at[best]).is_dir():
            st.best_model_checkpoint = self.saved_at[best]
        self._best_from_checkpoint_plugins()
        plugin._event("on_save")
        plugin._apply(loop)

    # -- the best model ----------------------------------------------------------------

    def evaluated(self, metrics):
        """The evaluation's ``metrics`` (named as the Trainer names them):
        the best metric so far, and under ``save_strategy="best"`` a save
        when it is a new best."""
        is_best = self._determine_best_metric(metrics)
        if value(self._plugin.args.save_strategy) == "best":
            self._plugin.control.should_save = is_best

    def _determine_best_metric(self, metrics) -> bool:
        """``Trainer._determine_best_metric``."""
        args, st = self._plugin.args, self._plugin.state
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
        current = metrics[key]
        better = (lambda a, b: a > b) if args.greater_is_better else (lambda a, b: a < b)
        if st.best_metric is None:
            st.best_metric = float("-inf") if args.greater_is_better else float("inf")
        if better(current, st.best_metric):
            st.best_metric = current
            if value(args.save_strategy) in ("steps", "epoch", "best"):
                self._best_step = st.global_step
                if hasattr(st, "best_global_step"):
                    st.best_global_step = st.global_step
            return True
        return False

    def _best_from_checkpoint_plugins(self):
        """A Checkpoint plugin that keeps the best checkpoints (``best``:
        path and value) names the best model."""
        args, st = self._plugin.args, self._plugin.state
        wanted = args.metric_for_best_model
        names = (None,) if wanted is None else (wanted, wanted if wanted.startswith("eval_") else f"eval_{wanted}")
        for plugin in self._checkpoints:
            best = getattr(plugin, "best", None)
            if best is None or (wanted is not None and getattr(plugin, "monitor", None) not in names):
                continue  # it keeps the best by another metric than metric_for_best_model
            if isinstance(best, Mapping):
                path, score = best.get("path"), best.get("value")
            elif isinstance(best, (tuple, list)) and len(best) == 2:
                path, score = best
            else:
                path, score = getattr(best, "path", best), getattr(best, "value", None)
            if path is not None:
                st.best_model_checkpoint = str(path)
                if score is not None and args.metric_for_best_model is None:
                    st.best_metric = number(score)
            return

    def load_best_model(self, loop):
        """``load_best_model_at_end``: the best checkpoint's model weights
        (only those, as the Trainer loads them) into every network."""
        from safetensors.torch import load_file

        from ... import checkpointing

        args, st = self._plugin.args, self._plugin.state
        path = Path(st.best_model_checkpoint)
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
        loop.print(f"hookloop: loaded the best model ({args.metric_for_best_model} = "
                   f"{st.best_metric}) from {path}")
