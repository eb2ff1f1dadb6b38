"""OmniAttn pattern search: which layers may keep only sink + recent tokens of KV.

``pattern`` (the file the runtime loads), ``masks`` and ``evaluator`` (scoring a pattern on a
real model), ``ga``, ``objective``, ``baselines`` and ``surrogate`` (pure search algorithms),
``cost`` (what a search will take), ``search`` (the run that ties them together), ``decode``
(reference decoding with a KV cache that really evicts), ``passkey`` and ``retrieval``
(retrieval checks and the retrieval constraint), ``text`` (the shipped texts) and ``cli``
(``omniinfer attn``). ``radix_sink`` and ``runtime_window`` hold the serving runtime's pure
arithmetic (prefix reuse under a sink, window and pool sizes), tested without SGLang.
"""
