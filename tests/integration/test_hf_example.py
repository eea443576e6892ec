"""examples/hf_llama.py end to end: an unmodified transformers Llama under FSDP2 in bf16, a SIGKILL
mid-run, then `elastic export --format hf` and `LlamaForCausalLM.from_pretrained` on what it wrote:
the run's final weights bit for bit, scoring the validation set as the run logged it."""
from __future__ import annotations

import json
import os
import signal

import pytest

import hf_llama
from elastic.__main__ import main as elastic_cli
from support import SignalAtStep

pytestmark = [pytest.mark.integration]

STEPS, VAL_EVERY, KILL_AT = 40, 20, 15


@pytest.mark.timeout(300)
def test_hf_llama_survives_a_kill_and_exports_what_from_pretrained_loads(ray_session, run_dir, tmp_path, capsys):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from elastic._determinism import state_sha256

    fault = SignalAtStep(run_dir, at_step=KILL_AT, sig=signal.SIGKILL, rank=1)
    args = hf_llama.parse_args([
        "--storage", run_dir, "--workers", "2:2", "--steps", str(STEPS), "--val-every", str(VAL_EVERY),
        "--checkpoint-every", "20", "--hold-at", f"{KILL_AT}:{fault.gate}"])
    hf_llama.write_model_config(args)
    fault.start()
    result = hf_llama.build_trainer(args).fit()
    fault.join(timeout=5)
    assert fault.fired(), f"the fault never fired (run ended at step {result.final_step})"
    assert result.ok and result.final_step == STEPS, result.error_traceback
    (recovery,) = result.summary["recoveries"]
    # FSDP's copies in host memory (every 10 steps by default): back to step 10, no storage read.
    assert recovery["cause"] == "worker_died" and recovery["rung"] == "memory" and recovery["step"] == 10, recovery
    lines = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [line for line in lines if "kind" not in line]
    assert [line["step"] for line in steps] == list(range(1, STEPS + 1))
    assert steps[-1]["loss"] < steps[0]["loss"] - 1.0, (steps[0], steps[-1])     # it learned the chain
    assert [line["lr"] for line in steps] == pytest.approx(
        [hf_llama.BASE_LR * hf_llama.lr_factor(k - 1, STEPS) for k in range(1, STEPS + 1)])

    out = tmp_path / "llama-hf"
    assert elastic_cli(["export", run_dir, "--format", "hf", "--out", str(out)]) == 0
    assert "from_pretrained reads it" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    # The run's final weights, bit for bit.
    assert state_sha256(load_file(str(out / "model.safetensors"))) == result.summary["model_sha256"]
    model = LlamaForCausalLM.from_pretrained(str(out))
    val_loss = hf_llama.evaluate(model, hf_llama.validation_set(model.config.vocab_size))
    # The run validated with bf16 compute (FSDP2's mixed precision), plain transformers in fp32.
    assert val_loss == pytest.approx(result.metrics.last["val_loss"], rel=2e-2)


def test_export_hf_says_what_is_missing(tmp_path, capsys):
    assert elastic_cli(["export", str(tmp_path / "nothing"), "--format", "hf", "--out", str(tmp_path / "o")]) == 2
    assert "config.json" in capsys.readouterr().err
    assert elastic_cli(["export", str(tmp_path), "--module", "model", "--out", str(tmp_path / "o.pt")]) == 2
    assert "--format hf" in capsys.readouterr().err
