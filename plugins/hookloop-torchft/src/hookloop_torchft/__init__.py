"""Per-step fault tolerance for hookloop with torchft: replica groups agree on
a quorum every update; when one dies the others keep training; when it comes
back it recovers its weights, optimizer and position live from a healthy
peer. No restart, no checkpoint read.

    # a lighthouse, once:           torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100
    # each replica group, its own launch (one process: plain python):
    #   TORCHFT_LIGHTHOUSE=http://host:29510 REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 python train.py
    import hookloop_torchft
    data = DataLoader(dataset, batch_size=8, sampler=hookloop_torchft.replica_share(dataset))
    loop = Loop(model=model, optimizer=optimizer, train_data=data,
                plugins=[hookloop_torchft.FaultTolerant(),
                         Checkpoint(dir=f"checkpoints/group-{os.environ['REPLICA_GROUP_ID']}")])  # one per group
    loop.fit(max_steps=1000)

The hooks it implements, and torchft's calls there: ``on_fit_start`` (the
first quorum, which a recovering group heals in before its first batch: the
healthy groups' weights, optimizer and scheduler states and position),
``before_step`` and ``before_backward`` (a quorum per update,
``Manager.start_quorum``), ``after_backward`` (the gradients averaged over
the replica groups that are up, ``Manager.allreduce``), ``commit_update``
(``Manager.should_commit``: False discards the update, which the loop then
neither steps nor counts), ``after_step`` (``ft/participants`` and
``ft/discarded`` to ``loop.log``), ``state_dict`` / ``load_state_dict`` (the
manager's step in checkpoints: they stay the fallback for losing every
group), ``on_loop_end`` (shutdown).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

from hookloop import hookimpl

__all__ = ["FaultTolerant", "replica_share"]
__version__ = "0.1.0"


def _env_int(name: str, default: int | None = None) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def replica_share(dataset, *, shuffle: bool = True, seed: int = 0, replica_group: int | None = None,
                  num_replica_groups: int | None = None, **kwargs):
    """torchft's ``DistributedSampler`` of this replica group's share of
    ``dataset`` (``REPLICA_GROUP_ID`` of ``NUM_REPLICA_GROUPS`` by default):
    the groups read disjoint shares, each seeded by epoch; within a group of
    several processes Accelerate splits the share among them, as it splits
    any loader it prepares."""
    from torchft.data import DistributedSampler

    group = replica_group if replica_group is not None else _env_int("REPLICA_GROUP_ID", 0)
    groups = num_replica_groups if num_replica_groups is not None else _env_int("NUM_REPLICA_GROUPS", 1)
    return DistributedSampler(dataset, replica_rank=group, num_replica_groups=groups, group_rank=0, num_replicas=1,
                              shuffle=shuffle, seed=seed, **kwargs)


class FaultTolerant:
    """torchft's ``Manager`` driven by the loop's hooks.

    :param min_replica_size: replica groups an update needs to commit (1:
        any group alone keeps training).
    :param lighthouse: the lighthouse's address (default ``TORCHFT_LIGHTHOUSE``).
    :param replica_group: this group's id (default ``REPLICA_GROUP_ID``, else 0).
    :param timeout: torchft's timeout for collectives and its RPCs; a peer
        that dies mid-update fails the update within it (sooner when its
        connection closes), and the next quorum leaves it out.
    :param quorum_timeout: how long a quorum may take.
    :param process_group: the ``torchft.process_group`` the groups average
        gradients over (default: gloo on a CPU, NCCL on a GPU).
    :param manager_options: any other ``torchft.Manager`` argument.

    A group of one process needs no launcher: it hosts its group's store
    (``MASTER_ADDR`` / ``MASTER_PORT`` when set, else a free local port).
    """

    name = "fault-tolerant"

    def __init__(self, *, min_replica_size: int = 1, lighthouse: str | None = None,
                 replica_group: int | None = None, timeout: timedelta = timedelta(seconds=30),
                 quorum_timeout: timedelta = timedelta(seconds=60), process_group: Any = None,
                 **manager_options: Any):
        self.min_replica_size, self.lighthouse, self.timeout = min_replica_size, lighthouse, timeout
        self.replica_group = replica_group if replica_group is not None else _env_int("REPLICA_GROUP_ID", 0)
        self.quorum_timeout, self.process_group, self.options = quorum_timeout, process_group, manager_options
        self.manager: Any = None
        self._store: Any = None
        self._loop: Any = None
        self._quorum_open = False
        self._restored: dict | None = None  # the manager's state from a checkpoint, until it exists
        self._healed_position: dict | None = None

    # -- the manager ------------------------------------------------------------------

    def _start(self, loop) -> None:
        import torch
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo

        acc = loop.accelerator
        addr, port = os.environ.get("MASTER_ADDR"), _env_int("MASTER_PORT")
        if acc.num_processes == 1 and (addr is None or port is None or not _listening(addr, port)):
            self._store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            addr, port = "127.0.0.1", self._store.port  # (the group's own store: nothing else hosts one)
        pg = self.process_group
        if pg is None:
            if acc.device.type == "cuda":
                from torchft.process_group import ProcessGroupNCCL

                pg = ProcessGroupNCCL(timeout=self.timeout)
            else:
                pg = ProcessGroupGloo(timeout=self.timeout)
        self._loop = loop
        self.manager = Manager(
            pg=pg, min_replica_size=self.min_replica_size, load_state_dict=self._load_live_state,
            state_dict=self._live_state, use_async_quorum=False, timeout=self.timeout,
            quorum_timeout=self.quorum_timeout, rank=acc.process_index, world_size=acc.num_processes,
            store_addr=addr, store_port=port, lighthouse_addr=self.lighthouse,
            replica_id=f"hookloop_{self.replica_group}", **self.options)
        if self._restored is not None:
            self.manager.load_state_dict(self._restored)
            self._restored = None

    def _live_state(self) -> dict:
        """What a recovering group receives: every network's weights, optimizer and
        scheduler states, and the position."""
        loop, out = self._loop, {}
        for name, net in loop.networks.items():
            entry = {"model": net.unwrapped.state_dict()}
            if net.optimizer is not None:
                entry["optimizer"] = net.optimizer.state_dict()
            if net.scheduler is not None:
                entry["scheduler"] = net.scheduler.state_dict()
            out[name] = entry
        return {"networks": out, "position": loop.state.state_dict()}

    def _load_live_state(self, state: dict) -> None:
        loop = self._loop
        for name, entry in state["networks"].items():
            net = loop.networks[name]
            net.unwrapped.load_state_dict(entry["model"])
            if "optimizer" in entry:
                net.optimizer.load_state_dict(entry["optimizer"])
            if "scheduler" in entry:
                net.scheduler.load_state_dict(entry["scheduler"])
        self._healed_position = state["position"]

    def _quorum(self, fit_start: bool = False) -> None:
        """The update's quorum, once (synchronous: a recovering group's state lands here)."""
        if self._quorum_open and not fit_start:
            return
        self.manager.start_quorum()
        self._quorum_open = True
        position, self._healed_position = self._healed_position, None
        if position is None:
            return
        state = self._loop.state
        if fit_start:  # before the first batch: the epoch then continues at the peers' batch
            state.load_state_dict(position)
        else:  # mid-fit the data position is the peers' already (the groups draw in lockstep);
            # the updates committed are theirs
            state.global_step, state.micro_step = position["global_step"], position["micro_step"]

    # -- hooks ----------------------------------------------------------------------

    @hookimpl
    def on_fit_start(self, loop):
        if self.manager is None:
            self._start(loop)
        self._quorum(fit_start=True)  # the first update's: a recovering group heals before its first batch

    @hookimpl
    def before_step(self, loop):
        self._quorum()

    @hookimpl
    def before_backward(self, loop, network):
        self._quorum()  # (a second network's update in the same batch: its own quorum)

    @hookimpl
    def after_backward(self, loop, network):
        if not loop.accelerator.sync_gradients:
            return
        import torch

        grads = [p.grad for p in network.model.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.manager.allreduce(flat).wait()  # the average over the groups that are up
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    @hookimpl
    def commit_update(self, loop, network):
        self._quorum_open = False
        return self.manager.should_commit()

    @hookimpl
    def after_step(self, loop):
        loop.log({"ft/participants": float(self.manager.num_participants()),
                  "ft/discarded": float(loop.discarded_updates)})

    @hookimpl
    def on_loop_end(self, loop):
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None
        self._store = None

    # -- in checkpoints ---------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"manager": self.manager.state_dict() if self.manager is not None else self._restored}

    def load_state_dict(self, state: dict) -> None:
        manager = state.get("manager")
        if manager is None:
            return
        if self.manager is not None:
            self.manager.load_state_dict(manager)
        else:
            self._restored = manager


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False
