"""OAS, OmniProxy's prefill-decode scheduler, in one package.

- ``cost``: the per-instance batch-time model learned online and the predicted TTFT of a request
  on an instance (pure).
- ``deferred_queue``: the queue that holds requests in the router and releases each to its best
  instance just before that instance's next batch, with its bound and work-conserving rules
  (pure).
- ``deferred_policy``: the asyncio glue every deferring policy shares (prefill queue pumping,
  decode longest-first placement under a running cap).
- ``policy``: ``oas`` and its ablations and variants; ``shipped``: OmniInfer's shipped rules
  ``omni_default`` and ``omni_earliest_batch``.

Every policy here registers itself with ``omniinfer.proxy.policy_api.register_policy`` on import.
"""
