"""Weights out: `elastic export` and `checkpointing.export_model_state` / `export` (no Ray)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from checkpointing import CheckpointManager, CorruptCheckpointError, export, export_model_state
from checkpointing import manifest as mf
from ckpt_conformance import flip_byte
from elastic.__main__ import main

pytestmark = pytest.mark.timeout(60)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16))
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.body(x))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g)


def loss_of(model: nn.Module) -> float:
    x, y = batch()
    with torch.no_grad():
        return nn.functional.cross_entropy(model(x), y).item()


def trained(seed: int, steps: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    x, y = batch()
    for _ in range(steps):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def kinds(**entries: str) -> dict:
    return {"step": 1, "samples_seen": 32, "state_kinds": json.dumps(entries)}


def save(url: str, step: int, state: dict) -> CheckpointManager:
    mgr = CheckpointManager(url, async_save=False, keep=None)
    mgr.save(step, state, generation=0)
    mgr.close()
    return mgr


def new_layout(model: nn.Module, opt: torch.optim.Optimizer, **more_modules: nn.Module) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt),
             "scheduler": {"last_epoch": 3, "base_lrs": [0.05]}}
    state.update({name: get_model_state_dict(m) for name, m in more_modules.items()})
    state["extra"] = kinds(model="module", optimizer="optimizer", scheduler="stateful",
                           **{name: "module" for name in more_modules})
    return state


def same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


# Runs without `checkpointing` or `elastic` importable: the file must need plain torch only.
_PLAIN_TORCH = """
import sys
sys.modules["checkpointing"] = sys.modules["elastic"] = None
import torch
from torch import nn
sd = torch.load(sys.argv[1], weights_only=True)
assert all(type(t) is torch.Tensor for t in sd.values()), {k: type(t) for k, t in sd.items()}
torch.manual_seed(123)
body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16))
head = nn.Linear(16, 3)
model = nn.Module(); model.body = body; model.head = head
model.load_state_dict(sd)
g = torch.Generator().manual_seed(7)
x, y = torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g)
with torch.no_grad():
    print(repr(nn.functional.cross_entropy(head(body(x)), y).item()))
"""


@pytest.mark.multiprocess
def test_fsdp_model_exports_to_a_file_plain_torch_loads(one_rank_group, file_url, tmp_path, capsys):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = fully_shard(Net(), mesh=init_device_mesh("cpu", (1,)))  # DTensor parameters
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    x, y = batch()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    save(file_url, 1, new_layout(model, opt))
    want = loss_of(model)

    out = tmp_path / "out" / "model.pt"
    assert main(["export", file_url, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "exported step 1" in captured.out and "the state dict of 'model'" in captured.out
    assert "step 1: verifying 1 file(s)" in captured.err and "step 1: reading model (6 tensors, " in captured.err

    sd = torch.load(out, weights_only=True)
    assert all(type(t) is torch.Tensor and t.device.type == "cpu" for t in sd.values())
    fresh = Net()
    fresh.load_state_dict(sd)  # strict: exactly the model's keys, no optimizer state
    assert loss_of(fresh) == want

    proc = subprocess.run([sys.executable, "-c", _PLAIN_TORCH, str(out)], capture_output=True,
                          text=True, timeout=50, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout) == want


def test_two_modules_export_one_key_per_name(url, tmp_path):  # url: memory:// and a local path
    model, opt = trained(1)
    ema, _ = trained(2)
    save(url, 5, new_layout(model, opt, ema=ema))
    got = export_model_state(url)
    assert list(got) == ["model", "ema"]
    assert same(got["model"], model.state_dict()) and same(got["ema"], ema.state_dict())

    result = export(url, tmp_path / "both.pt")
    assert (result.step, result.modules, result.nested, result.skipped) == (5, ["model", "ema"], True, [])
    loaded = torch.load(tmp_path / "both.pt", weights_only=True)
    assert same(loaded["ema"], ema.state_dict())


def test_old_layout_exports_the_model_entry(memory_url):
    model, opt = trained(3)
    save(memory_url, 2, {"model": model.state_dict(), "optim": opt.state_dict(),
                         "extra": {"step": 2, "rng": b"\x00\x01"}})
    got = export_model_state(memory_url)
    assert same(got, model.state_dict())


def test_step_picks_a_committed_step_and_an_unknown_one_is_named(file_url, tmp_path, capsys):
    models = {}
    for step in (10, 20, 30):
        models[step], opt = trained(step)
        save(file_url, step, new_layout(models[step], opt))
    assert same(export_model_state(file_url), models[30].state_dict())

    assert main(["export", file_url, "--step", "20", "--out", str(tmp_path / "m.pt")]) == 0
    assert same(torch.load(tmp_path / "m.pt", weights_only=True), models[20].state_dict())
    capsys.readouterr()

    assert main(["export", file_url, "--step", "25", "--out", str(tmp_path / "x.pt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "step 25" in err and "committed steps: 10, 20, 30" in err
    assert not (tmp_path / "x.pt").exists()


def test_no_checkpoint_exits_2_with_one_line(tmp_path, capsys):
    assert main(["export", str(tmp_path / "empty"), "--out", str(tmp_path / "m.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no committed checkpoint under") and err.count("\n") == 1
    assert "Traceback" not in err and not (tmp_path / "m.pt").exists()
    assert main(["export", "nosuchscheme://x", "--out", str(tmp_path / "m.pt")]) == 2
    assert main(["export", str(tmp_path), "--option", "novalue", "--out", str(tmp_path / "m.pt")]) == 2


def test_a_tampered_shard_falls_back_or_is_refused(file_url, tmp_path, capsys):
    models = {}
    for step in (1, 2):
        models[step], opt = trained(step)
        mgr = save(file_url, step, new_layout(models[step], opt))
    flip_byte(mgr, 2)

    assert main(["export", file_url, "--out", str(tmp_path / "m.pt")]) == 0
    err = capsys.readouterr().err
    assert "warning: checkpoint step 2" in err and "sha256" in err and "falling back" in err
    assert same(torch.load(tmp_path / "m.pt", weights_only=True), models[1].state_dict())

    assert main(["export", file_url, "--step", "2", "--out", str(tmp_path / "bad.pt")]) == 1
    err = capsys.readouterr().err
    assert "refusing to export" in err and not (tmp_path / "bad.pt").exists()
    with pytest.raises(CorruptCheckpointError):
        export_model_state(file_url, step=2)


def test_tampered_metadata_is_never_unpickled(file_url):
    model, opt = trained(4)
    mgr = save(file_url, 1, new_layout(model, opt))
    flip_byte(mgr, 1, name_suffix=".metadata")
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata"):
        export_model_state(file_url)
    assert [c.step for c in mf.list_committed(mgr.storage)] == [1]
