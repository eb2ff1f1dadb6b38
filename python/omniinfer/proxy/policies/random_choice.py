"""``random``: uniform choice among available workers."""

from __future__ import annotations

import random

from omniinfer.proxy.policy_api import Decision, Policy, RouteRequest, register_policy
from omniinfer.proxy.workers import Worker


@register_policy("random")
class RandomPolicy(Policy):
    def pick(self, request: RouteRequest, workers: list[Worker]) -> Decision:
        return Decision(random.choice(workers), "random")
