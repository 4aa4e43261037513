"""Launch mistakes (tests/loop/test_launch.py).

    python launch_checks.py OUT plain
        under ``accelerate launch --multi_gpu --num_processes 2`` on a CPU
        machine, with a plain ``Accelerator()`` (no ``cpu=True``): each rank
        writes OUT/plain-<rank>.json, the error ``Loop(...)`` raised, or how
        it trained if it did not (into OUT/checkpoints);
    python launch_checks.py OUT machines
        one process per "machine" (each its own local main process), with
        ``Accelerator(cpu=True, fsdp_plugin=FSDP2)``: ``loop.print`` and the
        warnings ``Loop(...)`` gave, in OUT/machines-<rank>.json.
"""

import json
import sys
import warnings
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop
from hookloop.plugins import Checkpoint

out, mode = Path(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
if mode == "plain":
    accelerator = Accelerator()
else:
    from accelerate.utils import FullyShardedDataParallelPlugin

    accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
rank = int(__import__("os").environ.get("RANK", accelerator.process_index))
set_seed(0)
x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
model = torch.nn.Linear(4, 2)
kwargs = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
              "train_data": DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True),
              "accelerator": accelerator, "block": ["progress"]}
result = {"num_processes": accelerator.num_processes, "process_index": accelerator.process_index,
          "distributed_type": str(accelerator.distributed_type)}
if mode == "plain":
    try:
        loop = Loop(plugins=[Checkpoint(dir=out / "checkpoints", every_steps=2)], **kwargs)
    except RuntimeError as exc:
        result["error"] = str(exc)
    else:
        try:
            loop.fit(epochs=1)
            result["trained"] = loop.state.global_step
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            result["failed"] = f"{type(exc).__name__}: {exc}"
else:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop = Loop(**kwargs)
    result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    loop.print(f"PRINTED-BY-RANK-{rank}", flush=True)
    loop.close()
(out / f"{mode}-{rank}.json").write_text(json.dumps(result))
