"""The fault gate (elastic/_worker/fault_gate.py) without Ray: inactive unless the loop config
sets it, holds after its step until the release file exists (in `ctx.report()`, with the user's
loop unaware of it), and a release that never comes is a typed error naming the file."""
from __future__ import annotations

import os
import pickle
import threading

import pytest
import torch

from chaos.services import wait_until
from elastic._worker.fault_gate import HOLD_AT_KEY, HoldAt, HoldTimeoutError, hold_after
from elastic.errors import ConfigError, ElasticError

pytestmark = pytest.mark.timeout(60)


def test_without_the_entry_nothing_waits(tmp_path):
    missing = str(tmp_path / "never")
    for config in (None, {}, {"hold_at": [3, missing]}, {HOLD_AT_KEY: None}, [3, missing], "3:" + missing):
        hold_after(3, config)          # returns at once: a wait would time out after 300 s


def test_only_its_step_holds(tmp_path):
    config = HoldAt(3, str(tmp_path / "never")).as_config()
    for step in (1, 2, 4, 100):
        hold_after(step, config)


def test_holds_until_the_release_file_exists(tmp_path):
    gate = tmp_path / "released"
    waiting = threading.Event()
    returned_after_release: list[bool] = []

    def held() -> None:
        waiting.set()
        hold_after(5, {"batch_size": 8, **HoldAt(5, str(gate)).as_config()})
        returned_after_release.append(gate.exists())

    thread = threading.Thread(target=held, daemon=True)
    thread.start()
    assert waiting.wait(10)
    assert thread.is_alive() and not returned_after_release
    gate.touch()
    thread.join(timeout=10)
    assert returned_after_release == [True]


def test_the_held_step_alone_is_settled_and_before_the_wait(tmp_path):
    gate = tmp_path / "released"
    settled: list[int] = []

    def settle(step: int) -> None:      # hands the step's record over; here it also releases the hold
        settled.append(step)
        gate.touch()
    config = HoldAt(3, str(gate), limit_s=10).as_config()
    for step in (1, 2, 3, 4):
        hold_after(step, config, settle=lambda step=step: settle(step))
    assert settled == [3]       # a settle after the wait would have timed out: nothing else creates the file
    hold_after(3, None, settle=lambda: settle(0))
    assert settled == [3]


def test_a_release_that_never_comes_is_a_typed_error_naming_the_file(tmp_path):
    gate = str(tmp_path / "never")
    with pytest.raises(HoldTimeoutError, match="never was not created within 0 s") as raised:
        hold_after(2, HoldAt(2, gate, limit_s=0.05).as_config())
    assert isinstance(raised.value, ElasticError) and isinstance(raised.value, TimeoutError)
    assert gate in str(raised.value) and "after step 2" in str(raised.value) and HOLD_AT_KEY in str(raised.value)
    # It crosses from the worker to the controller like every error of the runtime.
    assert str(pickle.loads(pickle.dumps(raised.value))) == str(raised.value)


def test_the_default_limit_is_the_examples_300_s():
    assert HoldAt(1, "/tmp/gate").limit_s == 300.0


def test_parse_takes_step_colon_file_and_refuses_the_rest():
    assert HoldAt.parse("30:/tmp/gate") == HoldAt(30, "/tmp/gate")
    assert HoldAt.parse("7:/tmp/a:b") == HoldAt(7, "/tmp/a:b")     # the first colon splits
    for bad in ("30", "0:/tmp/gate", "x:/tmp/gate", "30:", "-1:/tmp/gate", ""):
        with pytest.raises(ConfigError, match="--hold-at must be STEP:FILE"):
            HoldAt.parse(bad)
    with pytest.raises(ConfigError, match="HoldAt.step"):
        HoldAt(0, "/tmp/gate")
    with pytest.raises(ConfigError, match="HoldAt.release_file"):
        HoldAt(1, "")
    with pytest.raises(ConfigError, match="HoldAt.limit_s"):
        HoldAt(1, "/tmp/gate", limit_s=0)


def test_a_hold_travels_in_the_loop_config_to_the_workers():
    hold = HoldAt(4, "/tmp/gate")
    assert pickle.loads(pickle.dumps(hold.as_config())) == {HOLD_AT_KEY: hold}


def test_another_value_under_the_key_is_a_config_error():
    with pytest.raises(ConfigError, match=HOLD_AT_KEY):
        hold_after(3, {HOLD_AT_KEY: [3, "/tmp/gate"]})


def test_report_holds_after_the_step_and_the_loop_knows_nothing_of_it(generations, tmp_path):
    from elastic._protocol import GenerationPlan, RestorePlan
    from elastic.context import TrainContext
    run = generations(total_steps=3)
    gate = tmp_path / "released"
    plan = GenerationPlan(generation=1, rank=0, world_size=1, master_addr="127.0.0.1", master_port=0,
                          restore=RestorePlan("fresh"), timeout_s=60.0)
    ctx = TrainContext(plan=plan, spec=run.spec, worker=run.worker, loop_config=HoldAt(2, str(gate)).as_config(),
                       stop_requested=threading.Event(), preempted=threading.Event(), device=torch.device("cpu"))
    seen: list[tuple[int, bool]] = []

    def user_loop() -> None:          # a plain loop: no hold of its own
        model = ctx.prepare_model(torch.nn.Linear(1, 1))
        optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        ctx.restore()
        for _ in range(3):
            model(torch.ones(1, 1)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            ctx.report()
            seen.append((ctx.step, gate.exists()))

    thread = threading.Thread(target=user_loop, daemon=True)
    thread.start()
    wait_until(lambda: run.worker.progress.step >= 2, 30, "the loop to count step 2")
    assert seen == [(1, False)] and thread.is_alive()        # held inside report() of step 2
    gate.touch()
    thread.join(timeout=30)
    assert seen == [(1, False), (2, True), (3, True)]
    assert os.path.exists(gate)
