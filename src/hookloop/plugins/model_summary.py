"""A table of the networks' layers and parameter counts when training starts, as
Lightning's ``ModelSummary`` prints it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..markers import hookimpl

if TYPE_CHECKING:  # names for the annotations only
    from ..protocols import LoopLike


class ModelSummary:
    """Print, on the main process when ``fit`` starts, one row per layer of
    every network down to ``max_depth`` levels of nesting (``1``: the
    network's children; ``-1``: every module; ``0``: no table, nothing
    printed), then the totals::

          | Name | Type    | Params | Trainable | Mode
        -----------------------------------------------
        0 | 0    | Linear  | 144    | 144       | train
        1 | 1    | ReLU    | 0      | 0         | train
        2 | 2    | Dropout | 0      | 0         | train
        3 | 3    | Linear  | 51     | 51        | train
        -----------------------------------------------
        195       Trainable params
        0         Non-trainable params
        195       Total params
        0.001     Total estimated model params size (MB)

    With several networks each row's name starts with the network's
    (``generator.net.0``). ``Params`` counts a layer's parameters, each
    shared one once; ``Trainable`` those with ``requires_grad``. The totals
    count every parameter once, over all networks; the size is what the
    parameters take in memory at their dtypes. Lazy (not yet initialised)
    parameters count 0.

    :attr:`rows` (``(name, type, params, trainable, mode)``) and :attr:`text`
    keep the last summary; :meth:`summarize` makes one for any loop.
    """

    name = "model-summary"
    changes_training = False

    def __init__(self, max_depth: int = 1) -> None:
        if not isinstance(max_depth, int) or isinstance(max_depth, bool) or max_depth < -1:
            raise ValueError(f"ModelSummary: max_depth must be an int >= -1, got {max_depth!r}")
        self.max_depth = max_depth
        #: ``(name, type, params, trainable params, "train"/"eval")`` per row of the last summary
        self.rows: list[tuple[str, str, int, int, str]] = []
        #: the last summary as printed
        self.text = ""

    @hookimpl
    def on_fit_start(self, loop: LoopLike) -> None:
        if self.max_depth == 0:
            return
        if loop.accelerator.is_main_process:
            loop.print(self.summarize(loop))

    def summarize(self, loop: LoopLike) -> str:
        """The summary of ``loop``'s networks (also kept in :attr:`text`)."""
        several = len(loop.networks) > 1
        self.rows = []
        seen: dict[int, torch.nn.Parameter] = {}
        for net_name, network in loop.networks.items():
            model = network.unwrapped
            for param in model.parameters():
                seen.setdefault(id(param), param)
            for name, module in model.named_modules():
                depth = name.count(".") + 1 if name else 0
                if depth == 0 or (self.max_depth != -1 and depth > self.max_depth):
                    continue
                params = list(module.parameters())
                self.rows.append((
                    f"{net_name}.{name}" if several else name,
                    type(module).__name__,
                    sum(_numel(p) for p in params),
                    sum(_numel(p) for p in params if p.requires_grad),
                    "train" if module.training else "eval",
                ))
        total = sum(_numel(p) for p in seen.values())
        trainable = sum(_numel(p) for p in seen.values() if p.requires_grad)
        size_mb = sum(_numel(p) * p.element_size() for p in seen.values()) / 1e6
        self.text = _table(self.rows, total, trainable, size_mb)
        return self.text


def _numel(param: torch.Tensor) -> int:
    if isinstance(param, torch.nn.parameter.UninitializedParameter):
        return 0
    return param.numel()


def _count(n: int) -> str:
    """123, 1.2 K, 3.4 M, 5.6 B, 7.8 T."""
    for unit, size in ((" T", 1e12), (" B", 1e9), (" M", 1e6), (" K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _table(rows: Sequence[tuple[str, str, int, int, str]], total: int, trainable: int,
           size_mb: float) -> str:
    columns = [
        ("", [str(i) for i in range(len(rows))]),
        ("Name", [r[0] for r in rows]),
        ("Type", [r[1] for r in rows]),
        ("Params", [_count(r[2]) for r in rows]),
        ("Trainable", [_count(r[3]) for r in rows]),
        ("Mode", [r[4] for r in rows]),
    ]
    widths = [max([len(head), *map(len, cells)]) for head, cells in columns]
    width = sum(widths) + 3 * (len(columns) - 1)
    lines = [" | ".join(head.ljust(w) for (head, _), w in zip(columns, widths)).rstrip(), "-" * width]
    for i in range(len(rows)):
        lines.append(" | ".join(cells[i].ljust(w) for (_, cells), w in zip(columns, widths)).rstrip())
    lines.append("-" * width)
    lines += [
        f"{_count(trainable):<10}Trainable params",
        f"{_count(total - trainable):<10}Non-trainable params",
        f"{_count(total):<10}Total params",
        f"{size_mb:<10,.3f}Total estimated model params size (MB)",
    ]
    return "\n".join(lines)
