"""`elastic stop`: the STOP object on storage (request, read, clear), the CLI's exit codes, and the
trainer clearing a STOP left by an earlier run when it claims the storage."""
import json

import pytest

import elastic.__main__ as cli
from checkpointing.storage import Storage
from elastic import CheckpointConfig, ElasticTrainer, ScalingConfig
from elastic.stop_request import STOP_FORMAT, STOP_NAME, clear_stop, read_stop, request_stop

pytestmark = pytest.mark.timeout(30)


def status(tmp_path, **fields):
    doc = {"format": 1, "state": "running", "step": 7, "generation": 1, "workers": [], "run_id": "r1",
           "updated_at": __import__("time").time()} | fields
    (tmp_path / "status.json").write_text(json.dumps(doc))


def test_request_read_clear_round_trip(tmp_path):
    storage = Storage(str(tmp_path))
    assert read_stop(storage) is None
    request_stop(str(tmp_path), reason="maintenance at 14:00", run_id="r1")
    doc = read_stop(storage)
    assert doc is not None and doc["format"] == STOP_FORMAT and doc["reason"] == "maintenance at 14:00"
    assert doc["run_id"] == "r1" and doc["host"] and isinstance(doc["requested_at"], float)
    assert json.loads((tmp_path / STOP_NAME).read_text()) == doc          # plain JSON, one object
    clear_stop(storage)
    assert read_stop(storage) is None and not (tmp_path / STOP_NAME).exists()
    clear_stop(storage)                                                   # none there: a no-op


def test_a_stop_written_by_hand_is_a_request_too(tmp_path):
    (tmp_path / STOP_NAME).write_text("")                                 # `touch <storage>/STOP`
    doc = read_stop(Storage(str(tmp_path)))
    assert doc is not None and doc["format"] is None


def test_request_on_memory_storage_through_options():
    url = "memory://stop-request-test/run"
    request_stop(url, {}, reason="r")
    storage = Storage(url)
    assert read_stop(storage)["reason"] == "r"
    clear_stop(storage)
    assert read_stop(storage) is None


def test_cli_stop_writes_the_request_and_says_what_happens(tmp_path, capsys):
    status(tmp_path)
    assert cli.main(["stop", str(tmp_path), "--reason", "node drain"]) == 0
    out = capsys.readouterr()
    assert "stop requested" in out.out and '"stopped"' in out.out and "resume" in out.out
    assert out.err == ""                                                  # a fresh status: no staleness note
    doc = read_stop(Storage(str(tmp_path)))
    assert doc["reason"] == "node drain" and doc["run_id"] == "r1"


@pytest.mark.parametrize("state", ["finished", "failed", "stopped", "stopped_early"])
def test_cli_stop_of_an_ended_run_exits_1_and_writes_nothing(tmp_path, capsys, state):
    status(tmp_path, state=state)
    assert cli.main(["stop", str(tmp_path)]) == 1
    assert "already ended" in capsys.readouterr().err
    assert not (tmp_path / STOP_NAME).exists()


def test_cli_stop_without_a_run_exits_2(tmp_path, capsys):
    assert cli.main(["stop", str(tmp_path)]) == 2
    assert "no status.json" in capsys.readouterr().err
    assert not (tmp_path / STOP_NAME).exists()


def test_cli_stop_of_a_stale_run_asks_and_says_it_may_be_dead(tmp_path, capsys):
    status(tmp_path, updated_at=1.0)
    assert cli.main(["stop", str(tmp_path)]) == 0
    assert "may be dead" in capsys.readouterr().err
    assert (tmp_path / STOP_NAME).exists()


def test_claiming_the_storage_clears_an_earlier_runs_stop(tmp_path):
    status(tmp_path, state="stopped")                 # the run that was stopped ...
    request_stop(str(tmp_path), reason="left over")   # ... and its STOP, still there
    trainer = ElasticTrainer(lambda ctx: None, scaling=ScalingConfig(), total_steps=5,
                             checkpoint=CheckpointConfig(storage=str(tmp_path)))
    trainer.claim_storage()
    assert read_stop(Storage(str(tmp_path))) is None  # the resume does not stop at once
    written = json.loads((tmp_path / "status.json").read_text())
    assert written["state"] == "scheduling" and written["format"] == 1


def test_the_controllers_stop_request_is_a_plain_value_read_on_another_thread(tmp_path, monkeypatch):
    """R3-5: the controller asks for the STOP request at every running tick. A stalled STOP read
    (a GET stuck on S3) must not stall the tick: the read runs on a thread of its own and the
    tick gets the newest value at once. Before, the tick made the read itself every 2 s."""
    import threading

    import elastic.stop_request as stop_request
    from chaos.services import wait_until
    from elastic._controller.actor import CheckpointView
    released, reads = threading.Event(), []

    def stalled_read(storage):
        reads.append(threading.current_thread().name)
        assert released.wait(20), "never released"
        return {"format": STOP_FORMAT, "reason": "node drain"}
    monkeypatch.setattr(stop_request, "read_stop", stalled_read)
    view = CheckpointView(str(tmp_path), None, None)
    answered = []
    tick = threading.Thread(target=lambda: answered.append(view.stop_request()), name="controller-tick")
    try:
        tick.start()
        tick.join(5)
        assert not tick.is_alive() and answered == [None], "the tick waited on the stalled STOP read"
        wait_until(lambda: reads, 10, "the STOP read on the reader's thread", interval_s=0.01)
        assert reads[0] != "controller-tick"
        released.set()
        wait_until(lambda: view.stop_request() is not None, 10, "the request the reader found", interval_s=0.01)
        assert view.stop_request()["reason"] == "node drain"
    finally:
        released.set()
        tick.join(20)
        close = getattr(view, "close", None)
        if close is not None:
            close()
