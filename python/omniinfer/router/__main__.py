"""Thin launcher: ``python -m omniinfer.router [launch_router flags]``."""

from omniinfer.proxy import main

if __name__ == "__main__":
    raise SystemExit(main())
