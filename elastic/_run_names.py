"""The names under which a run's workers and placement groups outlive its controller.

A controller's actors share its fate: when its process dies, Ray kills every actor it created.
So a run's workers and their placement groups are detached (they belong to the run, not to the
process that placed them) and named after the run, in Ray's `elastic` namespace: a controller
that replaces a lost one finds them by name (adoption) and the driver of a run whose controller is
lost for good removes them (`reap`). A worker's name says which placement group and bundle it
holds, since a replacement under tensor parallelism goes into a bundle of its peers' group.
"""
from __future__ import annotations

import logging
import re
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


def reap(run_id: str) -> int:
    """Kill a run's named workers and remove its placement groups (the driver of a run whose
    controller is gone for good: nothing else would end them before their orphan watch does).
    Returns how many workers it killed."""
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
    return killed
