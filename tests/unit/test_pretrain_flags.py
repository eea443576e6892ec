"""The main job's LR and batch flags become an LRScalingConfig, --gpu and the hardware flags a
ScalingConfig; bad values fail before any Ray."""
import pytest

import pretrain
from elastic._worker.fault_gate import HoldAt
from elastic.config import ConfigError

pytestmark = pytest.mark.timeout(30)


def args(*extra):
    return pretrain.parse_args(["--storage", "unused", "--workers", "2:4", *extra])


def test_default_leaves_the_lr_alone():
    assert pretrain.lr_config(args()) is None


def test_linear_defaults_to_max_workers_and_takes_every_flag():
    rule = pretrain.lr_config(args("--lr-mode", "linear", "--lr", "0.01", "--warmup-steps", "5",
                                   "--rescale-warmup-steps", "7", "--schedule", "constant"))
    assert (rule.mode, rule.base_world_size, rule.base_lr, rule.warmup_steps, rule.rescale_warmup_steps,
            rule.schedule) == ("linear", 4, 0.01, 5, 7, "constant")


def test_constant_batch_defaults_to_a_base_that_fits_every_world_size():
    rule = pretrain.lr_config(args("--lr-mode", "constant_global_batch"))
    assert rule.mode == "constant_global_batch" and rule.base_world_size == 12     # lcm(2, 3, 4)


def test_invalid_combinations_are_config_errors():
    with pytest.raises(ConfigError, match="rescale_warmup_steps"):
        pretrain.lr_config(args("--lr-mode", "constant_global_batch", "--rescale-warmup-steps", "3"))
    with pytest.raises(SystemExit):
        args("--lr", "0")
    with pytest.raises(SystemExit):
        args("--lr-mode", "sqrt")


def test_main_refuses_a_global_batch_that_does_not_divide(tmp_path, capsys):
    code = pretrain.main(["--storage", str(tmp_path), "--workers", "2:4", "--lr-mode", "constant_global_batch",
                          "--base-world-size", "6", "--quiet"])
    assert code == 2 and "[4]" in capsys.readouterr().err
    code = pretrain.main(["--storage", str(tmp_path), "--steps", "10", "--lr-mode", "linear", "--warmup-steps", "10"])
    assert code == 2 and "warmup_steps" in capsys.readouterr().err


def test_hold_at_names_a_step_and_a_file_for_the_frameworks_gate():
    assert args("--hold-at", "30:/tmp/gate").hold_at == HoldAt(30, "/tmp/gate")
    assert args().hold_at is None
    for bad in ("30", "0:/tmp/gate", "x:/tmp/gate", "30:"):
        with pytest.raises(SystemExit):
            args("--hold-at", bad)


def test_gpu_flag_sets_use_gpu_and_is_off_by_default():
    assert args().gpu is False and pretrain.scaling_config(args()).use_gpu is False
    scaling = pretrain.scaling_config(args("--gpu", "--precision", "fp16", "--strategy", "fsdp"))
    assert (scaling.use_gpu, scaling.precision, scaling.strategy) == (True, "fp16", "fsdp")
    assert (scaling.min_workers, scaling.max_workers) == (2, 4)
    assert pretrain.scaling_config(args("--gpu", "--precision", "bf16")).use_gpu


def test_fp16_without_gpu_says_to_add_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        args("--precision", "fp16")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--precision fp16 needs --gpu" in err and "bf16" in err
    assert pretrain.parse_args(["--storage", "unused", "--gpu", "--precision", "fp16"]).precision == "fp16"


def test_main_with_gpu_refuses_a_machine_without_enough_gpus(tmp_path, capsys, monkeypatch):
    import torch
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)     # fewer than MIN, on any machine
    code = pretrain.main(["--storage", str(tmp_path), "--workers", "2:2", "--gpu", "--model-size", "tiny", "--quiet"])
    assert code == 2 and "1 CUDA device(s)" in capsys.readouterr().err


def test_tp_sets_the_tensor_parallel_size_and_defaults_to_none():
    assert (args().tp, args().sequence_parallel) == (1, False)
    assert pretrain.scaling_config(args()).tensor_parallel_size == 1
    parsed = args("--tp", "2", "--sequence-parallel")
    assert pretrain.scaling_config(parsed).tensor_parallel_size == 2 and parsed.sequence_parallel
    for bad in ("0", "-1", "x"):
        with pytest.raises(SystemExit):
            args("--tp", bad)
    with pytest.raises(ConfigError, match="max_workers=3 is not a multiple of tensor_parallel_size=2"):
        pretrain.scaling_config(pretrain.parse_args(["--storage", "unused", "--workers", "2:3", "--tp", "2"]))


def test_sequence_parallel_without_tp_says_to_add_it(capsys):
    with pytest.raises(SystemExit) as exit_info:
        args("--sequence-parallel")
    assert exit_info.value.code == 2 and "add --tp T" in capsys.readouterr().err


def test_lr_rule_counts_replicas_under_tp():
    # --workers 2:4 ranks in replicas of 2: data-parallel degrees 1 and 2.
    assert pretrain.lr_config(args("--tp", "2", "--lr-mode", "linear")).base_world_size == 2
    assert pretrain.lr_config(args("--tp", "2", "--lr-mode", "constant_global_batch")).base_world_size == 2


def _no_trainer(*_args, **_kwargs):
    raise AssertionError("an ElasticTrainer was built: the model check came too late")


def test_main_refuses_heads_that_tp_does_not_divide_before_anything_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pretrain, "ElasticTrainer", _no_trainer)
    monkeypatch.setattr(pretrain, "prepare_corpus", _no_trainer)
    # tiny has 2 heads: 4 ranks of one replica cannot split them.
    code = pretrain.main(["--storage", str(tmp_path), "--workers", "4:4", "--tp", "4", "--model-size", "tiny",
                          "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "n_heads=2 is not divisible by tensor_parallel_size=4" in err and "[1, 2]" in err
    assert list(tmp_path.iterdir()) == []       # no corpus written, no storage claimed


def test_main_hands_tp_and_sequence_parallel_to_the_trainer(tmp_path, monkeypatch):
    seen = {}

    def trainer(train_loop, **kwargs):
        seen.update(kwargs)
        raise ConfigError("stop before any worker")     # main's ConfigError path: exit 2

    monkeypatch.setattr(pretrain, "ElasticTrainer", trainer)
    code = pretrain.main(["--storage", str(tmp_path), "--workers", "2:4", "--tp", "2", "--sequence-parallel",
                          "--model-size", "tiny", "--quiet"])
    assert code == 2
    assert seen["scaling"].tensor_parallel_size == 2 and seen["train_loop_config"]["sequence_parallel"] is True


def test_hsdp_flags_set_the_strategy_and_the_shard_size():
    scaling = pretrain.scaling_config(args("--strategy", "hsdp", "--hsdp-shard-size", "2"))
    assert (scaling.strategy, scaling.hsdp_shard_size, scaling.unit_size) == ("hsdp", 2, 2)
    assert pretrain.scaling_config(args()).hsdp_shard_size is None
    with pytest.raises(ConfigError, match="hsdp_shard_size"):
        pretrain.scaling_config(args("--strategy", "hsdp"))
