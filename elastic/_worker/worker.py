"""TrainWorker: the Ray actor hosting one rank.

The user's loop runs in a thread so the actor keeps answering the controller's polls (its
heartbeat) while training, and keeps its process and in-memory state across generations.
The worker never decides anything: it reports what happened and waits for the next plan.

torch and the training modules are imported inside the methods, in the worker's own process:
the controller imports this module only to launch the actor class, and stays free of torch.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import os
import re
import signal
import threading
import time
import traceback

from elastic._credentials import MaskingFormatter, mask_text, quiet_credential_notices
from elastic._protocol import GenerationPlan, RunSpec, WorkerInfo, WorkerPhase, WorkerReport
from elastic._worker.membership import GroupMembership
from elastic._worker.mesh import GenerationMesh

log = logging.getLogger("elastic.worker")

PREEMPTION_GRACE_S = 60   # a preempted worker leaves by then, even if the controller is gone
# How long start_generation waits for the previous generation's thread to return after it
# reported (its last lines: a log line, releasing its frames). Below the controller's wait for the
# call (heartbeat_timeout_s), so a thread that really is stuck still ends in a replaced worker.
PREVIOUS_THREAD_JOIN_S = 5.0
ORPHAN_CHECK_S = 5.0      # how often a worker that belongs to its run looks for the run's controller
ORPHAN_QUIET_S = 10.0     # ... once no poll has come for this long (a controller's restart takes seconds)
# A training thread still in its generation this long after its group was cut is stuck where no
# cut reaches: its stack goes to the log before the controller replaces the worker.
LEAVE_WATCH_S = 10.0

# Backends name themselves in the errors of a broken process group (gloo's come from its
# transport, e.g. "[.../gloo/transport/tcp/pair.cc:537] Read error ... Connection reset by peer").
_BACKEND_MARKERS = ("gloo", "nccl", "c10d", "processgroup")
# ... but not always: after a gloo collective timed out, the next one on that rank (a DDP comm
# hook, the next step) raises a bare RuntimeError("Application timeout caused pair closure"),
# and a gloo build without source paths in its messages says only "Timed out waiting 3000ms for
# recv operation to complete" or "Connection closed by peer [10.0.0.2]:41537".
_TRANSPORT_MESSAGES = re.compile(
    r"application timeout caused pair closure|timed out waiting \d+ ?ms for (recv|send) operation"
    r"|connection closed by peer \[", re.IGNORECASE)
# A GPU that failed in hardware (NVIDIA Xid 48/63/64/74/79/94/95 and friends) or a driver that
# lost it: the process's CUDA context is gone for good, so the worker is replaced. "CUDA out of
# memory", device-side asserts and illegal memory accesses are the loop's own (Xid 13/31 are
# "typically an application bug" in NVIDIA's Xid catalogue) and stay user errors.
_HARDWARE_MESSAGES = re.compile(
    r"uncorrectable ecc error|ecc error encountered|fallen off the bus|unspecified launch failure"
    r"|uncorrectable nvlink error|\bxid\b|gpu is lost|cuda error: unknown error"
    r"|cuda-capable device\(s\) is/are busy or unavailable|no cuda-capable device is detected"
    r"|driver shutting down|launch timed out and was terminated", re.IGNORECASE)
_CUDA_USER_MESSAGES = re.compile(
    r"out of memory|device-side assert|illegal memory access|illegal instruction|misaligned address"
    r"|\binvalid\b|not supported|not permitted|capturing|no kernel image", re.IGNORECASE)


def classify_error(error: BaseException) -> str:
    """What an exception out of the training thread means.

    "comm": the process group broke (a peer died, hung or was cut off): wait for the controller.
    "hardware": the GPU failed (ECC, fallen off the bus, Xid): the worker is replaced.
    "infra": storage trouble: the controller recovers, counted against max_failures.
    "fatal": the run cannot go on (fenced out, checkpoint failure limit reached): fail now.
    "sdc": the replicas' parameters disagreed (silent data corruption): the named ranks are
    replaced and the run rolls back to a state from before the step.
    "user": the user's code raised: fail fast, not retried.

    A checkpoint error is judged by what caused it: a save whose collective broke because a
    peer died (e.g. the final commit, the moment a rank is killed) is that peer's failure, and
    the run recovers and commits again; only a checkpoint error with no such cause is fatal.
    A hardware fault wins over the broken collective it causes (NCCL reports a failed GPU as
    its own error). A collective that breaks the same way at the same step again and again is
    the loop's bug, not a fault: the controller sees that (elastic._controller.recurrence), not this function.
    """
    from checkpointing import CheckpointError, FencedError, StorageError
    from elastic.errors import SilentCorruptionError
    if isinstance(error, FencedError):
        return "fatal"
    if isinstance(error, SilentCorruptionError):
        return "sdc"
    chain = _cause_chain(error)
    if any(_is_hardware_error(cause) for cause in chain):
        return "hardware"
    for cause in chain:
        if isinstance(cause, StorageError):
            return "infra"
        if _is_comm_error(cause):
            return "comm"
    if isinstance(error, CheckpointError):
        return "fatal"
    return "user"


def _cause_chain(error: BaseException) -> list[BaseException]:
    """The error and its explicit causes (`raise ... from`), outermost first."""
    chain: list[BaseException] = []
    link: BaseException | None = error
    while link is not None and link not in chain:
        chain.append(link)
        link = link.__cause__
    return chain


def _is_comm_error(error: BaseException) -> bool:
    import torch.distributed as dist
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    if not isinstance(error, RuntimeError):
        return False
    text = str(error)
    return any(m in text.lower() for m in _BACKEND_MARKERS) or _TRANSPORT_MESSAGES.search(text) is not None


def _is_hardware_error(error: BaseException) -> bool:
    """A GPU or driver fault: a known hardware message, or a CUDA runtime error
    (torch.AcceleratorError) that names no error of the loop's own making."""
    import torch
    if isinstance(error, getattr(torch, "OutOfMemoryError", ())):
        return False
    text = str(error)
    if _HARDWARE_MESSAGES.search(text):
        return isinstance(error, RuntimeError)
    accelerator_error = getattr(torch, "AcceleratorError", None)
    return accelerator_error is not None and isinstance(error, accelerator_error) \
        and not _CUDA_USER_MESSAGES.search(text)


def _set_torchrun_environment(plan: GenerationPlan) -> None:
    """The variables torchrun sets, for this generation's group: code and libraries that read
    them (Accelerate, Lightning, HF Trainer, a user's own `int(os.environ["LOCAL_RANK"])`) see
    the group the framework formed. Rewritten at every generation: ranks change with the group."""
    os.environ.update({
        "RANK": str(plan.rank), "WORLD_SIZE": str(plan.world_size),
        "LOCAL_RANK": str(plan.local_rank), "LOCAL_WORLD_SIZE": str(plan.local_world_size),
        "GROUP_RANK": str(plan.node_rank), "NODE_RANK": str(plan.node_rank),
        "MASTER_ADDR": plan.master_addr, "MASTER_PORT": str(plan.master_port)})


def _preload() -> None:
    """Import what the first step of a generation needs while the worker is still a spare, so a
    replacement joining a running group does not stall everyone on imports."""
    for module in ("torch.distributed.checkpoint.state_dict", "torch.nn.parallel",
                   "torch.distributed.fsdp",   # heavy; paid while the worker is still a spare
                   # DistributedDataParallel's constructor imports it on its first call in a
                   # process (0.5 s here, more on a loaded host): a spare joining a group made
                   # every rank wait that long in DDP's first collective of the re-form.
                   "torch._dynamo",
                   "torch.distributed.tensor", "checkpointing"):
        importlib.import_module(module)


def _timestamped_framework_logs() -> None:
    """Times on the framework's log lines in a worker process (Ray streams them to the driver
    without one; a fault's story is read across processes by them). Handlers of their own on the
    framework's loggers, not the root's: the user's code may configure the root logger itself
    (a basicConfig in the loop's module would otherwise do nothing). Left alone in a process
    whose root logger is configured already (a test runner's)."""
    from elastic.config import LOG_FORMAT
    if logging.getLogger().handlers:
        return
    for name in ("elastic", "checkpointing"):
        logger = logging.getLogger(name)
        if not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(MaskingFormatter(LOG_FORMAT))
            logger.addHandler(handler)
            logger.propagate = False


def _remove_own_placement_group() -> None:
    """An orphaned worker's last act: its placement group is detached and would hold its resources."""
    try:
        from ray.util.placement_group import get_current_placement_group, remove_placement_group
        group = get_current_placement_group()
        if group is not None:
            remove_placement_group(group)
    except Exception:   # the process ends either way
        log.debug("could not remove this worker's placement group", exc_info=True)


class TrainWorker:
    """One rank. Created through `ray.remote(...)` by the worker group."""

    def __init__(self, spec: RunSpec, controller: str | None = None):
        """`controller`: the name of the run's controller actor, for a worker that belongs to the
        run rather than to its controller's process (a detached actor, elastic._run_names). It ends its
        process, and removes its placement group, once that actor is gone for good (not while Ray
        restarts it), or no controller has polled it for _run_names.ORPHAN_AFTER_S: nothing else
        would end it once the controller and the driver are both gone."""
        import torch

        from elastic._worker.state import WorkerState
        from elastic.config import LOG_LEVEL_ENV
        _timestamped_framework_logs()
        quiet_credential_notices()
        # LoggingConfig's level, from the driver through the runtime env.
        logging.getLogger("elastic").setLevel(os.environ.get(LOG_LEVEL_ENV, "INFO"))
        self._spec = spec
        self._loop, self._loop_config = spec.load_user_code()
        self._lock = threading.Lock()
        self._phase = WorkerPhase.IDLE
        self._plan: GenerationPlan | None = None
        from elastic._run_names import RunNames
        self._state = WorkerState(run_names=RunNames.of_controller(controller))
        self._stop_requested = threading.Event()
        self._preempted = threading.Event()
        self._commit_requested = threading.Event()   # `elastic stop`: the group commits before it leaves
        self._thread: threading.Thread | None = None
        self._error: dict | None = None
        self._model_sha256: str | None = None
        self._membership = GroupMembership(use_gpu=spec.scaling.use_gpu)   # its group, generation after generation
        from elastic._worker.thread_position import ThreadPosition
        self._position = ThreadPosition(completed=lambda: self._state.progress.step, news=self._state.outbox.news)
        torch.set_num_threads(max(1, int(spec.scaling.cpus_per_worker)))
        if spec.scaling.use_gpu:
            torch.cuda.set_device(0)   # Ray exposes exactly the GPU it assigned as device 0
        self._device = torch.device("cuda", 0) if spec.scaling.use_gpu else torch.device("cpu")
        self._polled_at = time.monotonic()      # the last poll (or adoption) by a controller
        if controller is not None:
            threading.Thread(target=self._end_when_orphaned, args=(controller,), name="orphan-watch",
                             daemon=True).start()
        # Ray runs an actor's __init__ on the process's main thread, where handlers may be set.
        signal.signal(signal.SIGTERM, self._on_preemption_notice)
        _preload()
        # The storage's filesystem (for S3: s3fs imported, its filesystem made; no request yet) is
        # opened while the worker is still a spare: at its first join the whole group would wait
        # for it (0.17 s on this machine, more on a loaded node).
        try:
            self._state.checkpoints.open(spec)
        except Exception:   # the join opens it again and raises the typed error there
            log.debug("opening the checkpoint storage before the first join failed", exc_info=True)

    def _end_when_orphaned(self, controller: str) -> None:
        from elastic._run_names import ORPHAN_AFTER_S, controller_gone
        missing = 0
        while True:
            time.sleep(ORPHAN_CHECK_S)
            silent = time.monotonic() - self._polled_at
            # Looked up only once the polls have stopped (no GCS call per worker while they come).
            # Two looks in a row: a name is released only once its actor is dead for good.
            missing = missing + 1 if silent > ORPHAN_QUIET_S and controller_gone(controller) else 0
            if missing >= 2 or silent > ORPHAN_AFTER_S:
                why = "its controller is gone" if missing >= 2 else f"no controller polled it for {silent:.0f}s"
                log.error("this worker ends: %s (the run's driver ended, or its controller could not be restarted)",
                          why)
                _remove_own_placement_group()
                logging.shutdown()
                os._exit(1)

    def _announce(self) -> None:
        """Wake the controller's held poll: something it must hear at once has happened."""
        self._state.outbox.news.set()

    def _on_preemption_notice(self, signum, frame) -> None:
        """SIGTERM (spot reclaim, node drain): leave at the next step boundary; the group commits
        that step first unless the ranks that stay hold the whole state (see TrainContext.report).

        Outside a running generation there is nothing to save: the process ends at once. Inside
        one it ends after PREEMPTION_GRACE_S even if the controller never removes it."""
        if self._phase != WorkerPhase.RUNNING or self._preempted.is_set():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        log.warning("preemption notice: leaving at the next step (within %ds)", PREEMPTION_GRACE_S)
        self._preempted.set()
        self._announce()
        timer = threading.Timer(PREEMPTION_GRACE_S, os._exit, args=(0,))
        timer.daemon = True
        timer.start()

    # ---- controller-facing API ---------------------------------------------------------
    def preempt(self) -> None:
        """`elastic stop`: commit at the next step boundary and leave the loop, the path a
        preemption notice takes (without its deadline: the controller ends the run). Outside a
        running generation there is nothing to commit, and nothing to do."""
        if self._phase != WorkerPhase.RUNNING or self._preempted.is_set():
            return
        log.warning("stop requested: checkpoint at the next step, then leave")
        self._commit_requested.set()
        self._preempted.set()
        self._announce()

    def info(self) -> WorkerInfo:
        import ray
        context = ray.get_runtime_context()
        actor_id = context.get_actor_id()
        assert actor_id is not None, "info() is a method of the worker's actor"
        return WorkerInfo(pid=os.getpid(), node_id=context.get_node_id(), actor_id=actor_id,
                          ip=ray.util.get_node_ip_address())

    def rendezvous_address(self) -> tuple[str, int]:
        """Open the next generation's store on this worker (its rank 0) and say where it listens
        (elastic._worker.rendezvous). An earlier one that no generation used is dropped."""
        import ray
        return self._membership.host_store(ray.util.get_node_ip_address())

    def start_generation(self, plan: GenerationPlan) -> None:
        # The previous generation's thread has reported its outcome (the controller acts on that
        # report) but may not have returned yet: give it a moment before refusing. Joined outside
        # the lock, which the thread's last report takes.
        previous = self._thread
        if previous is not None and previous is not threading.current_thread():
            previous.join(PREVIOUS_THREAD_JOIN_S)
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                raise RuntimeError(f"worker asked to join generation {plan.generation} while still running "
                                   f"generation {self._plan.generation if self._plan else '?'} "
                                   f"(its thread did not end within {PREVIOUS_THREAD_JOIN_S:.0f}s)")
            self._plan = plan
            self._phase = WorkerPhase.RUNNING
            self._error = None
            self._stop_requested.clear()
            self._membership.new_plan()
            self._thread = threading.Thread(target=self._run_generation, args=(plan,),
                                            name=f"train-g{plan.generation}", daemon=True)
            self._thread.start()
        self._announce()

    def request_stop(self, generation: int, cut_group: bool = False) -> None:
        """Leave the loop at the next step boundary (every rank leaves at the same step).

        With `cut_group` (a member of the group is lost) also cut this rank's connections of
        the group now, from this thread: a training thread blocked in a collective with a peer
        that cannot close its own sockets (its node is gone or cut off) fails at once, instead
        of waiting out collective_timeout_s. A rank still joining the generation (waiting on its
        rendezvous for a member that never got its plan) leaves the join as fast."""
        with self._lock:
            if self._plan is None or self._plan.generation != generation:
                return
            self._stop_requested.set()
            # Marked under the lock that starts a plan: the cut is this generation's, never the next's.
            sockets = self._membership.mark_cut() if cut_group else None
            training = self._thread is not None and self._thread.is_alive()
        if cut_group and training:
            self._membership.cut(sockets)
            watch = threading.Timer(LEAVE_WATCH_S, self._log_if_still_in, args=(generation, self._thread))
            watch.daemon = True
            watch.start()

    def _log_if_still_in(self, generation: int, thread: threading.Thread | None) -> None:
        """The group of `generation` was cut LEAVE_WATCH_S ago: a training thread still in it is
        blocked where the cut did not reach (not in a collective of the group's connections).
        The controller replaces such a worker; its stack says where it was."""
        import sys
        with self._lock:
            still = (thread is not None and thread.is_alive() and self._plan is not None
                     and self._plan.generation == generation and self._phase == WorkerPhase.RUNNING)
            rank = self._plan.rank if self._plan is not None else None
        frame = sys._current_frames().get(thread.ident) if still and thread is not None and thread.ident else None
        if frame is not None:
            log.warning("rank %s's training thread is still in generation %d %.0fs after its group was cut, at:\n%s",
                        rank, generation, LEAVE_WATCH_S, "".join(traceback.format_stack(frame)).rstrip())

    def poll(self, hold_s: float = 0.0, acked: int | None = None, wake_s: float | None = None) -> WorkerReport:
        """What this worker is doing. With `hold_s` the answer waits until something the
        controller must hear at once happens (a phase change, an error, a preemption notice, a
        generation's first step) or `hold_s` passes: one answer per hold while training goes
        on, at once when it stops going on. `acked`: the number (WorkerReport.seq) of the newest
        answer the controller received; the records of later ones are sent again (state.Outbox).
        `wake_s`: the hang bound the controller judges by, if it has one: a held answer also
        comes when the training thread's wait for the others crosses it (thread_position)."""
        state = self._state
        self._polled_at = time.monotonic()
        if hold_s > 0:
            self._position.hold(hold_s, wake_s)   # or until its training thread has waited long
        state.outbox.news.clear()
        with self._lock:
            seq, records = state.outbox.answer(acked)
            return self._report(seq, records)

    def adopt(self, after_step: int) -> tuple[WorkerReport, float]:
        """A controller that replaced a lost one takes this worker over (elastic._controller.adoption):
        its report, with the records of every step after `after_step` (the steps the lost
        controller's journal does not hold), and how many seconds ago the last poll came (the lost
        controller's last, unless another adopter came first)."""
        state = self._state
        since = time.monotonic() - self._polled_at
        self._polled_at = time.monotonic()
        state.outbox.news.clear()
        with self._lock:
            records = state.outbox.replay(after_step)
            seq, pending = state.outbox.answer(None)
            return self._report(seq, records + pending), since

    def _report(self, seq: int, records: list) -> WorkerReport:
        """This worker's answer numbered `seq`, carrying `records` (under the lock)."""
        state = self._state
        progress, warm, session = state.progress, state.warm, state.checkpoints
        plan, error = self._plan, self._error or {}
        return WorkerReport(
            phase=self._phase, generation=plan.generation if plan else -1,
            rank=plan.rank if plan else None, step=progress.step,
            has_state=warm.available, shard=warm.shard, records=records,
            error_type=error.get("type"), error_message=error.get("message"),
            error_traceback=error.get("traceback"), error_kind=error.get("kind"),
            error=error.get("exception"), preempted=self._preempted.is_set(),
            restored_step=warm.restored[1] if plan and warm.restored and warm.restored[0] == plan.generation
            else None,
            checkpoint_fallbacks=list(session.load_fallbacks),
            model_sha256=self._model_sha256, resumed_from=session.resumed_from,
            samples_seen=progress.samples_seen, data_order=progress.data_order.hexdigest(),
            replicas=state.replicas.held(), position=self._position.report(), seq=seq)

    def shutdown(self) -> None:
        try:
            self._state.checkpoints.close()
        except Exception:   # shutting down; the controller already has the outcome
            log.exception("checkpoint manager close failed")

    # ---- the training thread -----------------------------------------------------------
    def _run_generation(self, plan: GenerationPlan) -> None:
        import torch

        from elastic._determinism import mix_seed
        from elastic.context import RescaleInterrupt, TrainContext
        ctx: TrainContext | None = None
        try:
            self._position.enter(plan.generation)   # this thread's place, for the hang judge
            _set_torchrun_environment(plan)
            mesh = GenerationMesh(rank=plan.rank, world_size=plan.world_size, scaling=self._spec.scaling,
                                  device=self._device)

            def formed() -> None:
                # The checkpoint side group, and under TP the mesh's groups, are formed with the main
                # group, before the capture: a lost peer then breaks their connections too (a TP
                # rank waiting in its data-parallel group on a survivor that left would otherwise
                # wait out the timeout), and none waits on the store for a group's creation.
                self._state.checkpoints.open(self._spec).bind_group()
                if mesh.meshed:
                    mesh.mesh()
            self._membership.join(plan, backend="nccl" if self._spec.scaling.use_gpu else "gloo", formed=formed)
            ctx = TrainContext(plan=plan, spec=self._spec, worker=self._state, loop_config=self._loop_config,
                               stop_requested=self._stop_requested, preempted=self._preempted,
                               commit_requested=self._commit_requested, device=self._device, mesh=mesh)
            # Identical initial weights on every rank and in every run with the same seed.
            torch.manual_seed(mix_seed(self._spec.seed, "init"))
            loop = self._loop
            if len(inspect.signature(loop).parameters) >= 2:
                loop(ctx, self._loop_config)
            else:
                loop(ctx)
            sha = ctx._finish()
            with self._lock:
                self._model_sha256 = sha
                self._phase = WorkerPhase.FINISHED
            self._announce()
        except RescaleInterrupt:
            try:
                self._state.checkpoints.settle(peers_alive=True)
            except BaseException as error:  # noqa: BLE001 - reported like any other
                self._record_error(error)
                return
            self._set_phase(WorkerPhase.INTERRUPTED)
        except BaseException as error:  # noqa: BLE001 - every outcome is reported, none raised here
            # The steps this rank completed keep their records (their exchange may be pending).
            nonfinite = ctx._abandon() if ctx is not None else None
            if classify_error(error) == "comm":
                self._state.checkpoints.settle(peers_alive=False)
                # Close this rank's connections now: a peer waiting on us (not on the dead rank)
                # gets "connection closed" at once instead of sitting out the collective timeout.
                self._membership.leave(abort=True)
            # A pending step's non-finite loss outranks the broken group: reported as the user's
            # error, it fails the run (a re-form would restore that step and could commit it).
            self._record_error(nonfinite if nonfinite is not None else error)

    def _set_phase(self, phase: WorkerPhase) -> None:
        with self._lock:
            self._phase = phase
        self._announce()

    def _record_error(self, error: BaseException) -> None:
        kind = classify_error(error)
        # The traceback goes to status.json and summary.json: a wrapped backend error in its
        # cause chain may name the storage URL with its password (only the message is masked).
        text = mask_text("".join(traceback.format_exception(error)))
        # The traceback's frames hold the generation's model, activations and group: drop them.
        error = error.with_traceback(None)
        try:
            import pickle
            pickle.loads(pickle.dumps(error))
            portable = error
        except Exception:   # noqa: BLE001 - an unpicklable user exception travels as text
            portable = None
        # Logged before the phase changes: once it has, the controller may start the next
        # generation, and this thread should be returning by then (see start_generation).
        log.warning("rank %s left generation %s: %s: %s", self._plan.rank if self._plan else "?",
                    self._plan.generation if self._plan else "?", type(error).__name__, mask_text(str(error)))
        with self._lock:
            self._error = {"type": type(error).__name__, "message": mask_text(str(error)),
                           "traceback": text,
                           "kind": kind, "exception": portable}
            self._phase = WorkerPhase.INTERRUPTED if kind == "comm" else WorkerPhase.FAILED
        self._announce()
