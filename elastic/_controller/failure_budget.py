"""The run's failure budget: every failure the controller met, and whether the run goes on.

The controller charges each failure here once; the `FailurePolicy` decides from it and from the
count of infrastructure failures before it (FailureConfig.max_failures). A run that ends on the
count says which causes spent it.
"""
from __future__ import annotations

from collections.abc import Callable

from elastic.errors import TooManyFailuresError
from elastic.policies import Failure, FailureDecision, FailurePolicy


class FailureBudget:
    """The failures so far, and the policy's word on each."""

    def __init__(self, policy: FailurePolicy, max_failures: Callable[[], int | None]):
        self.policy = policy
        self._max_failures = max_failures       # read when charged (a test may swap the config)
        self.failures: list[Failure] = []
        self.infra_failures = 0                 # counted against max_failures

    def charge(self, failure: Failure) -> FailureDecision:
        self.failures.append(failure)
        decision = self.policy.decide(failure, infra_failures_so_far=self.infra_failures,
                                      max_failures=self._max_failures())
        self.infra_failures += failure.is_infrastructure
        return decision

    def exhausted(self, decision: FailureDecision, failure: Failure) -> TooManyFailuresError:
        """The error a run fails with when `decision` (on `failure`) ends it on the count."""
        last = f"; last error: {failure.error_type}: {failure.error_message}" if failure.error_type else ""
        return TooManyFailuresError(f"{decision.reason}; causes so far: "
                                    f"{', '.join(f.cause for f in self.failures)}{last}")
