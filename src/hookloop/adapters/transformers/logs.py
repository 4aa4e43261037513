"""The Trainer's logging, for one fit: the loss kept on the device between
logs, ``Trainer.log`` (``on_log``), the training log ``should_log`` asks
for (loss, grad_norm, learning_rate), the summary at the fit's end (speed,
total FLOs, train_loss) and the Trainer's speed metrics."""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from ...network import NOT_MEASURED
from .values import named, number


class TrainingLog:
    """The training-log bookkeeping of one fit of a
    :class:`~hookloop.adapters.transformers.TrainerCallbacks` ``plugin``:
    it reads the plugin's ``state`` and fires ``on_log`` through it."""

    def __init__(self, plugin):
        self._plugin = plugin
        self._lr: dict = {}
        self._group: dict = {}
        self._group_n = 0
        self._tr_loss: dict = {}
        self._total_loss: dict = {}
        self._tokens = None
        self._main_input = "input_ids"
        self._flos_per_token = 0
        #: ``state.global_step`` at the last training log
        self.last_logged = 0

    def start(self, loop, model):
        """What ``Trainer.train()`` notes before ``on_train_begin``: where the
        run starts, its clock, the FLOs estimate of ``model``."""
        st = self._plugin.state
        self.last_logged = st.global_step
        self._initial_step = st.global_step
        self._initial_micro = loop.state.micro_step
        self._start_time = time.time()
        if hasattr(model, "num_parameters"):  # the Trainer's floating_point_ops estimate
            self._tokens = 0
            self._main_input = getattr(model, "main_input_name", "input_ids")
            self._flos_per_token = 6 * model.num_parameters(exclude_embeddings=True)

    def note_lr(self, network):
        """The learning rate of this update of ``network`` (the scheduler steps next)."""
        self._lr[network.name] = network.optimizer.param_groups[0]["lr"]

    def add_batch(self, batch, loss, sync):
        """A trained batch: its loss kept, its tokens counted."""
        self._add_loss(loss, sync)
        if self._tokens is not None and isinstance(batch, Mapping):
            inputs = batch.get(self._main_input)
            if isinstance(inputs, torch.Tensor):
                self._tokens += inputs.numel()

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

    def log_training(self, loop, several):
        """``Trainer._maybe_log_save_evaluate``'s log: the mean loss per
        update since the last log, the gradient norm, the learning rate
        (named by network when ``several``)."""
        st = self._plugin.state
        steps = st.global_step - self.last_logged
        logs = {}
        for key, value in self._read_losses(loop).items():
            self._total_loss[key] = self._total_loss.get(key, 0.0) + value
            logs[named("loss", key)] = value / steps
        for name, network in loop.networks.items():
            if network.grad_norm is not NOT_MEASURED:
                logs[named("grad_norm", name if several else None)] = number(network.grad_norm)
        for name, network in loop.networks.items():
            if network.optimizer is None:
                continue
            lr = self._lr.get(name, network.optimizer.param_groups[0]["lr"])
            logs[named("learning_rate", name if several else None)] = number(lr)
        self.last_logged = st.global_step
        self._store_flos(loop)
        self.log(loop, logs)

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

    def log(self, loop, logs):
        """``Trainer.log``: the epoch added, the history kept, ``on_log``."""
        plugin = self._plugin
        st = plugin.state
        if st.epoch is not None:
            logs["epoch"] = st.epoch
        st.log_history.append({**logs, "step": st.global_step})
        plugin._event("on_log", logs=logs)
        plugin._apply(loop)
        if plugin.trackers:
            loop.log({k: v for k, v in logs.items() if isinstance(v, (int, float))})

    def log_train_summary(self, loop):
        """The Trainer's last log: speed, total FLOs, the mean training loss."""
        st = self._plugin.state
        steps = st.global_step - self._initial_step
        for key, value in self._read_losses(loop).items():
            self._total_loss[key] = self._total_loss.get(key, 0.0) + value
        batches = loop.state.micro_step - self._initial_micro
        samples = batches * (st.train_batch_size or 1) * loop.accelerator.num_processes
        metrics = speed_metrics("train", self._start_time, num_samples=samples, num_steps=steps)
        self._store_flos(loop)
        metrics["total_flos"] = st.total_flos
        for key, total in self._total_loss.items() or {None: 0.0}.items():
            metrics[named("train_loss", key)] = total / max(steps, 0.001)
        self.log(loop, metrics)

    def _store_flos(self, loop):
        if self._tokens:
            self._plugin.state.total_flos += float(
                self._tokens * self._flos_per_token * loop.accelerator.num_processes
            )
            self._tokens = 0


def speed_metrics(split, start, num_samples=None, num_steps=None):
    """``transformers.trainer_utils.speed_metrics``: ``<split>_runtime``, ..."""
    from transformers.trainer_utils import speed_metrics

    return speed_metrics(split, start, num_samples=num_samples, num_steps=num_steps)
