"""The driver's part of a run once its controller actor exists: wait for the run's outcome,
show progress, feed the callbacks, turn a SIGTERM into the run's STOP request, and return the
Result. A controller lost for good is a failed Result, which the driver records on storage
(elastic._driver_record); the run's workers and journal that it left are reaped.

Split from ElasticTrainer, which validates, claims the storage and starts (or finds) the
controller: one role each.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from elastic.callbacks import CallbackRunner
from elastic.errors import UserCodeError
from elastic.result import Result, RunMetrics, newest_checkpoint

log = logging.getLogger("elastic.trainer")


class RunFollower:
    """Follows the run `run_id` on `storage` to its end (see the module)."""

    def __init__(self, *, storage: str, storage_options: dict[str, Any] | None, run_id: str | None,
                 config: dict[str, Any], total_steps: int, progress: Callable[[dict[str, Any]], None] | None,
                 callbacks: tuple[Any, ...]):
        self._storage, self._options, self._run_id = storage, storage_options, run_id
        self._config, self._total_steps = config, total_steps
        self._progress, self._callbacks = progress, callbacks

    def follow(self, ray: Any, actor: Any, started: float) -> Result:
        """Wait for the run of the controller `actor` to end (starting it, if it is not going yet),
        showing progress and feeding the callbacks; the Result. A SIGTERM meanwhile (`ray job
        stop`) asks the run to stop as `elastic stop` does, and the wait goes on to its end."""
        done = actor.wait.remote()
        runner = CallbackRunner(self._callbacks) if self._callbacks else None

        def events(after: int) -> list:
            return ray.get(actor.events.remote(after), timeout=30)

        restore = self._stop_on_sigterm()
        try:
            outcome = self._wait(ray, actor, done, runner, events)
        except Exception as error:   # noqa: BLE001 - the controller is gone: a failed run, not an exception
            outcome = self._lost_controller(error, started)
        finally:
            restore()
            self._close_progress()
            try:
                ray.kill(actor, no_restart=True)
            except Exception:   # a dead actor, or a Ray going down
                log.debug("could not kill the controller actor", exc_info=True)
            self._reap()
        result = Result(status=outcome["status"], final_step=outcome["final_step"], storage=self._storage,
                        summary=outcome["summary"], error=outcome["error"], error_traceback=outcome["traceback"],
                        metrics=RunMetrics(**outcome["metrics"]),
                        checkpoint=newest_checkpoint(self._storage, outcome["summary"].get("checkpoints")))
        if runner is not None:
            runner.end(result)
        return result

    def _stop_on_sigterm(self) -> Callable[[], None]:
        """While fit() waits (in the main thread), SIGTERM writes the run's STOP request (`ray job
        stop` sends it first): the run commits and ends "stopped", whether the driver is still
        there then or not. Returns what puts the previous handler back."""
        import signal
        import threading
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        run_id = self._run_id

        def stop(signum: int, frame: Any) -> None:
            from elastic.stop_request import request_stop
            log.warning("SIGTERM: asking the run to stop (it commits at its next step and ends \"stopped\")")
            try:
                request_stop(self._storage, self._options,
                             reason="SIGTERM to the driver", run_id=run_id)
            except Exception:   # the run goes on; `elastic stop` can still end it
                log.exception("could not write the STOP request")
        previous = signal.signal(signal.SIGTERM, stop)

        def restore() -> None:
            signal.signal(signal.SIGTERM, previous)
        return restore

    def _reap(self) -> None:
        """The run's workers and placement groups that its controller left (one lost for good:
        a finished run's controller removed its own), and its journal."""
        from elastic._controller.journal import Journal, RayJournal
        from elastic._run_names import reap
        if self._run_id is None:
            return
        try:
            killed = reap(self._run_id)
            if killed:
                log.warning("killed %d workers the run's lost controller left", killed)
            Journal(RayJournal(self._run_id)).close()
        except Exception:   # a Ray going down takes them with it
            log.debug("could not reap the run's workers", exc_info=True)

    def _close_progress(self) -> None:
        """The display's `close()`, when it has one (elastic.progress.ProgressDisplay: the bar
        goes before fit() returns and its caller prints)."""
        close = getattr(self._progress, "close", None)
        if callable(close):
            try:
                close()
            except Exception:   # the Result matters more than the display
                log.debug("closing the progress display failed", exc_info=True)

    def _lost_controller(self, error: BaseException, started_at: float) -> dict[str, Any]:
        """The outcome of a run whose controller's `run()` did not return (its actor died, or it
        raised, or its outcome could not be fetched): recorded as failed on storage by the driver,
        unless the controller's own record is complete (see elastic._driver_record)."""
        from elastic._driver_record import lost_controller_error, record_lost_controller
        lost = lost_controller_error(error)
        log.error("%s", lost)
        summary, own = record_lost_controller(self._storage, self._options,
                                              error=lost, traceback=str(error), config=self._config,
                                              total_steps=self._total_steps, started_at=started_at)
        status = summary.get("status", "failed") if own else "failed"
        recorded = summary.get("error") if own else None
        typed: BaseException | None = lost
        if status == "finished":
            typed, trace = None, None
        elif isinstance(recorded, dict) and recorded.get("type"):
            # The run's own error, whose exception could not reach the driver (as for a user
            # exception that does not pickle).
            typed, trace = UserCodeError(f"{recorded['type']}: {recorded.get('message')}"), recorded.get("traceback")
        else:
            trace = str(error)
        return {"status": status, "final_step": summary.get("final_step", 0), "summary": summary,
                "metrics": {"last": {}, "history": {}}, "error": typed, "traceback": trace}

    def _wait(self, ray: Any, actor: Any, done: Any, runner: CallbackRunner | None,
              events: Callable[[int], list]) -> dict[str, Any]:
        """Wait for the controller's outcome, showing progress and feeding the callbacks."""
        while not ray.wait([done], timeout=1.0)[0]:
            if self._progress is not None:
                try:
                    self._progress(ray.get(actor.snapshot.remote(), timeout=5))
                except Exception:   # progress display is best effort
                    log.debug("progress snapshot failed", exc_info=True)
            if runner is not None:
                try:
                    runner.poll(events)
                except Exception:   # asked again next time: nothing is lost
                    log.debug("fetching the callbacks' events failed", exc_info=True)
        outcome = ray.get(done)
        if runner is not None:
            try:
                runner.drain(events)
            except Exception:   # the run's outcome matters more
                log.warning("the callbacks missed the run's last events (after event %d)", runner.delivered,
                            exc_info=True)
        return outcome
