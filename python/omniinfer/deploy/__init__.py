"""One file describes a PD deployment (``spec.py``, the file read as untrusted input by
``safe_yaml.py``); ``omniinfer deploy FILE`` starts it on this machine (``local.py``) or renders
it for others (``render.py``: command lines, LeaderWorkerSet or RoleBasedGroup manifests), with
the same server command lines (``commands.py``, where file values stay data)."""
