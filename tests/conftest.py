"""Shared test setup: make examples/ importable (the main job's model and loop); under
pytest-xdist, the longest modules first."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))


def _timeout_s(item: pytest.Item) -> float:
    """The test's own `timeout` marker (its function's, class's or module's), 0 without one."""
    marker = item.get_closest_marker("timeout")
    if marker is None:
        return 0.0
    value = marker.args[0] if marker.args else marker.kwargs.get("timeout", 0)
    return float(value or 0)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a pytest-xdist worker (`make test`'s first pass), the modules run longest first, ranked
    by their largest `timeout` marker (each is sized to its test's run), each module's tests
    together and in their order. The worksteal scheduler hands each process a contiguous half
    of the list and lets an idle one take the end of the other's queue: with the long
    integration and chaos modules up front, the pass ends on short unit tests, not on one
    process running a long test while the other has nothing left (simulated on this suite's
    measured durations: the pass ends a median 20 s, and up to a minute, sooner). The same
    order in every worker (xdist requires it); a run without xdist keeps the collection order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    ranked = sorted(modules.values(), key=lambda tests: -max(_timeout_s(t) for t in tests))
    items[:] = [item for tests in ranked for item in tests]
