"""The worker side of a run: the Ray actor hosting one rank, and what survives a rescale there.

- `worker.py`          the actor: its training thread, its group, its answers to polls;
- `state.py`           what outlives a generation (progress, warm source, checkpoints, copies, outbox);
- `train_state.py`     the one state contract, saved and loaded by warm broadcasts and checkpoints;
- `restore.py`         the recovery ladder's rungs, carried out on a rank;
- `replicas.py`        FSDP's copies in host memory (its own and its ring neighbour's) and the
                       rebuild of a generation's shards from them (the memory rung);
- `thread_position.py` where the training thread is, for the controller's hang judge;
- `step_boundary.py`   what happens between two steps (the loader opens, report closes);
- `step_exchange.py`   the step's values gathered across ranks (read at the next step's report);
- `checkpoint_session.py`  the rules around commits;
- `fault_gate.py`      the tests' hold at a step (inactive unless the config names it);
- `ray_data.py`        a ray.data.Dataset as indexable rows for the loader: the run's data-source
                       actor that materializes it once, and each rank's view of its blocks;
- `broadcast.py`, `group_sockets.py`, `precision.py`, `wrap.py`, `step_timer.py`,
  `checkpoint_io.py`: the mechanisms those use.

The user's face over this is `elastic.context.TrainContext`. Only `worker.py` is imported by the
controller's process (to launch the actor class), and it imports torch inside its methods.
"""
from elastic._worker.worker import TrainWorker, classify_error

__all__ = ["TrainWorker", "classify_error"]
