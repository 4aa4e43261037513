"""Small value conversions the adapter's modules share: an enum option as
its string, a log key with its network or loss name, a number as a Python
number, the examples in a batch."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch


def value(option: Any) -> Any:
    """An enum option (``SaveStrategy.EPOCH``) as its string."""
    return getattr(option, "value", option)


def named(base: str, key: str | None) -> str:
    return base if key is None else f"{base}/{key}"


def number(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    try:
        import numpy as np

        if isinstance(value, np.generic):
            return value.item()
    except ImportError:  # pragma: no cover
        pass
    return value


def examples(batch: Any) -> int:
    """Examples in a batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.ndim else 1
    values: Iterable[Any]
    if isinstance(batch, Mapping):
        values = batch.values()
    elif isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        values = batch
    else:
        return 0
    for value in values:
        n = examples(value) if isinstance(value, (torch.Tensor, Mapping, Sequence)) else 0
        if n:
            return n
    return 0
