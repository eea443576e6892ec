"""Worker slots' placements: one placement group per slot (per replica under tensor parallelism),
and the TrainWorker actor started in it.

Under tensor parallelism (ScalingConfig.tensor_parallel_size = T > 1) a replica's T ranks carry
the step's heaviest traffic, so they get one placement group of T bundles with strategy
STRICT_PACK: Ray reserves all of them on one node or none. A slot is then one bundle of it, and
a slot that dies while its peers live is replaced in the same bundle (Ray gives a dead actor's
resources back to the bundle it used, not to the node): the replacement joins its peers on their
node, and replica_arrangement puts it in their replica. Once no live slot holds a bundle of it,
the worker group removes the placement group, as it removes a slot's own at T = 1.

Under pipeline parallelism a replica is P stages of T ranks, and the placement group stays per
stage (T bundles, STRICT_PACK): a stage's TP traffic stays on its node, while a pipeline's
point-to-point sends between stages (one activation per micro-batch) may cross nodes, as PP does
across nodes in torchtitan and Megatron. At T = 1 each rank has its own, as without PP.

Under HSDP the run grows and shrinks by shard groups of S replicas, but placement stays per
replica of T: a shard group's FSDP traffic (all-gathers and reduce-scatters, overlapped with
compute) crosses nodes as torchtitan's HSDP does, a TP group's (blocking, every layer) must not,
and a shard group of S x T ranks may not fit one node. A shard group is S placement groups.

`Placements` asks Ray for the placement groups of new slots, launches each slot's actor once its
placement is granted, and takes each actor's first answer (its WorkerInfo): the slot is ready
then. It never waits: a placement that cannot be granted yet stays pending (a replacement starts
by itself when capacity returns), and one pending long is said to be stuck, once. What failed to
start is returned to the worker group (worker_group.RayWorkerGroup), which kills or buries it.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import ray
from ray import ObjectRef
from ray.exceptions import RayError, RayTaskError
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from elastic._controller.ray_calls import answered, first_line
from elastic._controller.slot_table import PENDING, STARTING, Slot, SlotTable
from elastic._protocol import RunSpec
from elastic._run_names import NAMESPACE, RunNames
from elastic._worker.worker import TrainWorker

log = logging.getLogger("elastic.group")

PLACEMENT_WARN_S = 30.0   # a placement pending this long (at least startup_wait_s) is said to be stuck


class StartFailure(NamedTuple):
    """A slot whose actor did not start."""

    slot: Slot
    reason: str
    alive: bool     # its actor may still run (kill it), or it is gone already (only record its death)


class Placements:
    """The placements and starts of the run's worker slots (filed in the slot table)."""

    def __init__(self, spec: RunSpec, slots: SlotTable, clock: Callable[[], float], names: RunNames | None = None):
        """`names`: the run's (elastic._run_names): its workers and placement groups are detached and named,
        and outlive this controller. None: they are this controller's and die with it."""
        self._spec, self._slots, self._clock, self._names = spec, slots, clock, names
        self._scaling, self._start_timeout_s = spec.scaling, spec.failure.rendezvous_timeout_s
        resources = dict(spec.scaling.resources_per_worker)
        if spec.scaling.use_gpu:
            resources.setdefault("GPU", 1.0)
        self.bundle = resources
        self.avoid: tuple[str, ...] = ()      # node ids no new bundle may be placed on (bad_nodes)

    def _placement_group(self, bundles: int, strategy: str) -> Any:
        # Ray labels every node with its id (ray.io/node-id): a selector excludes the bad ones.
        avoid = {"bundle_label_selector": [{"ray.io/node-id": f"!in({','.join(self.avoid)})"}] * bundles} \
            if self.avoid else {}
        name = self._names.placement_group() if self._names else ""
        named = {"name": name, "lifetime": "detached"} if name else {}
        return placement_group([dict(self.bundle) for _ in range(bundles)], strategy=strategy, **avoid,
                               **named), name

    def scale_to(self, n: int) -> None:
        """Keep `n` worker slots alive or pending; start placements for the missing ones."""
        missing = n - self._slots.live()
        tp = self._scaling.tensor_parallel_size
        if tp == 1:
            for _ in range(missing):
                pg, name = self._placement_group(1, "PACK")
                self._slots.open(pg, pg.ready(), pg_name=name)
            return
        # Replacements first go where their peers wait: the free bundles of live replicas' groups.
        refills = self._slots.free_bundles(tp)[:max(0, missing)]
        for pg, bundle, name in refills:
            # One ready reference each: ray.wait takes no duplicates.
            self._slots.open(pg, pg.ready(), bundle, pg_name=name)
        # The rest in whole replicas. Counts of ranks are multiples of T (ScalingConfig), but a
        # recovery's target (the workers alive) and an unlimited run's probe (one more than placed)
        # need not be: a part of a replica could never join a group, so the count is rounded up
        # (an unlimited run probes for one more replica).
        for _ in range(-(-(missing - len(refills)) // tp)):
            pg, name = self._placement_group(tp, "STRICT_PACK")
            for bundle in range(tp):
                self._slots.open(pg, pg.ready(), bundle, pg_name=name)

    def refs(self) -> list[ObjectRef]:
        """What a placement or a start answers on (WorkerGroup.wait waits on it)."""
        refs = [s.pg_ready for s in self._slots.in_status(PENDING) if s.pg_ready is not None]
        return refs + [s.info_ref for s in self._slots.in_status(STARTING) if s.info_ref is not None]

    def advance(self, now: float) -> list[StartFailure]:
        """Launch the actors of the granted placements, and take the started actors' first
        answers; returns the slots whose actor failed to start (or did not within
        FailureConfig.rendezvous_timeout_s)."""
        failed: list[StartFailure] = []
        placed, pending = answered(self._slots.in_status(PENDING), lambda s: s.pg_ready)
        for slot, _ in placed:
            self._launch(slot)
        for slot in pending:
            self._warn_if_stuck(slot, now)
        started, starting = answered(self._slots.in_status(STARTING), lambda s: s.info_ref)
        for slot, ref in started:
            try:
                self._slots.started(slot, ray.get(ref), now)
                # Where a replacement's start goes (a recovery may wait on it): the placement,
                # then the process and the worker's imports.
                log.debug("worker %d ready %.2fs after its slot was made (placed in %.2fs)", slot.wid,
                          now - slot.created_at, slot.placed_at - slot.created_at)
            except RayTaskError as error:
                failed.append(StartFailure(slot, f"failed while starting: {first_line(error)}", alive=True))
            except RayError as error:
                failed.append(StartFailure(slot, f"died while starting: {error}", alive=False))
        for slot in starting:
            if now - slot.created_at > self._start_timeout_s:
                failed.append(StartFailure(slot, "did not start within FailureConfig.rendezvous_timeout_s",
                                           alive=True))
        return failed

    def _launch(self, slot: Slot) -> None:
        placed_at = self._clock()
        resources = dict(self.bundle)
        cpus = resources.pop("CPU", 0.0)
        gpus = resources.pop("GPU", 0.0)
        assert slot.pg is not None, "a slot placed has its placement group"
        named: dict[str, Any] = {}
        if self._names is not None:
            named = {"name": self._names.worker(slot.wid, slot.bundle, slot.pg_name), "namespace": NAMESPACE,
                     "lifetime": "detached"}
        actor_cls = ray.remote(TrainWorker).options(
            num_cpus=cpus, num_gpus=gpus, resources=resources or None, max_concurrency=8,
            max_restarts=0, **named,
            scheduling_strategy=PlacementGroupSchedulingStrategy(slot.pg, placement_group_bundle_index=slot.bundle))
        # Ray resolves its methods by name
        actor: Any = actor_cls.remote(self._spec, self._names.controller() if self._names is not None else None)
        self._slots.launched(slot, actor, actor.info.remote(), placed_at)

    def _warn_if_stuck(self, slot: Slot, now: float) -> None:
        scaling = self._scaling
        if (not slot.warned and scaling.max_workers is not None     # unlimited: a probe waits
                and now - slot.created_at > max(PLACEMENT_WARN_S, scaling.startup_wait_s)):
            # Nothing else says it: a configured spare (or a worker up to max_workers) that never
            # gets resources leaves the run without the replacement it counts on.
            slot.warned = True
            tp = scaling.tensor_parallel_size
            log.warning("worker slot %d has waited %.0fs for resources %s (Ray has %s available): the "
                        "cluster cannot place max_workers + spare_workers = %s workers%s; add resources or "
                        "lower them", slot.wid, now - slot.created_at, self.bundle,
                        _available_resources(), scaling.max_workers + scaling.spare_workers,
                        (f" ({tp} of them on one node for each replica)" if tp > 1 else "")
                        + (f"; nodes marked bad by silent corruption verdicts are excluded: {list(self.avoid)}"
                           if self.avoid else ""))


def _available_resources() -> dict[str, float] | str:
    try:
        return {k: v for k, v in ray.available_resources().items() if not k.startswith("node:")}
    except Exception:   # noqa: BLE001 - only for the warning's words
        return "unknown"
