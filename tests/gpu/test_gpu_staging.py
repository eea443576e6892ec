"""Async checkpoints of state that lives on the GPU: checkpointing.staging copies it to pinned
host memory at the step boundary (non-blocking copies, one synchronize), the upload commits the
copy while training overwrites the CUDA tensors, and a reload gives back the state as saved."""
import pytest
import torch

from checkpointing import CheckpointManager
from checkpointing.staging import stage_state_dict

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu)")]

CUDA = torch.device("cuda", 0)


def cuda_state(seed: int = 0) -> dict:
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return {
        "model": {"w": torch.randn(512, 256, device=CUDA, generator=g),
                  "b": torch.randn(256, device=CUDA, generator=g).to(torch.bfloat16),
                  "t": torch.randn(64, 32, device=CUDA, generator=g).t()},       # not contiguous
        "optim": {"state": {"w": {"exp_avg": torch.randn(512, 256, device=CUDA, generator=g),
                                  "step": torch.tensor(7.0, device=CUDA)}}},
        "extra": {"step": 7, "tag": "sha"},
    }


def tensors(state) -> dict:
    """Every tensor of a nested state under a dotted path, on the host (a copy)."""
    out = {}

    def walk(value, path):
        if isinstance(value, torch.Tensor):
            out[path] = value.detach().cpu().clone()
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}.{k}")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{path}.{i}")

    walk(state, "")
    return out


def overwrite(state) -> None:
    """What the next training steps do to the live state: change every tensor in place."""
    for t in tensors_live(state):
        t.add_(1)


def tensors_live(state) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in tensors_live(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in tensors_live(v)]
    return []


def assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


def test_cuda_state_is_staged_to_pinned_host_memory_and_later_changes_do_not_leak_in():
    state = cuda_state()
    state["extra"]["pair"] = (torch.arange(5, device=CUDA), "sha")      # sequences are walked too
    before = tensors(state)
    staged = stage_state_dict(state)
    for t in tensors_live(staged):
        assert t.device.type == "cpu" and t.is_pinned() and t.is_contiguous()
    assert staged["extra"]["step"] == 7 and staged["extra"]["pair"][1] == "sha"
    assert len(tensors_live(staged)) == len(before) == 6
    overwrite(state)                 # the copies were synchronized before stage_state_dict returned
    assert_equal(tensors(staged), before)

    # The next save reuses the pinned buffers (same structure) and holds the new values.
    again = stage_state_dict(state, staged)
    assert again["model"]["w"].data_ptr() == staged["model"]["w"].data_ptr()
    assert again["optim"]["state"]["w"]["exp_avg"].data_ptr() == staged["optim"]["state"]["w"]["exp_avg"].data_ptr()
    assert_equal(tensors(again), tensors(state))


def test_async_save_of_cuda_state_commits_while_training_overwrites_it_and_reloads_equal(tmp_path):
    url = str(tmp_path / "run")
    state = cuda_state()
    saved = tensors(state)
    with CheckpointManager(url, async_save=True) as manager:
        manager.save(7, state, generation=0)          # returns once staged; the upload runs behind
        overwrite(state)                              # training goes on during the upload
        info = manager.wait()
    assert info is not None and info.step == 7
    assert [c.step for c in CheckpointManager(url).committed()] == [7]

    target = cuda_state(seed=1)                      # other values, same structure, on the GPU
    target["extra"] = {"step": 0, "tag": ""}
    loaded = CheckpointManager(url).load_latest(target)
    assert loaded is not None and loaded.step == 7
    assert_equal(tensors(target), saved)
    assert all(t.device == CUDA for t in tensors_live(target))   # loaded in place, on the GPU
    assert target["extra"] == {"step": 7, "tag": "sha"}
