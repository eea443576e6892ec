"""Every metric the loop reports reaches metrics.jsonl and the run's metrics; ctx.log values get
lines of their own; every file of the run record is strict JSON (no Ray)."""
import json
import math

import pytest

from elastic._controller.run_record import RunRecorder
from elastic._protocol import StepRecord
from elastic.result import RunMetrics, newest_checkpoint

pytestmark = pytest.mark.timeout(30)


def step(n, loss=1.0, generation=0, **metrics):
    return StepRecord(step=n, loss=loss, world_size=2, time=100.0 + n, samples_seen=16 * n, global_batch=16,
                      metrics=metrics, generation=generation)


def log(n, generation=0, **metrics):
    return StepRecord(step=n, loss=None, world_size=2, time=100.5 + n, samples_seen=16 * n, global_batch=16,
                      metrics=metrics, generation=generation, kind="log")


def lines(path):
    return [json.loads(line) for line in open(path / "metrics.jsonl")]


def recorder(tmp_path, **kwargs):
    rec = RunRecorder(str(tmp_path), None, total_steps=10, config={}, **kwargs)
    rec.on_generation_start(0, 2)
    return rec


def test_every_reported_metric_is_in_the_step_line_after_the_framework_keys(tmp_path):
    rec = recorder(tmp_path)
    rec.on_step(step(1, lr=0.1, grad_norm=2.5, tokens_per_s=1000.0))
    rec.flush_metrics()
    (line,) = lines(tmp_path)
    assert line["grad_norm"] == 2.5 and line["tokens_per_s"] == 1000.0 and line["lr"] == 0.1
    assert list(line)[:10] == ["format", "step", "loss", "world_size", "time", "lr", "global_batch", "accum_steps",
                               "samples_seen", "compute_s"]


def test_a_user_metric_never_overwrites_a_framework_key(tmp_path, caplog):
    rec = recorder(tmp_path)
    rec.on_step(step(1, world_size=99.0, samples_seen=-1.0, kind=3.0, acc=0.5))
    rec.on_step(step(2, world_size=99.0, acc=0.6))
    rec.on_log(log(2, step=7.0, time=1.0, kind=2.0, val=0.25))
    rec.flush_metrics()
    first, second, logged = lines(tmp_path)
    assert first["world_size"] == 2 and first["samples_seen"] == 16 and "kind" not in first
    assert second["world_size"] == 2 and second["acc"] == 0.6
    assert logged == {"format": 1, "step": 2, "kind": "log", "time": 102.5, "val": 0.25}
    assert "world_size" not in rec.user_metrics()["last"]
    warned = [r.getMessage() for r in caplog.records if "framework key" in r.getMessage()]
    assert len(warned) == 5          # once per name: world_size, samples_seen, kind, step, time


def test_log_values_get_a_line_of_their_own_at_their_step_and_count_no_step(tmp_path):
    now = [100.0]
    rec = recorder(tmp_path, clock=lambda: now[0])
    now[0] = 110.0
    for n in (1, 2):
        rec.on_step(step(n))
    rec.on_log(log(2, val_loss=0.75))
    rec.on_step(step(3))
    rec.flush_metrics()
    rows = lines(tmp_path)
    assert [(r["step"], r.get("kind")) for r in rows] == [(1, None), (2, None), (2, "log"), (3, None)]
    assert rows[2] == {"format": 1, "step": 2, "kind": "log", "time": 102.5, "val_loss": 0.75}
    # No step, no loss of its own: had the log line counted as step 2 again, step 2's first
    # second would have moved from productive to redone.
    assert rec.last_loss == 1.0
    ledger = rec.summary.time_ledger
    assert ledger["productive"] == pytest.approx(2.0) and ledger["redone"] == 0.0


def test_a_log_line_of_an_older_step_does_not_confuse_the_next_flush(tmp_path):
    rec = recorder(tmp_path)
    for n in (1, 2, 3):
        rec.on_step(step(n))
    rec.on_log(log(2, val=1.0))      # held a step by the controller (a higher rank's)
    rec.flush_metrics()
    assert [(r["step"], r.get("kind")) for r in lines(tmp_path)] == [(1, None), (2, None), (2, "log"), (3, None)]
    rec.on_log(log(1, val=0.5))      # older than lines on storage: appended, nothing rewritten
    rec.on_step(step(4))
    rec.flush_metrics()
    assert [r["step"] for r in lines(tmp_path)] == [1, 2, 2, 3, 1, 4]
    assert rec.metrics_log._keep_through is None and rec.metrics_log._written_through == 4


def test_a_rollback_takes_the_log_lines_and_metrics_of_the_lost_steps(tmp_path):
    rec = recorder(tmp_path)
    for n in range(1, 5):
        rec.on_step(step(n, acc=n / 10))
        rec.on_log(log(n, val=float(n)))
    rec.flush_metrics()                     # on storage already: the file is rewritten
    rec.rollback_to(2)                      # steps 3 and 4 were lost
    rec.on_step(step(3, generation=1, acc=0.9))
    rec.flush_metrics()
    rows = lines(tmp_path)
    assert [(r["step"], r.get("kind")) for r in rows] == [(1, None), (1, "log"), (2, None), (2, "log"), (3, None)]
    metrics = RunMetrics(**rec.user_metrics())
    assert metrics.history["val"] == [[1, 1.0], [2, 2.0]]
    assert metrics.history["acc"] == [[1, 0.1], [2, 0.2], [3, 0.9]]
    assert metrics.last == {"loss": 1.0, "acc": 0.9, "val": 2.0}


def test_run_metrics_hold_the_last_value_and_history_and_the_summary_the_last_values(tmp_path):
    rec = recorder(tmp_path)
    for n in (1, 2, 3):
        rec.on_step(step(n, loss=1.0 / n, lr=0.01 * n, grad_norm=float(n)))
    rec.on_log(log(2, val_loss=0.5))
    metrics = RunMetrics(**rec.user_metrics())
    assert metrics.last == {"loss": 1 / 3, "lr": 0.03, "grad_norm": 3.0, "val_loss": 0.5}
    assert metrics.history["grad_norm"] == [[1, 1.0], [2, 2.0], [3, 3.0]]
    assert metrics.history["val_loss"] == [[2, 0.5]]
    summary = rec.write_summary(status="finished", final_step=3, checkpoints=[2, 3], model_sha256=None, error=None)
    assert summary["metrics"] == metrics.last
    assert json.loads((tmp_path / "summary.json").read_text())["metrics"] == metrics.last
    assert newest_checkpoint(str(tmp_path) + "/", [2, 3]) == f"{tmp_path}/checkpoints/step_00000003"
    assert newest_checkpoint("s3://b/run", []) is None


def strict_load(text):
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def test_non_finite_values_are_written_as_null_in_every_file(tmp_path):
    rec = recorder(tmp_path)
    rec.on_step(step(1, loss=math.nan, grad_norm=math.inf, lr=0.1))
    rec.on_log(log(1, val=-math.inf))
    rec.write_status(force=True, state="running", step=1, odd=math.nan)
    summary = rec.write_summary(status="finished", final_step=1, checkpoints=[], model_sha256=None, error=None)
    step_line, log_line = (strict_load(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())
    assert step_line["loss"] is None and step_line["grad_norm"] is None and step_line["lr"] == 0.1
    assert log_line["val"] is None
    written = strict_load((tmp_path / "summary.json").read_text())
    assert written["metrics"] == {"loss": None, "grad_norm": None, "lr": 0.1, "val": None}
    assert written["loss_first"] is None and summary == written
    assert strict_load((tmp_path / "status.json").read_text())["odd"] is None
    assert math.isnan(rec.user_metrics()["last"]["loss"])      # Python's view keeps the float


def test_the_report_plot_reads_step_lines_only():
    from elastic._report_plot import parse_metrics
    text = ('{"step": 1, "loss": 1.0, "world_size": 2, "time": 1.0}\n'
            '{"step": 1, "kind": "log", "time": 1.5, "val": 0.5}\n'
            '{"step": 2, "loss": null, "world_size": 2, "time": 2.0}\n')
    assert [(r["step"], r.get("kind")) for r in parse_metrics(text)] == [(1, None), (2, None)]


def test_a_resumed_run_keeps_the_metrics_of_the_steps_before_its_resume(tmp_path):
    first = recorder(tmp_path)
    for n in (1, 2, 3, 4):
        first.on_step(step(n, loss=1.0 / n, lr=0.1, acc=n / 10, odd=math.nan if n == 2 else 1.0))
    first.on_log(log(2, val=0.5))
    first.on_log(log(4, val=0.25))           # past the checkpoint the next run resumes from
    first.flush_metrics()
    second = RunRecorder(str(tmp_path), None, total_steps=10, config={})
    second.load_previous_metrics(3)
    second.on_generation_start(3, 2)
    second.on_step(step(4, loss=0.2, acc=0.45))
    second.flush_metrics()
    metrics = RunMetrics(**second.user_metrics())
    assert metrics.history["acc"] == [[1, 0.1], [2, 0.2], [3, 0.3], [4, 0.45]]
    assert metrics.history["val"] == [[2, 0.5]] and metrics.history["lr"] == [[1, 0.1], [2, 0.1], [3, 0.1]]
    assert math.isnan(metrics.history["odd"][1][1]) and metrics.last["loss"] == 0.2
    assert [(r["step"], r.get("kind")) for r in lines(tmp_path)] == [(1, None), (2, None), (2, "log"), (3, None),
                                                                     (4, None)]
