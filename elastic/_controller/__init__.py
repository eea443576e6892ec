"""The controller side of a run: the process that watches the workers and alone acts.

Nothing here imports torch or the user's code (tests/unit/test_controller_imports.py checks the
whole folder): the controller's actor starts before any worker, on the critical path of every
start. What to read first to understand a recovery, in order:

- `states.py`      the states, one frozen payload class each;
- `controller.py`  the state machine: each tick's handler asks its judge, then acts;
- `running.py`, `recovering.py`, `scheduling.py`  the judges: what a tick's views say (verdicts);
- `hang_watch.py`  running's judge of a rank that holds the others up (a bound learned from the steps);
- `forming.py`     a generation's fence, plans and restore (warm source, FSDP copies, checkpoint);
- `failure_budget.py`, `storage_retry.py`, `slots.py`  the budget, storage retries, slot counts;
- `ledgers.py`     the kept steps, and the recovery that is open until the re-formed group steps;
- `intake.py`      what the workers' reports add to the ledgers and the run record;
- `worker_group.py` the Ray actors, their placement groups, polls, kills;
- `node_agent.py`  the per-node agent that carries its node's polls (ScalingConfig.node_agents);
- `actor.py`       the Ray actor that hosts all of it and writes the summary;
- `journal.py`, `adoption.py`  the controller's account of the run in Ray's GCS, and what a
                   controller that replaces a lost one makes of the workers it finds (their
                   names: elastic._run_names);
- `run_record.py`  (with `metrics_log.py`, `status_writer.py`, `run_summary.py`, `time_ledger.py`)
                   the run's files.
"""
from elastic._controller.controller import Controller

__all__ = ["Controller"]
