"""The LR rule across rescales: pure functions of the step and the world-size history."""
import pytest

from elastic._worker.lr import ScaleRamp, schedule_factor
from elastic.config import ConfigError, LRScalingConfig

pytestmark = pytest.mark.timeout(30)


def test_warmup_then_cosine_to_the_floor():
    f = lambda s: schedule_factor(s, total_steps=110, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)  # noqa: E731
    assert [round(f(s), 3) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]
    assert f(10) == pytest.approx(1.0) and f(60) == pytest.approx(0.55) and f(110) == pytest.approx(0.1)
    assert schedule_factor(50, total_steps=100, warmup_steps=0, schedule="constant", min_lr_ratio=0.1) == 1.0


def test_a_drop_applies_at_once_and_a_rise_ramps():
    ramp = ScaleRamp.initial(world_size=4, base_world_size=4)
    down = ramp.rescaled(step=30, world_size=3, base_world_size=4, ramp_steps=10)
    assert down.scale(30, 10) == 0.75 and down.scale(31, 10) == 0.75
    up = down.rescaled(step=50, world_size=4, base_world_size=4, ramp_steps=10)
    assert [round(up.scale(s, 10), 3) for s in (50, 54, 59, 60)] == [0.775, 0.875, 1.0, 1.0]
    assert up.rescaled(step=70, world_size=4, base_world_size=4, ramp_steps=10) is up


def test_a_rescale_mid_ramp_starts_from_where_the_ramp_was():
    up = ScaleRamp.initial(2, 4).rescaled(step=10, world_size=4, base_world_size=4, ramp_steps=10)
    midway = up.scale(14, 10)
    again = up.rescaled(step=15, world_size=3, base_world_size=4, ramp_steps=10)
    assert again.start == pytest.approx(midway) and again.scale(15, 10) == 0.75


def test_ramp_state_round_trips():
    ramp = ScaleRamp(3, 0.75, 1.0, 30)
    assert ScaleRamp(**ramp.to_dict()) == ramp


@pytest.mark.parametrize("kwargs, field", [
    ({"base_world_size": 0}, "base_world_size"),
    ({"base_world_size": 2, "base_lr": 0.0}, "base_lr"),
    ({"base_world_size": 2, "base_lr": -1e-3}, "base_lr"),
    ({"base_world_size": 2, "mode": "sqrt"}, "mode"),
    ({"base_world_size": 2, "mode": "constant_global_batch", "rescale_warmup_steps": 5}, "rescale_warmup_steps"),
    ({"base_world_size": 2, "schedule": "step"}, "schedule"),
    ({"base_world_size": 2, "warmup_steps": -1}, "warmup_steps"),
])
def test_invalid_lr_configs(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        LRScalingConfig(**kwargs)


def test_warmup_longer_than_the_run_is_a_config_error(tmp_path):
    from elastic import CheckpointConfig, ElasticTrainer, ScalingConfig
    with pytest.raises(ConfigError, match="warmup_steps"):
        ElasticTrainer(lambda ctx: None, scaling=ScalingConfig(min_workers=1), total_steps=50,
                       checkpoint=CheckpointConfig(storage=str(tmp_path)),
                       lr=LRScalingConfig(base_world_size=2, warmup_steps=100))
