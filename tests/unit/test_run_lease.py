"""One run per storage URL (reliability review F2), at fit()'s start: a second ElasticTrainer on
a live run's storage refuses with RunConflictError naming it; takeover=True takes it over, and
the run taken over is fenced at its next generation."""
import json

import pytest

from checkpointing import FencedError, RunConflictError
from elastic import CheckpointConfig, ElasticTrainer, ScalingConfig
from elastic._controller.actor import CheckpointView

pytestmark = pytest.mark.timeout(30)


def loop(ctx):
    pass


def trainer(storage, takeover=False):
    return ElasticTrainer(loop, scaling=ScalingConfig(min_workers=1, max_workers=1),
                          checkpoint=CheckpointConfig(storage=storage, takeover=takeover), total_steps=1)


def test_a_second_run_on_a_live_runs_storage_refuses_then_takeover_fences_the_first(tmp_path):
    first = trainer(str(tmp_path))
    first._check_storage()
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["run_id"] == first._run_id and status["state"] == "scheduling"
    CheckpointView(str(tmp_path), None, None, first._run_id).fence(1, start_step=0)

    with pytest.raises(RunConflictError, match=f"in use by run {first._run_id}"):
        trainer(str(tmp_path))._check_storage()

    second = trainer(str(tmp_path), takeover=True)
    second._check_storage()
    CheckpointView(str(tmp_path), None, None, second._run_id).fence(2, start_step=0)
    with pytest.raises(FencedError):               # the first run's next generation is refused
        CheckpointView(str(tmp_path), None, None, first._run_id).fence(3, start_step=0)


def test_a_finished_runs_storage_is_free(tmp_path):
    first = trainer(str(tmp_path))
    first._check_storage()
    (tmp_path / "status.json").write_text(json.dumps({"state": "finished", "run_id": first._run_id,
                                                      "updated_at": 0}))
    trainer(str(tmp_path))._check_storage()
