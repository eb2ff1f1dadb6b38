"""``round_robin``: the next available worker in turn."""

from __future__ import annotations

from omniinfer.proxy.policy_api import (
    Decision,
    Policy,
    PolicyContext,
    RouteRequest,
    register_policy,
)
from omniinfer.proxy.workers import Worker


@register_policy("round_robin")
class RoundRobinPolicy(Policy):
    def __init__(self, context: PolicyContext) -> None:
        super().__init__(context)
        self._next = 0

    def pick(self, request: RouteRequest, workers: list[Worker]) -> Decision:
        worker = workers[self._next % len(workers)]
        self._next += 1
        return Decision(worker, "round_robin")
