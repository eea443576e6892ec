"""`elastic report URL --plot`: a PNG of loss, world size and LR over time, recoveries marked."""
import json

import pytest

from elastic import _report_plot
from elastic.__main__ import main

pytestmark = pytest.mark.timeout(60)

PNG = b"\x89PNG\r\n\x1a\n"


def _metrics(n: int = 40, drop_at: int = 20) -> str:
    lines = []
    for step in range(1, n + 1):
        world = 3 if step <= drop_at else 2
        lines.append(json.dumps({"step": step, "loss": 4.0 - step * 0.05, "world_size": world,
                                 "time": 1000.0 + step * 0.25 + (2.0 if step > drop_at else 0.0),
                                 "lr": 3e-3 * world / 3, "global_batch": 8 * world, "accum_steps": 1,
                                 "samples_seen": 8 * world * step}))
    return "\n".join(lines) + "\n"


SUMMARY = {"status": "finished", "final_step": 40, "total_steps": 40, "wall_s": 14.0, "goodput": 0.8,
           "resumed_from": None, "loss_first": 3.95, "loss_last": 2.0, "model_sha256": "ab" * 32,
           "world_size_history": [[0, 3], [20, 2]], "checkpoints": [20, 40], "error": None,
           "recoveries": [{"cause": "worker_died", "rung": "warm", "detect_s": 0.2, "recover_s": 1.1,
                           "lost_steps": 0, "from_world": 3, "to_world": 2, "step": 20, "generation": 1},
                          {"cause": "scale_up", "rung": "warm", "detect_s": 0.0, "recover_s": 0.9,
                           "lost_steps": 0, "from_world": 2, "to_world": 3, "step": 35, "generation": 2}]}


def test_render_marks_every_recovery_at_its_step_time():
    rows = _report_plot.parse_metrics(_metrics() + '{"step": 41, "loss"')   # torn last line: skipped
    png, drawn = _report_plot.render(rows, SUMMARY, title="runs/x")
    assert png.startswith(PNG) and len(png) > 10_000
    assert drawn["points"] == 40
    assert [(m["step"], m["cause"]) for m in drawn["recoveries_marked"]] == [(20, "worker_died"), (35, "scale_up")]
    assert drawn["recoveries_marked"][0]["x"] == pytest.approx(20 * 0.25 - 0.25)   # time of step 20 - step 1


def test_render_without_metrics_is_an_error():
    with pytest.raises(ValueError, match="no step lines"):
        _report_plot.render([], SUMMARY)


def test_report_plot_to_a_path(tmp_path, capsys):
    (tmp_path / "summary.json").write_text(json.dumps(SUMMARY))
    (tmp_path / "metrics.jsonl").write_text(_metrics())
    out = tmp_path / "out.png"
    assert main(["report", str(tmp_path), "--plot", str(out)]) == 0
    assert out.read_bytes().startswith(PNG)
    captured = capsys.readouterr()
    assert "worker_died" in captured.out and "2 recoveries marked" in captured.err


def test_report_plot_defaults_to_the_run_directory(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps(SUMMARY))
    (tmp_path / "metrics.jsonl").write_text(_metrics())
    assert main(["report", str(tmp_path), "--plot"]) == 0
    assert (tmp_path / "report.png").read_bytes().startswith(PNG)


def test_report_plot_without_metrics_exits_2(tmp_path, capsys):
    (tmp_path / "summary.json").write_text(json.dumps(SUMMARY))
    assert main(["report", str(tmp_path), "--plot"]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    assert not (tmp_path / "report.png").exists()
