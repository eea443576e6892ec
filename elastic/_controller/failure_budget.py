"""The run's failure budget: every failure the controller met, and whether the run goes on.

The controller charges each failure here once. Three rules can end the run on its failures
(each with its own error, naming the FailureConfig field that fired):
- the lifetime count, FailureConfig.max_failures (through the FailurePolicy, which users may
  replace): TooManyFailuresError. Unlimited by default: a run of weeks meets faults daily;
- the rate, more than failure_rate_limit infrastructure failures within failure_rate_window_s:
  FailureRateError;
- no progress, max_failures_without_progress failures in a row each charged before the run
  kept a step past where the one before had reached: NoProgressError. A crash loop (a rank that
  dies at the same step on every attempt, a node that fails every re-form) ends in minutes; a
  run that moves on between faults never meets this rule.
Progress is judged on kept steps, not committed checkpoints: warm recoveries keep going without
a commit, and a run that checkpoints hourly must not look stuck between faults.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

from elastic.config import FailureConfig
from elastic.errors import FailureRateError, NoProgressError, TooManyFailuresError
from elastic.policies import Failure, FailureDecision, FailurePolicy


class FailureBudget:
    """The failures so far, and the word of the policy and the rules on each."""

    def __init__(self, policy: FailurePolicy, config: FailureConfig, clock: Callable[[], float]):
        self.policy = policy
        self._config, self._clock = config, clock
        self.failures: list[Failure] = []
        self.infra_failures = 0                   # counted against max_failures
        self._recent: deque[float] = deque()      # clock times of infrastructure failures in the window
        self._reached = -1                        # newest step reached at any failure so far
        self.without_progress = 0                 # failures in a row with no step past the one before
        self._error: type[TooManyFailuresError] = TooManyFailuresError

    def charge(self, failure: Failure, reached_step: int | None = None) -> FailureDecision:
        """Charge `failure`; `reached_step` is the newest step any rank had reached when it came
        (None where no step applies, e.g. a storage error between generations)."""
        config = self._config
        self.failures.append(failure)
        decision = self.policy.decide(failure, infra_failures_so_far=self.infra_failures,
                                      max_failures=config.max_failures)
        self._error = TooManyFailuresError
        if not failure.is_infrastructure:
            return decision
        self.infra_failures += 1
        now = self._clock()
        self._recent.append(now)
        while self._recent and self._recent[0] < now - config.failure_rate_window_s:
            self._recent.popleft()
        if reached_step is not None:
            self.without_progress = 0 if reached_step > self._reached else self.without_progress + 1
            self._reached = max(self._reached, reached_step)
        if decision.action == "fail":
            return decision
        limit = config.failure_rate_limit
        if limit is not None and len(self._recent) > limit:
            self._error = FailureRateError
            return FailureDecision("fail", f"{len(self._recent)} infrastructure failures within "
                                           f"{config.failure_rate_window_s:.0f}s, more than "
                                           f"FailureConfig.failure_rate_limit={limit}")
        streak = config.max_failures_without_progress
        if streak is not None and self.without_progress >= streak:
            self._error = NoProgressError
            return FailureDecision("fail", f"{self.without_progress} failures in a row with no step kept past "
                                           f"step {self._reached} (FailureConfig.max_failures_without_progress="
                                           f"{streak}): the run is in a crash loop")
        return decision

    def exhausted(self, decision: FailureDecision, failure: Failure) -> TooManyFailuresError:
        """The error a run fails with when `decision` (on `failure`) ends it on the budget."""
        last = f"; last error: {failure.error_type}: {failure.error_message}" if failure.error_type else ""
        return self._error(f"{decision.reason}; causes so far: {', '.join(f.cause for f in self.failures)}{last}")
