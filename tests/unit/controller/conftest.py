"""Fixtures of the controller's unit tests."""
from __future__ import annotations

import pytest
from fake_ray import FakeRay

import elastic._controller.placement as placement
import elastic._controller.ray_calls as ray_calls
import elastic._controller.worker_group as ray_group


@pytest.fixture
def fake_ray(monkeypatch):
    fake = FakeRay()
    monkeypatch.setattr(ray_group, "ray", fake)
    monkeypatch.setattr(placement, "ray", fake)          # the placements' starts and the resources they name
    monkeypatch.setattr(ray_calls, "ray", fake)          # the group's non-blocking ray.wait
    monkeypatch.setattr(ray_group, "remove_placement_group", lambda pg: None)
    return fake
