"""`elastic status`, `elastic report` and `elastic stop` exit non-zero on a missing run, a storage error (one
line, no traceback) or a failed run; both take --option; status takes --json."""
import json
import time

import pytest

import elastic.__main__ as cli
from checkpointing.errors import StorageError
from checkpointing.storage import Storage

pytestmark = pytest.mark.timeout(30)

STATUS = {"state": "running", "step": 7, "world_size": 2, "generation": 1, "last_committed_step": 5,
          "workers": []}


def fresh(**fields) -> str:
    """A status.json as a live controller writes it: `updated_at` now (not at import: a suite
    that reaches this test minutes later would read a live state as stale)."""
    return json.dumps(STATUS | {"updated_at": time.time()} | fields)


def unreachable(self, path):
    raise StorageError(f"read {path!r} failed: EndpointConnectionError: Could not connect\n to the endpoint URL",
                       url=self.url)


@pytest.mark.parametrize("command", ["status", "report", "stop"])
def test_a_storage_error_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, command):
    monkeypatch.setattr(Storage, "read_bytes", unreachable)
    assert cli.main([command, str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: read ") and "Could not connect to the endpoint" in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("command", ["status", "report", "stop"])
def test_an_unknown_scheme_is_exit_2(capsys, command):
    assert cli.main([command, "nosuchscheme://bucket/run"]) == 2
    assert capsys.readouterr().err.startswith("error: ")


@pytest.mark.parametrize("command", ["status", "report", "stop"])
def test_a_missing_path_is_exit_2(tmp_path, capsys, command):
    assert cli.main([command, str(tmp_path / "no-such-run")]) == 2


def test_a_torn_status_file_is_exit_2(tmp_path, capsys):
    (tmp_path / "status.json").write_text('{"state": "runn')
    assert cli.main(["status", str(tmp_path)]) == 2
    assert "status.json" in capsys.readouterr().err


@pytest.mark.parametrize("state, code", [("running", 0), ("finished", 0), ("failed", 1), ("stopped", 0)])
def test_status_exits_1_for_a_failed_run_and_prints_json(tmp_path, capsys, state, code):
    (tmp_path / "status.json").write_text(fresh(state=state))
    assert cli.main(["status", str(tmp_path), "--json"]) == code
    assert json.loads(capsys.readouterr().out)["state"] == state


@pytest.mark.parametrize("watch", [[], ["--watch", "--interval", "0.01"]])
def test_status_of_a_live_state_not_updated_for_a_minute_says_the_run_is_probably_dead(tmp_path, capsys, watch):
    # Issue 34: after `ray job stop` the dead run still read "running", exit 0.
    (tmp_path / "status.json").write_text(fresh(updated_at=time.time() - 61))
    assert cli.main(["status", str(tmp_path), *watch]) == 3
    assert "probably dead" in capsys.readouterr().err
    # A finished run's status is old by design: nothing to say.
    (tmp_path / "status.json").write_text(fresh(state="finished", updated_at=0))
    assert cli.main(["status", str(tmp_path), *watch]) == 0


def test_status_watch_ends_with_the_failed_runs_code(tmp_path, capsys):
    (tmp_path / "status.json").write_text(fresh(state="failed"))
    assert cli.main(["status", str(tmp_path), "--watch", "--interval", "0.01"]) == 1


@pytest.mark.parametrize("status, code", [("finished", 0), ("failed", 1), ("stopped_early", 1), ("stopped", 0)])
def test_report_json_exits_by_the_runs_status(tmp_path, capsys, status, code):
    summary = {"status": status, "final_step": 5, "total_steps": 10}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert cli.main(["report", str(tmp_path), "--json"]) == code
    assert json.loads(capsys.readouterr().out) == summary


@pytest.mark.parametrize("command, name", [("status", "status.json"), ("report", "summary.json"),
                                           ("stop", "status.json")])
def test_option_values_are_typed_and_reach_the_storage(tmp_path, monkeypatch, capsys, command, name):
    seen = []
    real = Storage.__init__

    def spy(self, url, storage_options=None):
        seen.append(storage_options)
        real(self, url, None)
    monkeypatch.setattr(Storage, "__init__", spy)
    (tmp_path / name).write_text(fresh(status="finished", final_step=1, total_steps=1, wall_s=1.0, goodput=1,
                                       resumed_from=None, loss_first=1, loss_last=1, model_sha256=None,
                                       world_size_history=[], checkpoints=[]))
    assert cli.main([command, str(tmp_path), "--option", "anon=false", "--option", "endpoint_url=http://h:9000",
                     "--option", "config_kwargs={\"connect_timeout\": 5}"]) == 0
    assert seen and all(options == {"anon": False, "endpoint_url": "http://h:9000",
                                    "config_kwargs": {"connect_timeout": 5}} for options in seen)


def test_a_malformed_option_is_exit_2(tmp_path, capsys):
    assert cli.main(["status", str(tmp_path), "--option", "anon"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path):
    """`elastic report | head` printed a BrokenPipeError traceback (issue 34's smaller points)."""
    import subprocess
    import sys
    recovery = {"cause": "worker_died", "rung": "warm", "detect_s": 0.1, "recover_s": 1.0, "lost_steps": 0,
                "from_world": 2, "to_world": 2, "step": 1}
    (tmp_path / "summary.json").write_text(json.dumps(
        {"status": "finished", "final_step": 5, "total_steps": 5, "wall_s": 1.0, "goodput": 1.0, "resumed_from": None,
         "loss_first": 1.0, "loss_last": 0.5, "model_sha256": None, "world_size_history": [], "checkpoints": [],
         "recoveries": [recovery] * 20000}))
    reader = subprocess.Popen([sys.executable, "-m", "elastic", "report", str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    assert reader.stdout.readline().startswith(b"status finished")
    reader.stdout.close()                              # `| head -1`
    err = reader.stderr.read().decode()
    assert reader.wait(timeout=30) == 1 and "Traceback" not in err and "BrokenPipe" not in err, err
