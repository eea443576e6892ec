"""One rank's NCCL group cut the ways the runtime cuts it, then formed again in the same process.

Run by tests/gpu/test_gpu_nccl_abort.py in a process of its own (an abort changes torch's
process-wide group registry, and a hang must end in the caller's timeout, not in pytest's):

1. `GroupMembership.cut` called from a thread other than the one that formed the group, as
   `TrainWorker.request_stop(cut_group=True)` does when the controller reports a lost member: the
   NCCL communicators are aborted (`_abort_process_group`) and the group's sockets shut down;
2. `GroupMembership.leave(abort=True)`, the training thread's path after a broken collective;
3. the next generation's group, formed in the same process: collectives work, and a checkpoint
   saved and loaded over a new side group gives back what was saved.

Each group is formed as `GroupMembership.join` forms it (GroupSockets around the rendezvous,
the checkpoint manager's gloo side group bound with it). Prints one JSON line of findings.
Usage: python nccl_abort_program.py CHECKPOINT_URL
"""
from __future__ import annotations

import datetime
import json
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from chaos.services import free_port
from checkpointing import CheckpointManager
from elastic._worker.group_sockets import GroupSockets
from elastic._worker.membership import GroupMembership

CUDA = torch.device("cuda", 0)


def form(manager: CheckpointManager):
    port = free_port()
    sockets = GroupSockets(("127.0.0.1", port))
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    manager.bind_group()
    sockets.capture(store=c10d._get_default_store(), rank=0, world_size=1)
    t = torch.ones(4, device=CUDA)
    dist.all_reduce(t)                 # the communicator is created by the first collective
    torch.cuda.synchronize()
    assert t.tolist() == [1.0] * 4, t
    return dist.group.WORLD, sockets


def member(sockets: GroupSockets) -> GroupMembership:
    """A rank's membership of the group formed here by hand (join() forms it from a rendezvous)."""
    membership = GroupMembership(use_gpu=True)
    membership._sockets = sockets
    return membership


def gone(pg) -> dict:
    """What is left of the group `pg` in this process."""
    found = {"initialized": dist.is_initialized(), "registered": pg in c10d._world.pg_map,
             "groups_left": len(c10d._world.pg_map)}
    try:
        dist.all_reduce(torch.ones(1, device=CUDA))
        found["default_collective"] = "completed"
    except (ValueError, RuntimeError) as error:
        found["default_collective"] = type(error).__name__
    return found


def main(url: str) -> dict:
    torch.cuda.set_device(0)
    findings: dict = {}
    manager = CheckpointManager(url, async_save=False)

    pg, sockets = form(manager)
    membership = member(sockets)
    started = time.monotonic()
    cutter = threading.Thread(target=membership.cut, args=(sockets,), daemon=True)
    cutter.start()
    cutter.join(60)
    findings["cut_returned"] = not cutter.is_alive()
    findings["cut_s"] = round(time.monotonic() - started, 3)
    findings["after_cut"] = gone(pg)
    membership.leave()                 # what join() does first: nothing left to destroy

    pg, sockets = form(manager)
    member(sockets).leave(abort=True)
    findings["after_leave_abort"] = gone(pg)

    form(manager)
    t = torch.full((3,), 2.0, device=CUDA)
    dist.all_reduce(t)
    saved = torch.arange(12.0, device=CUDA).reshape(3, 4)
    manager.save(1, {"x": saved, "extra": {"step": 1}}, generation=0)
    state = {"x": torch.zeros(3, 4, device=CUDA), "extra": {"step": 0}}
    loaded = manager.load_latest(state)
    findings["reformed"] = {"all_reduce": t.tolist(), "loaded_step": loaded.step if loaded else None,
                            "equal": bool(torch.equal(state["x"], saved)), "step": state["extra"]["step"]}
    manager.close()
    dist.destroy_process_group()
    return findings


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])), flush=True)
