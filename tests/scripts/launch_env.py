"""What a rank sees of its launch: python launch_env.py OUT writes
OUT/rank-<rank>.json (the environment variables a launcher sets, the
Accelerator's view of the job, where the rank's output goes). Run by
tests/loop/test_launch.py under ``accelerate launch`` and under
launching.run_two, which must agree."""

import atexit
import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

LAUNCHER_PREFIXES = ("ACCELERATE_", "TORCHELASTIC_", "RANK", "LOCAL_", "WORLD_SIZE", "GROUP_", "ROLE_",
                     "MASTER_", "TORCH_NCCL", "OMP_NUM_THREADS")

if __name__ == "__main__":
    out = Path(sys.argv[1])
    accelerator = Accelerator(cpu=True)
    # what ends the interpreter runs, after a failure too (a lock released, a writer joined)
    atexit.register(print, f"rank {accelerator.process_index} atexit")
    total = torch.tensor([accelerator.process_index + 1.0])
    gathered = accelerator.gather(total).tolist()  # the group works
    env = {k: v for k, v in os.environ.items() if k.startswith(LAUNCHER_PREFIXES)}
    (out / f"rank-{accelerator.process_index}.json").write_text(json.dumps({
        "env": env, "argv": sys.argv[1:], "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type), "local": accelerator.local_process_index,
        "main": accelerator.is_main_process, "gathered": gathered, "threads": torch.get_num_threads(),
        "stdout_is_a_tty": sys.stdout.isatty(), "cwd": os.getcwd(), "name": __name__,
    }))
    print(f"rank {accelerator.process_index} says hello")
    print(f"rank {accelerator.process_index} warns", file=sys.stderr)
    # both ranks past their writes before either tears the group down (else
    # the rank that exits last may find the store gone: SIGABRT)
    accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()
