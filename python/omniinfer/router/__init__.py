"""``python -m omniinfer.router``: the launcher name mirroring ``sglang_router.launch_router``."""
