"""Reading what ``torch.distributed.checkpoint`` (DCP) wrote, without
trusting it: a DCP folder's ``.metadata`` is a pickle, and DCP reads the
non-tensor items of a shard with ``weights_only=False``. Here the metadata is
unpickled with an unpickler that knows only DCP's own classes, its shapes are
compared with the model's, and every non-tensor item is first deserialised
with ``weights_only=True`` (:mod:`.formats` calls these while staging).
"""

from __future__ import annotations

import io
import pickle

import torch

from . import accelerate as accel
from .errors import CheckpointError, first_line

_ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
            ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
            ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
            ("pathlib", "PureWindowsPath"), ("pathlib", "Path"),
            ("pathlib._local", "PosixPath"), ("pathlib._local", "PurePosixPath"),  # Python 3.13
            ("pathlib._local", "WindowsPath"), ("pathlib._local", "PureWindowsPath"),
            ("pathlib._local", "Path")}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata``: its own classes, ``torch.Size``, dtypes, paths; nothing else."""

    def find_class(self, module, name):
        import torch.distributed.checkpoint.metadata as meta

        if module == meta.__name__ and isinstance(getattr(meta, name, None), type):
            return getattr(meta, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}")


def load_metadata(data: bytes, rel: str, where: str):
    """A DCP ``.metadata`` from its bytes, safely (:class:`_MetadataUnpickler`)."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        metadata.state_dict_metadata.items()
        return metadata
    except Exception as exc:  # noqa: BLE001 - garbled, or not DCP's
        raise CheckpointError(f"{where}: cannot read {rel}: it is not the metadata of a "
                              f"torch.distributed.checkpoint folder ({type(exc).__name__}: "
                              f"{first_line(exc)}), and hookloop never unpickles other objects") from None


def check_bytes(metadata, rel, opened, where) -> None:
    """The non-tensor items (param groups, numbers) stored in shard ``rel``
    each deserialise with ``weights_only=True`` (DCP reads them with
    ``weights_only=False``)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    name = rel.rsplit("/", 1)[1]
    kinds = metadata.state_dict_metadata
    for index, info in (metadata.storage_data or {}).items():
        if info.relative_path != name or not isinstance(kinds.get(index.fqn), BytesStorageMetadata):
            continue
        if info.transform_descriptors:
            raise CheckpointError(f"{where}: {rel} stores {index.fqn!r} through storage transforms "
                                  f"({info.transform_descriptors}), which hookloop does not verify")
        accel.torch_load(opened.read_at(info.offset, info.length), rel, where, f"the item {index.fqn!r}")


def shapes(model) -> dict:
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def compare(metadata, prefix: str, expected: dict, network: str, where: str, rel: str) -> None:
    saved = {k[len(prefix):]: tuple(v.size) for k, v in metadata.state_dict_metadata.items()
             if k.startswith(prefix) and getattr(v, "size", None) is not None}
    for key, shape in saved.items():
        if key not in expected:
            raise CheckpointError(f"{where}: network {network!r} has a tensor {key!r} (shape "
                                  f"{list(shape)}) in {rel} that this model does not have: a model "
                                  "of another architecture?")
        if expected[key] != shape:
            raise CheckpointError(f"{where}: network {network!r} tensor {key!r} has shape "
                                  f"{list(shape)} in the checkpoint ({rel}) but "
                                  f"{list(expected[key])} in this model")
    missing = sorted(set(expected) - set(saved))
    if missing:
        raise CheckpointError(f"{where}: network {network!r} tensor {missing[0]!r} is not in the "
                              f"checkpoint ({rel}): a model of another architecture?")
