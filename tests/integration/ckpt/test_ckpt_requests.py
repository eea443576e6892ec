"""Requests per save that do not grow with the world size (issue 15): no empty object whatever the
world size, and the newest-commit hint a poller reads instead of listing (on a real S3 endpoint)."""

from __future__ import annotations

import pytest

from checkpointing import CheckpointManager
from checkpointing.storage import Storage
from ckpt_ranks import run_ranks

pytestmark = pytest.mark.integration


def objects(url: str) -> dict[str, int]:
    """Every object under `url`: key (relative) -> size."""
    storage = Storage(url, None)
    root = storage.path()
    storage.fs.invalidate_cache()
    found = storage.fs.find(root, withdirs=False, detail=True)
    return {path[len(root) + 1:]: int(info["size"]) for path, info in found.items()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("program", ["save_then_mutate", "save_replicated"])
def test_a_ddp_save_at_4_ranks_writes_no_empty_object_and_points_the_hint_at_it(s3_url, tmp_path, program):
    kwargs = {"strategy": "ddp", "out": str(tmp_path / "saved.pt")} if program == "save_then_mutate" else {}
    saved = run_ranks(program, 4, url=s3_url, **kwargs)
    assert all(r["committed"] for r in saved), saved
    step = 7 if program == "save_then_mutate" else 3
    found = objects(s3_url)
    shards = {k: size for k, size in found.items() if k.startswith("checkpoints/step_")}
    assert shards and all(size > 0 for size in shards.values()), shards
    # Every object of the step is in the manifest (none written beside it), COMMITTED aside.
    listed = {f"checkpoints/step_{step:08d}/{name}" for name in saved[0]["files"]}
    assert set(shards) - listed == {f"checkpoints/step_{step:08d}/COMMITTED"}
    if program == "save_replicated":
        assert sum(k.endswith(".distcp") for k in shards) < 4      # fewer items than ranks: fewer files
    assert CheckpointManager(s3_url).latest_hint() == step
    if program == "save_then_mutate":
        loaded = run_ranks("load_and_dump", 4, url=s3_url, strategy="ddp", out=str(tmp_path / "loaded.pt"))
        assert all(r["step"] == step and r["skipped"] == [] for r in loaded), loaded
