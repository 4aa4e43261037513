"""The contract of ``hookloop.checkpointing.accelerate``, the one module that
knows Accelerate's private names: each one it uses exists, with the shape it
relies on, on the installed Accelerate. When Accelerate moves one, this
fails first and names it (then read the adapter again), instead of a save or
a resume failing somewhere inside."""

import inspect

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

from hookloop.checkpointing import accelerate as accel


def prepared():
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    loader = DataLoader(TensorDataset(torch.zeros(4, 2)), batch_size=2)
    acc.prepare(model, optimizer, loader, scheduler)
    return acc


def test_the_accelerators_private_lists_and_hooks_are_where_the_adapter_reads_them():
    acc = prepared()
    for name in ("_models", "_optimizers", "_schedulers", "_dataloaders", "_custom_objects"):
        assert isinstance(getattr(acc, name), list), name
    assert accel.counts(acc) == {"models": 1, "optimizers": 1, "schedulers": 1, "custom_objects": 0}
    for name in ("_save_model_state_pre_hook", "_load_model_state_pre_hook"):
        assert hasattr(getattr(acc, name), "values"), name
    assert accel.kind(acc) == "NO" and accel.kind(acc) in accel.PLAIN_TYPES
    from accelerate.state import PartialState

    assert {"process_index", "num_processes"} <= set(PartialState._shared_state)


def test_the_functions_the_adapter_calls_take_the_arguments_it_passes():
    from accelerate.checkpointing import save_accelerator_state, save_custom_state
    from accelerate.utils import load
    from accelerate.utils.other import clean_state_dict_for_safetensors
    from safetensors.torch import _remove_duplicate_names

    params = inspect.signature(save_accelerator_state).parameters
    assert list(params)[:8] == ["output_dir", "model_states", "optimizers", "schedulers", "dataloaders",
                                "process_index", "step", "scaler"]
    assert {"save_on_each_node", "safe_serialization"} <= set(params)
    assert {"obj", "path", "index", "save_on_each_node"} <= set(inspect.signature(save_custom_state).parameters)
    assert "map_location" in inspect.signature(load).parameters
    assert callable(clean_state_dict_for_safetensors) and callable(_remove_duplicate_names)


def test_a_save_of_the_small_files_writes_the_names_the_adapter_reads(tmp_path):
    acc = prepared()
    accel.save_small_files(acc, tmp_path)
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == sorted([accel.scheduler_file(0), accel.rng_file(0)])
    assert all(accel.SMALL_FILE.match(name) for name in written)
    states = accel.torch_load((tmp_path / accel.rng_file(0)).read_bytes(), "rng", "here", "the random states")
    assert {"random_state", "numpy_random_seed", "torch_manual_seed", "step"} <= set(states)
