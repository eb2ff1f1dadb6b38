"""``power_of_two``: sample two workers, keep the one with fewer in-flight tokens."""

from __future__ import annotations

import random

from omniinfer.proxy.policy_api import (
    Decision,
    Policy,
    RouteRequest,
    least_loaded,
    register_policy,
)
from omniinfer.proxy.workers import Worker


@register_policy("power_of_two")
class PowerOfTwoPolicy(Policy):
    def pick(self, request: RouteRequest, workers: list[Worker]) -> Decision:
        if len(workers) == 1:
            return Decision(workers[0], "only_candidate")
        a, b = random.sample(workers, 2)
        return Decision(least_loaded([a, b]), "lower_load_of_two")
