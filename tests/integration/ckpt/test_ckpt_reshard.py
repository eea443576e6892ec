"""Save at world size 2, load at 1 and 3: DDP (replicated tensors) and FSDP2 (DTensor shards)."""

from __future__ import annotations

import pytest
import torch

from ckpt_ranks import run_ranks

pytestmark = pytest.mark.integration


def _assert_equal(a, b, path="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.shape == b.shape and a.dtype == b.dtype, path
        assert torch.equal(a, b), f"tensor differs at {path}"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"keys differ at {path}: {set(a) ^ set(b)}"
        for k in a:
            _assert_equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_save_at_2_load_at_1_and_3(tmp_path, strategy):
    url = str(tmp_path / "run")
    saved = run_ranks("save_then_mutate", 2, url=url, strategy=strategy, out=str(tmp_path / "saved.pt"))
    assert all(r["committed"] for r in saved), saved
    assert saved[0]["files"] == saved[1]["files"]  # every rank reports the same manifest
    assert saved[0]["world_size"] == 2
    reference = torch.load(tmp_path / "saved.pt", weights_only=False)

    if strategy == "ddp":
        # Replicated tensors are written once, not once per rank.
        shard_bytes = sum(f["size"] for n, f in saved[0]["files"].items() if n.endswith(".distcp"))
        model_bytes = sum(t.numel() * t.element_size() for t in reference["model"].values())
        optim_bytes = sum(v.numel() * v.element_size() for st in reference["optim"]["state"].values()
                          for v in st.values() if isinstance(v, torch.Tensor))
        assert shard_bytes < 1.3 * (model_bytes + optim_bytes), (shard_bytes, model_bytes, optim_bytes)

    for world in (1, 3):
        out = tmp_path / f"loaded_{world}.pt"
        loaded = run_ranks("load_and_dump", world, url=url, strategy=strategy, out=str(out))
        for r in loaded:
            assert r["step"] == 7 and r["world_size"] == 2 and r["skipped"] == []
            assert r["extra"] == {"step": 7, "samples": [1, 2, 3]}
        _assert_equal(reference, torch.load(out, weights_only=False))


@pytest.mark.timeout(90)
def test_async_saves_while_training_on_default_group(tmp_path):
    url = str(tmp_path / "run")
    res = run_ranks("async_rounds", 2, url=url, steps=[1, 2, 3])
    for r in res:
        assert r["outcomes"] == [1, 2, 3]
        assert r["committed"] == [2, 3]  # keep=2


@pytest.mark.timeout(90)
def test_one_rank_storage_failure_and_split_verification(tmp_path):
    res = run_ranks("failure_then_fallback", 2, url=str(tmp_path / "run"))
    for r in res:  # every rank sees the same outcome: no hang, no commit of step 2
        assert r["outcomes"] == [1, None, 3]
        assert r["error"] == "StorageError"
        assert r["loaded"] == 1 and r["skipped"] == [3] and r["equal_to_step1"]
