"""The run's metrics on Ray's own Prometheus endpoint (ray.util.metrics)."""
from __future__ import annotations

import urllib.request

import pytest

import gpt
from chaos.services import free_port
from elastic import CheckpointConfig, ElasticTrainer, ScalingConfig
from support import wait_for

pytestmark = [pytest.mark.integration]


@pytest.fixture
def ray_with_metrics_port():
    import ray
    ray.shutdown()                      # one Ray per driver: leave the shared local instance
    port = free_port()
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING",
             # 100 ms, not Ray's 10 s: the controller and the workers are killed when the run ends
             # (a few seconds here), and what a process recorded after its last push is never pushed.
             _metrics_export_port=port, _system_config={"metrics_report_interval_ms": 100})
    try:
        yield port
    finally:
        ray.shutdown()


def scrape(port: int) -> dict[str, float]:
    """`name -> value` of the elastic_ samples (histograms: their _count), tags dropped."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return {}                       # the metrics agent starts asynchronously
    samples = {}
    for line in text.splitlines():
        if line.startswith("ray_elastic_") and "_bucket{" not in line:
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            samples[name] = samples.get(name, 0.0) + value
    return samples


@pytest.mark.timeout(180)
def test_world_size_steps_and_checkpoints_reach_the_prometheus_endpoint(ray_with_metrics_port, run_dir):
    result = ElasticTrainer(
        gpt.train_loop, train_loop_config={"model_size": "tiny", "batch_size": 8}, total_steps=200, seed=0,
        scaling=ScalingConfig(min_workers=2, max_workers=2),
        checkpoint=CheckpointConfig(storage=run_dir, every_n_steps=20)).fit()
    assert result.ok
    seen: dict[str, float] = {}

    def exported() -> bool:
        seen.update(scrape(ray_with_metrics_port))
        # Ray pushes a process's metrics every report interval (0.1 s here) and has no flush: what
        # the controller and rank 0 recorded shortly before they were killed at the run's end may
        # never be pushed (CI saw the last 0.25 s lost on a loaded machine). So the run is long
        # and the values asserted were recorded well before its end: step 100 of 200, and the
        # commit of step 20, which rank 0 learns of at step 40.
        return (seen.get("ray_elastic_steps_total", 0) >= 100
                and seen.get("ray_elastic_checkpoint_seconds_count", 0) >= 1)

    # A bound, not a measurement: the metrics agent pushes late on a loaded machine.
    try:
        wait_for(exported, 90, "the run's metrics on the Prometheus endpoint")
    except TimeoutError as timeout:
        raise AssertionError(f"{timeout}; the endpoint showed {seen}") from timeout
    assert seen["ray_elastic_world_size"] == 2 and seen["ray_elastic_steps_per_second"] > 0
    assert seen["ray_elastic_checkpoint_bytes_total"] > 0
