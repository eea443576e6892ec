"""The controller's process stays free of torch and of the user's code.

Every fit() starts a controller actor before any worker; importing torch there cost about 2.5 s
of CPU on the critical path of every start (and ~300 MB per controller). The user's loop and
config travel as bytes only workers load (RunSpec.user_code).
"""
import os
import threading

import pytest

import gpt
from elastic import CheckpointConfig, ConfigError, ElasticTrainer, ScalingConfig
from support import REPO_ROOT, fresh_python

# What the controller actor's process does: import its module, then unpickle its arguments.
CONTROLLER_PROCESS = """
import sys
from ray import cloudpickle
import elastic._controller.actor
args = cloudpickle.loads(sys.stdin.buffer.read())
heavy = sorted(m for m in ("torch", "pyarrow", "gpt") if m in sys.modules)
print(",".join(heavy) or "none")
loop, config = args[0].load_user_code()   # what a worker does: now the user's code comes in
print("torch" in sys.modules, config["model_size"])
"""


pytestmark = pytest.mark.multiprocess


def test_the_controller_process_imports_neither_torch_nor_the_users_code(tmp_path):
    from ray import cloudpickle
    trainer = ElasticTrainer(gpt.train_loop, train_loop_config={"model_size": "tiny"}, total_steps=5,
                             scaling=ScalingConfig(min_workers=1, max_workers=1),
                             checkpoint=CheckpointConfig(storage=str(tmp_path)))
    cloudpickle.register_pickle_by_value(gpt)    # as fit() ships a loop from a file workers cannot import
    try:
        args = cloudpickle.dumps((trainer._spec(), trainer.effective_config(), trainer.failure_policy,
                                  trainer.scaling_policy))
    finally:
        cloudpickle.unregister_pickle_by_value(gpt)
    out = fresh_python(CONTROLLER_PROCESS, stdin=args, cwd=str(tmp_path), timeout_s=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    lines = out.stdout.decode().split()
    assert lines[0] == "none", f"the controller's process imported {lines[0]}"
    assert lines[1:] == ["True", "tiny"]         # and the workers still get the loop and its config


def test_an_unpicklable_loop_config_is_a_config_error_naming_it(tmp_path):
    trainer = ElasticTrainer(gpt.train_loop, train_loop_config={"lock": threading.Lock()}, total_steps=5,
                             scaling=ScalingConfig(min_workers=1, max_workers=1),
                             checkpoint=CheckpointConfig(storage=str(tmp_path)))
    with pytest.raises(ConfigError, match="train_loop_config cannot be pickled"):
        trainer._spec()


def test_the_package_still_exports_what_it_imports_lazily():
    import elastic
    assert elastic.TrainContext.__module__ == "elastic.context"
    assert elastic.ParquetTokens.__module__ == "elastic.datasets"
    assert {"TrainContext", "ParquetTokens"} <= set(dir(elastic)) and set(elastic.__all__) <= set(dir(elastic))
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = elastic.Nope


def test_no_module_of_the_controller_folder_imports_torch():
    # The folder is the rule (elastic/_controller/): a module added there that pulls torch in
    # fails here, whatever imports it.
    folder = os.path.join(REPO_ROOT, "elastic", "_controller")
    modules = sorted(f"elastic._controller.{name[:-3]}" for name in os.listdir(folder)
                     if name.endswith(".py") and name != "__init__.py")
    assert "elastic._controller.controller" in modules and len(modules) >= 10
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "print(','.join(sorted(m for m in ('torch', 'pyarrow') if m in sys.modules)) or 'none')")
    out = fresh_python(code, timeout_s=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.decode().split() == ["none"]
