"""A node's copies of the run's state that outlive its workers.

Every K steps (`CheckpointConfig.in_memory_every_n_steps`) each rank copies its state to host
memory (elastic._worker.replicas). Those copies live in the worker's process: a fault that killed
every worker of the run (a job-wide crash, the chaos suite's corrupt_checkpoint, the OOM killer
on a node) took them along, and the run went back to storage. Here each rank also hands its own
copy to its node's keeper: an actor of the run, one per node, that only holds what it is given,
so the copy outlives the workers. When no member of a re-formed group holds the copies, the
controller asks the keepers (`held`), and a complete set of one (generation, step) is restored
from them: each old rank's copy is fetched by one new rank (`copy`) and broadcast as the
workers' own copies are (a MEMORY restore whose `ReplicaSource.keepers` names the keepers), with
no storage read.

The keeper is detached (it outlives the worker that made it: the first rank on the node to hand
a copy), named after the run and the node (elastic._run_names), pinned to its node, and takes no
CPU. The controller removes it when the run ends, with the run's data sources
(`remove_holders`), and it ends itself once the run's controller is gone for good.

Costs: one more copy of each rank's state in host memory (the keeper's heap), handed over every
K steps by a thread of the worker's own (the training thread goes on; a copy taken while the
previous one is on its way waits for it, an older one waiting is dropped). The tensors travel as
their bytes (PackedTensor), which Ray moves out of band, not pickled: +1.4 % mean step time for
DDP's small GPT on 3 ranks at K = 10, against +13 % pickled (BENCHMARKS.md F2). Under DDP one rank per
node hands its copy: every replica holds the same state. Not yet: a copy on another node (losing
a node loses its keeper's copies; the run then takes the workers' ring copies or the checkpoint,
as before). A kill of every worker before the node's keeper is up (seconds after the start: a
process, torch's import) or before the first copy reached it goes back to the checkpoint.

This module imports neither torch nor Ray at import time: the controller lists and asks the
keepers; only the keeper's process and the workers see the copies themselves.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

from elastic._run_names import NAMESPACE, RunNames, end_when_orphaned

log = logging.getLogger("elastic.keeper")

GENERATIONS_KEPT = 2        # a new generation's copies replace the older ones only once taken
HANDOVER_TIMEOUT_S = 120.0


def _lower_priority(*, thread_only: bool) -> None:
    """The handover is background work: its pickling (in the worker's thread) and unpickling (in
    the keeper's process) yield the CPU to training (nice 19; on Linux a thread has a nice of its
    own). On 2 shared cores, unniced, it slowed the handing rank enough to hide a straggler."""
    import os
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id() if thread_only else 0, 19)
    except (AttributeError, OSError):     # not Linux, or not allowed: the work still gets done
        pass


@dataclasses.dataclass(frozen=True)
class PackedTensor:
    """A CPU tensor on its way to or from a keeper: its bytes as a numpy array, which Ray
    serialises out of band (one copy into the object store, no pickling of the data). A torch
    tensor pickles through torch.save of its storage in the handing worker, holding the
    training process's GIL, and torch.load in the keeper: that made the handover cost 13 % of
    the step time of DDP's small GPT on 3 ranks at a copy every 10 steps (BENCHMARKS.md F2)."""

    data: Any               # numpy uint8, the tensor's bytes in row-major order
    dtype: str              # torch's name of the dtype ("float32", "bfloat16", ...)
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class PackedState:
    """A copy as it travels to and from a keeper: its skeleton (elastic._worker.broadcast's: the
    structure, with each tensor's place) and its tensors, each plain CPU one as a PackedTensor
    (any other, a subclass or on another device, as it is: pickled)."""

    skeleton: Any
    tensors: tuple[Any, ...]


def pack_tensors(state: Any) -> PackedState:
    """`state` packed; each PackedTensor shares its tensor's memory (Ray copies it when the call
    is sent)."""
    import torch

    from elastic._worker.broadcast import _split_tree

    def pack(tensor: torch.Tensor) -> Any:
        if type(tensor) is not torch.Tensor or tensor.device.type != "cpu" or tensor.layout != torch.strided \
                or tensor.is_quantized:
            return tensor
        flat = tensor.contiguous().reshape(-1)
        return PackedTensor(flat.view(torch.uint8).numpy(), str(tensor.dtype).removeprefix("torch."),
                            tuple(tensor.shape))
    tensors: list[torch.Tensor] = []
    skeleton = _split_tree(state, tensors)
    return PackedState(skeleton, tuple(pack(t) for t in tensors))


def unpack_tensors(packed: PackedState) -> Any:
    """The state again, each tensor in memory of its own (not the object store's, which Ray maps
    read-only)."""
    import numpy as np
    import torch

    from elastic._worker.broadcast import _fill_tree

    def unpack(value: Any) -> Any:
        if not isinstance(value, PackedTensor):
            return value
        data = torch.from_numpy(np.array(value.data, copy=True))
        return data.view(getattr(torch, value.dtype)).reshape(value.shape)
    return _fill_tree(packed.skeleton, {i: unpack(t) for i, t in enumerate(packed.tensors)})


def _owned(state: Any) -> Any:
    """A packed copy with its bytes copied out of the object store: the keeper holds its copies
    in its own heap, not pinned in the node's object store."""
    import numpy as np
    if not isinstance(state, PackedState):
        return state
    return dataclasses.replace(state, tensors=tuple(
        dataclasses.replace(t, data=np.array(t.data, copy=True)) if isinstance(t, PackedTensor) else t
        for t in state.tensors))


class NodeKeeper:
    """The actor: copies by (generation, world size, rank), the newest step of each. The copies
    come with their tensors packed (pack_tensors) and go back so; the keeper never unpacks them."""

    def __init__(self, controller: str | None = None) -> None:
        """`controller`: the run's controller actor's name; the keeper ends once it is gone for
        good (elastic._run_names.end_when_orphaned)."""
        self._copies: dict[tuple[int, int, int], tuple[int, Any]] = {}
        self._lock = threading.Lock()       # a threaded actor: held() answers while a copy arrives
        _lower_priority(thread_only=False)
        if controller is not None:
            threading.Thread(target=end_when_orphaned, args=(controller, "node keeper"), name="orphan-watch",
                             daemon=True).start()

    def hold(self, generation: int, world_size: int, rank: int, step: int, state: Any) -> None:
        with self._lock:
            key = (generation, world_size, rank)
            kept = self._copies.get(key)
            if kept is None or step >= kept[0]:
                self._copies[key] = (step, _owned(state))
            newest = sorted({g for g, _, _ in self._copies}, reverse=True)[:GENERATIONS_KEPT]
            for old in [k for k in self._copies if k[0] not in newest]:
                del self._copies[old]

    def ready(self) -> bool:
        """Started, torch imported: a copy's tensors unpickle without the import's seconds."""
        import torch  # noqa: F401
        return True

    def held(self) -> list[tuple[int, int, int, int]]:
        """(generation, world size, rank, step) of each copy held."""
        with self._lock:
            return [(g, w, r, step) for (g, w, r), (step, _) in self._copies.items()]

    def copy(self, generation: int, world_size: int, rank: int, step: int) -> Any:
        with self._lock:
            kept = self._copies.get((generation, world_size, rank))
        if kept is None or kept[0] != step:
            held = self.held()
            raise LookupError(f"this node's keeper has no copy of rank {rank} of generation {generation} "
                              f"({world_size} ranks) at step {step}; it holds {held} (generation, world, rank, step)")
        return kept[1]


class CopyHandover:
    """A worker's side: hands its newest copy to its node's keeper, on a thread of its own. A copy
    taken while the previous one is still on its way waits; an older one waiting is dropped
    (only the newest matters)."""

    def __init__(self, names: RunNames):
        self._names = names
        self._ready = threading.Condition()
        self._pending: tuple[Any, ...] | None = None     # (generation, world size, rank, step, state)
        self._find = False                                # find or make the keeper (prepare)
        self._thread: threading.Thread | None = None
        self._keeper: Any = None
        self._failing = False

    def prepare(self) -> None:
        """Find or make this node's keeper now (a generation's start): the first copy then costs
        only its transfer, and a fault soon after it still finds it kept."""
        with self._ready:
            if self._keeper is None:
                self._find = True
                self._wake()

    def hand(self, generation: int, world_size: int, rank: int, step: int, state: Any) -> None:
        """Hand the copy over in the background."""
        with self._ready:
            self._pending = (generation, world_size, rank, step, state)
            self._wake()

    def _wake(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="copy-handover", daemon=True)
            self._thread.start()
        self._ready.notify_all()

    def _loop(self) -> None:
        _lower_priority(thread_only=True)
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._pending is not None or self._find)
                copy, self._pending, self._find = self._pending, None, False
            self._send(copy)

    def _send(self, copy: tuple[Any, ...] | None) -> None:
        import ray
        try:
            if self._keeper is None:
                self._keeper = self._own_keeper(ray)
                ray.get(self._keeper.ready.remote(), timeout=HANDOVER_TIMEOUT_S)
            if copy is not None:
                *where, state = copy
                ray.get(self._keeper.hold.remote(*where, pack_tensors(state)), timeout=HANDOVER_TIMEOUT_S)
            self._failing = False
        except Exception:   # the workers' own copies and the checkpoints still stand
            self._keeper = None
            if not self._failing:
                log.warning("could not hand this rank's copy to its node's keeper (a fault that kills every "
                            "worker would go back to the checkpoint)", exc_info=True)
            self._failing = True

    def _own_keeper(self, ray: Any) -> Any:
        """This node's keeper, made by the first rank that asks for it."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        node = ray.get_runtime_context().get_node_id()
        return ray.remote(NodeKeeper).options(
            name=self._names.keeper(node), namespace=NAMESPACE, lifetime="detached",
            get_if_exists=True, num_cpus=0, max_concurrency=4,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)).remote(
                self._names.controller())


def fetch_copy(name: str, generation: int, world_size: int, rank: int, step: int) -> Any:
    """The copy a keeper holds (a worker restoring from it)."""
    import ray
    keeper = ray.get_actor(name, namespace=NAMESPACE)
    packed: Any = ray.get(keeper.copy.remote(generation, world_size, rank, step), timeout=HANDOVER_TIMEOUT_S)
    return unpack_tensors(packed)


def kept_copies(names: RunNames, timeout_s: float = 10.0) -> list[tuple[str, int, int, int, int]]:
    """(keeper name, generation, world size, rank, step) of every copy the run's keepers hold; a
    keeper that does not answer in time holds nothing here (the controller)."""
    import ray
    asked: dict[str, Any] = {}
    for name in names.keepers():
        try:
            asked[name] = ray.get_actor(name, namespace=NAMESPACE).held.remote()
        except ValueError:      # gone meanwhile
            continue
    found = []
    for name, ref in asked.items():
        try:
            found += [(name, *copy) for copy in ray.get(ref, timeout=timeout_s)]
        except Exception:   # a keeper lost with its node holds nothing
            log.warning("the keeper %s did not say what it holds", name, exc_info=True)
    return found
