"""The JSON Schemas of the files others parse (status.json, summary.json, metrics.jsonl) ship in the
package, carry the files' `format`, and accept the files the writers write: the run record's
(through its real writers, on a local storage), the trainer's first status.json and the driver's
record of a lost controller. Their vocabularies (states, statuses, causes, rungs) follow the code's
enums. (A real run with a recovery is validated in tests/integration/test_runtime.py.)"""
import json
import math

import jsonschema
import pytest

from checkpointing.lease import FINAL_STATES
from elastic import CheckpointConfig, ElasticTrainer, ScalingConfig
from elastic._controller.ledgers import Rung
from elastic._controller.run_record import RunRecorder
from elastic._controller.states import RunState
from elastic._protocol import StepRecord
from elastic.policies import Cause
from elastic.schemas import METRICS_FORMAT, SCHEMA_FILES, STATUS_FORMAT, SUMMARY_FORMAT, load_schema
from run_file_schemas import validate, validate_run

pytestmark = pytest.mark.timeout(30)


def step(n, loss=1.0, **metrics):
    return StepRecord(step=n, loss=loss, world_size=2, time=100.0 + n, samples_seen=16 * n, global_batch=16,
                      metrics=metrics, compute_s=(0.1, 0.12))


def log(n, **metrics):
    return StepRecord(step=n, loss=None, world_size=2, time=100.5 + n, samples_seen=16 * n, global_batch=16,
                      metrics=metrics, kind="log")


def recorded_run(tmp_path, *, status="finished", error=None):
    """A run record written by the real writers: two generations, a recovery, a straggler, a
    rollback, a log line, a non-finite metric, the final status.json and summary.json."""
    rec = RunRecorder(str(tmp_path), None, total_steps=4, config={"scaling": {"max_workers": None}}, run_id="r1")
    rec.write_status(force=True, state="scheduling", generation=-1, step=0, workers=[])
    rec.on_generation_start(0, 3)
    for n in (1, 2, 3):
        rec.on_step(step(n, lr=0.1, grad_norm=float("nan") if n == 2 else 1.0))
    rec.on_log(log(2, val_loss=0.7))
    rec.on_straggler({"rank": 1, "step": 3, "score": 1.6})
    rec.write_status(force=True, state="running", generation=0, step=3, world_size=3, last_committed_step=2,
                     workers=[{"rank": r, "pid": 100 + r, "node_id": "n", "actor_id": f"a{r}"} for r in range(3)],
                     spares=[{"pid": 200, "node_id": "n", "actor_id": "s"}])
    rec.rollback_to(2)
    rec.on_generation_start(2, 2)
    rec.on_recovery({"cause": "worker_died", "rung": "warm", "detect_s": 0.4, "recover_s": 2.0, "lost_steps": 1,
                     "from_world": 3, "to_world": 2, "step": 2, "generation": 1, "detected_at": 1.0,
                     "recovered_at": 3.0, "failures": []})
    for n in (3, 4):
        rec.on_step(step(n, loss=0.5, lr=0.05))
    rec.write_summary(status=status, final_step=4, checkpoints=[2, 4], model_sha256="0" * 64, error=error)
    rec.write_status(force=True, state="finished" if status == "finished" else "failed", generation=1, step=4,
                     world_size=2, workers=[])
    rec.close()
    return rec


def test_the_schemas_are_valid_json_schemas_and_ship_in_the_package():
    for name in SCHEMA_FILES:
        schema = load_schema(name)
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["properties"]["format"] == {"const": 1, "description": schema["properties"]["format"]
                                                  ["description"]}
    assert (STATUS_FORMAT, SUMMARY_FORMAT, METRICS_FORMAT) == (1, 1, 1)
    with pytest.raises(ValueError, match="no schema for 'COMMITTED'"):
        load_schema("COMMITTED")


def test_the_run_records_files_fit_their_schemas(tmp_path):
    recorded_run(tmp_path)
    assert validate_run(str(tmp_path)) == {"status.json": 1, "summary.json": 1, "metrics.jsonl": 5}
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert all(line["format"] == METRICS_FORMAT for line in lines)
    assert [line["step"] for line in lines] == [1, 2, 2, 3, 4] and lines[1]["grad_norm"] is None   # NaN: null
    assert json.loads((tmp_path / "summary.json").read_text())["format"] == SUMMARY_FORMAT
    assert json.loads((tmp_path / "status.json").read_text())["format"] == STATUS_FORMAT


def test_a_failed_runs_files_fit_too(tmp_path):
    recorded_run(tmp_path, status="failed", error={"type": "UserCodeError", "message": "boom", "traceback": "tb",
                                                    "ranks": [0]})
    validate_run(str(tmp_path))


def test_the_trainers_first_status_fits(tmp_path):
    ElasticTrainer(lambda ctx: None, scaling=ScalingConfig(), total_steps=5,
                   checkpoint=CheckpointConfig(storage=str(tmp_path))).claim_storage()
    validate("status.json", json.loads((tmp_path / "status.json").read_text()))


def test_the_drivers_record_of_a_lost_controller_fits(tmp_path):
    from elastic._driver_record import record_lost_controller
    from elastic.errors import WorkerLostError
    ElasticTrainer(lambda ctx: None, scaling=ScalingConfig(), total_steps=5,
                   checkpoint=CheckpointConfig(storage=str(tmp_path))).claim_storage()
    summary, own = record_lost_controller(str(tmp_path), None, error=WorkerLostError("controller died"),
                                          traceback="tb", config={}, total_steps=5, started_at=0.0)
    assert not own
    validate("status.json", json.loads((tmp_path / "status.json").read_text()))
    validate("summary.json", json.loads((tmp_path / "summary.json").read_text()))


@pytest.mark.parametrize("name, doc, where", [
    ("status.json", {"format": 1, "state": "napping", "generation": 0, "step": 0, "updated_at": 1.0,
                     "workers": []}, "state"),
    ("status.json", {"state": "running", "generation": 0, "step": 0, "updated_at": 1.0, "workers": []}, "format"),
    ("metrics.jsonl", {"format": 1, "step": 3, "time": 1.0}, "loss"),                  # a step line needs its keys
    ("metrics.jsonl", {"format": 1, "step": 3, "time": 1.0, "kind": "log", "acc": "high"}, "acc"),
    ("metrics.jsonl", {"format": 2, "step": 3, "time": 1.0, "kind": "log"}, "format"),
])
def test_a_file_that_breaks_its_schema_is_refused(name, doc, where):
    with pytest.raises(jsonschema.ValidationError, match=where):
        validate(name, doc)


def test_a_non_finite_value_never_reaches_a_file_as_nan(tmp_path):
    recorded_run(tmp_path)
    for name in ("status.json", "summary.json", "metrics.jsonl"):
        text = (tmp_path / name).read_text()
        assert "NaN" not in text and "Infinity" not in text
    assert not any(isinstance(v, float) and math.isnan(v)
                   for v in json.loads((tmp_path / "summary.json").read_text())["metrics"].values())


def test_the_vocabularies_follow_the_codes_enums():
    status = load_schema("status.json")["properties"]["state"]["enum"]
    summary = load_schema("summary.json")
    recovery = summary["$defs"]["recovery"]["properties"]
    assert {s.value for s in RunState} <= set(status) and FINAL_STATES <= set(status)
    assert set(summary["properties"]["status"]["enum"]) == set(FINAL_STATES)
    assert set(recovery["cause"]["enum"]) == {c.value for c in Cause}
    assert set(recovery["rung"]["enum"]) == {r.value for r in Rung}
