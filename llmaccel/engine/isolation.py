"""Which request makes a failed step fail.

A step computes many requests at once, so its exception names none of them. After a failed
step the engine recomputes its requests and admits them one at a time: each is on probation
until a step that included it samples a token. A step that fails with a request on probation
in it fails that request alone (the others in that step have each passed a step already); a
step of one request fails that request at once. Requests that arrive meanwhile wait until
every suspect has been tried, so they are never blamed for one another's failure.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable


class FailureIsolation:
    def __init__(self) -> None:
        self.suspects: deque[str] = deque()   # in the failed step, not yet tried alone
        self.probation: str | None = None     # admitted, not yet through a step
        self.held: set[str] = set()           # the scheduler admits none of these

    @property
    def active(self) -> bool:
        return self.probation is not None or bool(self.suspects)

    def on_add(self, request_id: str) -> None:
        if self.active:
            self.held.add(request_id)

    def next_probation(self, alive: Callable[[str], bool]) -> None:
        """Before a step: release the next suspect still alive, or, with none left, everyone
        held."""
        if self.probation is not None and not alive(self.probation):
            self.probation = None
        while self.probation is None and self.suspects:
            request_id = self.suspects.popleft()
            self.held.discard(request_id)
            if alive(request_id):
                self.probation = request_id
        if not self.active:
            self.held.clear()

    def passed(self, sampled: Iterable[str]) -> None:
        """After a step that completed: `sampled` are the requests it sampled tokens for."""
        if self.probation is not None and self.probation in set(sampled):
            self.probation = None

    def on_failure(self, in_step: list[str]) -> str | None:
        """A step of the requests `in_step` failed. Returns the request to fail (the one on
        probation, or the only one in the step) or None; the others become suspects."""
        in_step = list(dict.fromkeys(in_step))
        if self.probation is not None and self.probation in in_step:
            culprit: str | None = self.probation
        elif len(in_step) == 1:
            culprit = in_step[0]
        else:
            culprit = None
        if self.probation is not None and self.probation != culprit:
            self.suspects.appendleft(self.probation)  # not in this step: still untried
            self.held.add(self.probation)
        self.probation = None
        new = [r for r in in_step if r != culprit and r not in self.suspects]
        self.suspects.extend(new)
        self.held.update(new)
        return culprit

    def forget(self, request_id: str) -> None:
        """A request that finished or was aborted."""
        self.held.discard(request_id)
        if self.probation == request_id:
            self.probation = None
