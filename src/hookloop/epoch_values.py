"""What ``loop.log(..., on_epoch=True)`` keeps: values reduced over an epoch
(or an evaluation) and over processes, read once at its end."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

REDUCTIONS = ("mean", "sum", "max", "min")


class EpochValues:
    """Running reductions, one per key. Tensors stay on their device until
    :meth:`reduce` (no device sync per logged value); a tensor of several
    values counts each of them (``mean`` over examples, ``max`` of all)."""

    def __init__(self) -> None:
        #: key -> [reduction, total (float or 0-d float64 tensor), count]
        self._values: dict[str, list[Any]] = {}
        #: key -> the plugin that logs it (see :mod:`hookloop.logbook`)
        self.owners: dict[str, str] = {}

    def add(self, values: Mapping[str, Any], reduce: str) -> None:
        if reduce not in REDUCTIONS:
            raise ValueError(f"loop.log: reduce must be one of {', '.join(REDUCTIONS)}, got {reduce!r}")
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                value = value.detach().to(torch.float64)
                count = value.numel()
                methods: dict[str, Callable[[], torch.Tensor]] = {
                    "mean": value.sum, "sum": value.sum, "max": value.max, "min": value.min}
                part: torch.Tensor | float = methods[reduce]()
            else:
                try:
                    part, count = float(value), 1
                except (TypeError, ValueError):
                    raise TypeError(
                        f"loop.log(on_epoch=True): {key!r} is a {type(value).__name__}; "
                        "log numbers or tensors"
                    ) from None
            entry = self._values.get(key)
            if entry is None:
                self._values[key] = [reduce, part, count]
                continue
            if entry[0] != reduce:
                raise ValueError(
                    f"loop.log: {key!r} was logged with reduce={entry[0]!r} this epoch and now "
                    f"with reduce={reduce!r}"
                )
            if reduce in ("mean", "sum"):
                entry[1] = entry[1] + part
            else:  # a 0-d CPU tensor combines with one on any device
                pick = torch.maximum if reduce == "max" else torch.minimum
                entry[1] = pick(torch.as_tensor(entry[1], dtype=torch.float64),
                                torch.as_tensor(part, dtype=torch.float64))
            entry[2] += count

    def __bool__(self) -> bool:
        return bool(self._values)

    def clear(self) -> None:
        self._values = {}
        self.owners = {}

    def forget(self, key: str) -> None:
        """Drop what was added under ``key`` (its writer was replaced)."""
        self._values.pop(key, None)

    def state_dict(self) -> dict[str, list[Any]]:
        """This process's running reductions: ``{key: [reduction, total,
        count]}``, each total a float or a 0-d float64 CPU tensor (as data a
        checkpoint stores; adding to it goes on exactly as before)."""
        return {
            key: [reduce, total.detach().to("cpu", copy=True) if isinstance(total, torch.Tensor) else total, count]
            for key, (reduce, total, count) in self._values.items()
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        values: dict[str, list[Any]] = {}
        for key, entry in state.items():
            if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and entry[0] in REDUCTIONS
                    and isinstance(entry[2], int) and isinstance(entry[1], (int, float, torch.Tensor))):
                raise ValueError(f"loop.log accumulator {key!r} is not [reduction, total, count]: {entry!r}")
            values[key] = list(entry)
        self._values = values

    def reduce(self, accelerator: Any, clear: bool = True) -> dict[str, float]:
        """Every key's value over the epoch and over all processes (a
        collective with several processes: every process calls it).
        ``clear``: start afresh (the epoch is over); else keep adding (an
        epoch ended early by a stop, which the next fit continues)."""
        values = self._values
        if clear:
            self._values = {}
            self.owners = {}
        several = accelerator.num_processes > 1
        keys = sorted(values)
        if several:  # a key logged on one process only must not hang the others
            from accelerate.utils import gather_object

            seen: dict[str, str] = {}
            for key, reduce in gather_object([(k, values[k][0]) for k in keys]):
                seen.setdefault(key, reduce)
            keys = sorted(seen)
            kinds = [seen[k] for k in keys]
        else:
            kinds = [values[k][0] for k in keys]
        if not keys:
            return {}
        device = accelerator.device
        identity = {"mean": 0.0, "sum": 0.0, "max": -math.inf, "min": math.inf}
        totals = torch.stack([
            torch.as_tensor(values[k][1] if k in values else identity[kind], dtype=torch.float64).to(device)
            for k, kind in zip(keys, kinds)
        ])
        counts = torch.tensor([float(values[k][2]) if k in values else 0.0 for k in keys],
                              dtype=torch.float64, device=device)
        if several:
            import torch.distributed as dist

            for op, kind in ((dist.ReduceOp.SUM, ("mean", "sum")), (dist.ReduceOp.MAX, ("max",)),
                             (dist.ReduceOp.MIN, ("min",))):
                mask = torch.tensor([k in kind for k in kinds], device=device)
                if not bool(mask.any()):
                    continue
                part = torch.where(mask, totals, torch.zeros_like(totals))
                dist.all_reduce(part, op=op)
                totals = torch.where(mask, part, totals)
            dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        means = torch.tensor([kind == "mean" for kind in kinds], device=device)
        result = torch.where(means, totals / counts.clamp(min=1), totals).tolist()
        return {k: v for k, v, n in zip(keys, result, counts.tolist()) if n > 0}
