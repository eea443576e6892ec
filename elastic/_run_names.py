"""The names under which a run's workers and placement groups outlive its controller.

A controller's actors share its fate: when its process dies, Ray kills every actor it created.
So a run's workers and their placement groups are detached (they belong to the run, not to the
process that placed them) and named after the run, in Ray's `elastic` namespace: a controller
that replaces a lost one finds them by name (adoption) and the driver of a run whose controller is
lost for good removes them (`reap`). A worker's name says which placement group and bundle it
holds, since a replacement under tensor parallelism goes into a bundle of its peers' group.

The actors that hold a run's data and copies outside its workers, its Ray Datasets' sources
(elastic._worker.ray_data) and its node keepers (elastic._node_keeper), are detached and named
after the run too: every rank, and every replacement, finds the one the first rank created. The
controller removes them when the run ends (`remove_holders`), by name: its process imports neither
Ray Data nor torch; and each ends itself once the run's controller is gone for good
(`end_when_orphaned`), as a worker's orphan watch does.
"""
from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, NamedTuple

log = logging.getLogger("elastic.group")

NAMESPACE = "elastic"
# A worker that no controller polls for this long ends itself (TrainWorker's orphan watch), even
# if the controller's actor is still there (a controller stuck for minutes): Ray restarts a lost
# controller in about a second, and a worker also ends once the controller's actor is gone for
# good (the driver that owned it ended), within two of its looks 5 s apart.
ORPHAN_AFTER_S = 300.0
ORPHAN_CHECK_S = 5.0        # how often a detached holder (data source, node keeper) looks for its run's controller


class WorkerName(NamedTuple):
    wid: int
    bundle: int
    placement_group: str       # its placement group's name


@dataclass(frozen=True)
class RunNames:
    run_id: str

    def controller(self) -> str:
        """The controller actor's name (it is the driver's: not detached; the name is released once
        it is dead for good, and kept while Ray restarts it)."""
        return f"{self.run_id}.controller"

    def placement_group(self) -> str:
        """A new placement group's name (unique: a replaced slot's group may outlive it)."""
        return f"{self.run_id}.pg.{uuid.uuid4().hex[:12]}"

    def worker(self, wid: int, bundle: int, placement_group: str) -> str:
        return f"{self.run_id}.w{wid}.b{bundle}@{placement_group}"

    def parse_worker(self, name: str) -> WorkerName | None:
        """The worker id, bundle and placement group of an actor named by `worker`, or None for
        any other name (another run's, another kind of actor)."""
        match = re.fullmatch(rf"{re.escape(self.run_id)}\.w(\d+)\.b(\d+)@(.+)", name)
        return WorkerName(int(match[1]), int(match[2]), match[3]) if match else None

    def owns_placement_group(self, name: str) -> bool:
        return name.startswith(f"{self.run_id}.pg.")

    @classmethod
    def of_controller(cls, name: str | None) -> RunNames | None:
        """The run whose controller actor is named `name` (what a worker is told), or None."""
        suffix = ".controller"
        if not name or not name.endswith(suffix):
            return None
        return cls(name[:-len(suffix)])

    def data_source(self, n: int) -> str:
        """The actor holding the n-th Ray Dataset the loop prepares (0-based, in the order of its
        ctx.prepare_data calls: the same in every generation)."""
        return f"{self.run_id}.data{n}"

    def data_sources(self) -> list[str]:
        """The names of the run's data-source actors alive in the cluster."""
        return _named(re.compile(rf"{re.escape(self.run_id)}\.data\d+"))

    def keeper(self, node_id: str) -> str:
        """The actor holding the copies of the run's state on node `node_id` (elastic._node_keeper)."""
        return f"{self.run_id}.keeper.{node_id}"

    def keepers(self) -> list[str]:
        """The names of the run's node keepers alive in the cluster."""
        return _named(re.compile(rf"{re.escape(self.run_id)}\.keeper\..+"))

    def workers(self) -> dict[str, WorkerName]:
        """The run's named workers alive in the cluster: actor name -> what it names."""
        import ray
        found = {}
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if isinstance(entry, dict) and entry.get("namespace") == NAMESPACE:
                parsed = self.parse_worker(entry.get("name", ""))
                if parsed is not None:
                    found[entry["name"]] = parsed
        return found

    def placement_groups(self) -> dict[str, Any]:
        """The run's placement groups not removed yet: name -> PlacementGroup."""
        from ray._raylet import PlacementGroupID
        from ray.util.placement_group import PlacementGroup, placement_group_table
        groups = {}
        for pg_id, entry in placement_group_table().items():
            name = entry.get("name") or ""
            if self.owns_placement_group(name) and entry.get("state") != "REMOVED":
                groups[name] = PlacementGroup(PlacementGroupID.from_hex(pg_id))
        return groups


def controller_gone(name: str) -> bool:
    """Whether the controller actor named `name` is gone for good (its name is free)."""
    import ray
    try:
        ray.get_actor(name, namespace=NAMESPACE)
        return False
    except ValueError:
        return True
    except Exception:   # noqa: BLE001 - the GCS unreachable (a head restarting): no evidence either way
        return False


def _named(pattern: re.Pattern[str]) -> list[str]:
    """The names of the actors in the elastic namespace that `pattern` matches whole."""
    import ray
    return sorted(entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)
                  if isinstance(entry, dict) and entry.get("namespace") == NAMESPACE
                  and pattern.fullmatch(entry.get("name", "")))


def remove_holders(run_id: str) -> int:
    """Kill the actors that hold the run's data and copies, detached so that they outlive its
    workers: its Ray Datasets' sources (their blocks go with them) and its node keepers (the
    copies of its state). Returns how many it killed; failures are logged, never raised (the
    run's outcome matters more)."""
    import ray
    killed = 0
    names = RunNames(run_id)
    try:
        holders = names.data_sources() + names.keepers()
    except Exception:   # the GCS unreachable: each also ends once the controller is gone
        log.warning("could not list the run's data sources and node keepers", exc_info=True)
        return 0
    for name in holders:
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
            killed += 1
        except Exception:   # gone meanwhile
            log.debug("could not kill %s", name, exc_info=True)
    if killed:
        log.info("removed the run's %d data source(s) and node keeper(s)", killed)
    return killed


def end_when_orphaned(controller: str, what: str) -> None:
    """A detached holder's thread (a data source, a node keeper): kill the calling actor, with no
    restart, once the run's controller is gone for good. Two looks in a row, since a name is
    released only once its actor is dead for good."""
    import ray
    missing = 0
    while missing < 2:
        time.sleep(ORPHAN_CHECK_S)
        missing = missing + 1 if controller_gone(controller) else 0
    log.warning("this %s ends: the run's controller %s is gone", what, controller)
    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


def reap(run_id: str) -> int:
    """Kill a run's named workers, data sources and node keepers and remove its placement groups (the driver
    of a run whose controller is gone for good: nothing else would end them before their orphan
    watch does). Returns how many workers it killed."""
    import ray
    from ray.util.placement_group import remove_placement_group
    names = RunNames(run_id)
    killed = 0
    for name in names.workers():
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
            killed += 1
        except Exception:
            log.debug("could not kill worker %s", name, exc_info=True)
    for name, group in names.placement_groups().items():
        try:
            remove_placement_group(group)
        except Exception:
            log.debug("could not remove placement group %s", name, exc_info=True)
    remove_holders(run_id)
    return killed
