"""The operator CLI reads a run's files from its storage URL."""
import json
import time

import pytest

from elastic.__main__ import main

pytestmark = pytest.mark.timeout(30)

SUMMARY = {"status": "finished", "final_step": 50, "total_steps": 50, "wall_s": 12.5, "goodput": 0.8,
           "resumed_from": None, "loss_first": 4.1, "loss_last": 2.0, "model_sha256": "ab" * 32,
           "world_size_history": [[0, 3], [20, 2]], "checkpoints": [50], "error": None,
           "recoveries": [{"cause": "worker_died", "rung": "warm", "detect_s": 0.2, "recover_s": 0.7,
                           "lost_steps": 0, "from_world": 3, "to_world": 2, "step": 20}]}


def test_report_prints_the_recoveries_table(tmp_path, capsys):
    (tmp_path / "summary.json").write_text(json.dumps(SUMMARY))
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "worker_died" in out and "warm" in out and "[[0, 3], [20, 2]]" in out


def test_report_of_a_failed_run_exits_non_zero(tmp_path, capsys):
    failed = SUMMARY | {"status": "failed", "error": {"type": "ValueError", "message": "bad batch"}}
    (tmp_path / "summary.json").write_text(json.dumps(failed))
    assert main(["report", str(tmp_path)]) == 1
    assert "ValueError: bad batch" in capsys.readouterr().out


def test_status_and_missing_files(tmp_path, capsys):
    assert main(["status", str(tmp_path)]) == 2
    assert "no status.json" in capsys.readouterr().err
    (tmp_path / "status.json").write_text(json.dumps({
        "state": "running", "step": 7, "world_size": 2, "generation": 1, "last_committed_step": 5,
        "updated_at": time.time(), "workers": [{"rank": 0, "pid": 11, "node_id": "n", "actor_id": "a"}]}))
    assert main(["status", str(tmp_path)]) == 0
    assert "running  step 7  world 2" in capsys.readouterr().out


def test_chaos_is_forwarded_to_the_chaos_cli(tmp_path, capsys):
    assert main(["chaos", "list"]) == 0
    listed = capsys.readouterr().out
    assert "smoke" in listed and "mixed" in listed
    assert main(["chaos", "schedule", "smoke", "--seed", "1"]) == 0
    assert '"kind": "kill_worker"' in capsys.readouterr().out
    (tmp_path / "status.json").write_text("{}")      # not empty: `chaos run` refuses it (exit 2)
    assert main(["chaos", "run", "smoke", "--storage", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "not empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["chaos", "run", "no-such-scenario", "--storage", str(tmp_path)])
