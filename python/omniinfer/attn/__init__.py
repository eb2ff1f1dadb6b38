"""OmniAttn pattern search: which layers may keep only sink + recent tokens of KV.

``pattern`` (the file the runtime loads), ``masks`` and ``evaluator`` (scoring a pattern on a
real model), ``ga``, ``objective`` and ``baselines`` (pure search algorithms), ``search`` (the
run that ties them together), ``decode`` (reference decoding with a KV cache that really evicts),
``passkey`` (retrieval check) and ``cli`` (``omniinfer attn``).
"""
