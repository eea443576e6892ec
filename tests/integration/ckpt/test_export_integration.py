"""`elastic export` of a checkpoint sharded by 2 FSDP2 ranks, and from a real S3 endpoint (moto
server over HTTP: read through Storage, no download step; endpoint from AWS_ENDPOINT_URL or from
--option). The unit cases are in tests/unit/ckpt/test_export.py."""

from __future__ import annotations

import pytest
import torch

from checkpointing import export_model_state
from ckpt_ranks import run_ranks
from elastic.__main__ import main
from test_export import Net, loss_of, new_layout, save, trained

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_export_of_a_two_rank_checkpoint(tmp_path, strategy):
    url = str(tmp_path / "run")
    saved = run_ranks("save_then_mutate", 2, url=url, strategy=strategy, out=str(tmp_path / "full.pt"))
    assert all(r["committed"] for r in saved), saved
    reference = torch.load(tmp_path / "full.pt", weights_only=False)["model"]  # full_state_dict
    got = export_model_state(url)  # layout without state_kinds: the "model" entry
    assert list(got) == list(reference)  # FQNs of the unwrapped model: no "module." prefix
    for key, tensor in reference.items():
        assert type(got[key]) is torch.Tensor and torch.equal(got[key], tensor), key


def test_export_from_s3(s3_url, moto_endpoint, tmp_path, monkeypatch, capsys):
    model, opt = trained(5)
    save(s3_url, 4, new_layout(model, opt))
    assert list(export_model_state(s3_url)) == list(model.state_dict())  # AWS_* variables only

    monkeypatch.delenv("AWS_ENDPOINT_URL")
    out = tmp_path / "model.pt"
    assert main(["export", s3_url, "--out", str(out), "--option", f"endpoint_url={moto_endpoint}"]) == 0
    assert "step 4: reading model" in capsys.readouterr().err
    fresh = Net()
    fresh.load_state_dict(torch.load(out, weights_only=True))
    assert loss_of(fresh) == loss_of(model)

    missing = s3_url.replace("/runs/x", "/runs/none")
    assert main(["export", missing, "--out", str(tmp_path / "m.pt"),
                 "--option", f"endpoint_url={moto_endpoint}"]) == 2
    assert "no committed checkpoint under s3://" in capsys.readouterr().err
