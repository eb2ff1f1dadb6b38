"""Routes the plugin adds to SGLang's HTTP server (launcher process)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from omniinfer.flags import current_config

STATE_DIR_ENV = "OMNIINFER_STATE_DIR"
_registered = False


def _status_file(enabled: bool, name: str) -> Any:
    """The JSON a scheduler last wrote to ``name`` in the state dir; ``{"enabled": false}`` when
    the feature is off, ``"state": "starting"`` until the first write."""
    from fastapi.responses import JSONResponse

    if not enabled:
        return JSONResponse({"enabled": False}, status_code=200)
    directory = os.environ.get(STATE_DIR_ENV)
    path = Path(directory) / name if directory else None
    if path is None or not path.is_file():
        return JSONResponse({"enabled": True, "state": "starting"}, status_code=200)
    return JSONResponse(json.loads(path.read_text()))


async def placement_status() -> Any:
    """GET /omni/placement: per-layer imbalance, decisions (adopted or rejected), migrations."""
    return _status_file(current_config().enable_omni_placement, "placement.json")


async def attn_status() -> Any:
    """GET /omni/attn: KV memory of full vs compressed layers, usage, compressed slots freed."""
    return _status_file(current_config().omni_attn_pattern is not None, "attn.json")


def register_routes() -> None:
    global _registered
    if _registered:
        return
    from sglang.srt.entrypoints import http_server

    http_server.app.add_api_route("/omni/placement", placement_status, methods=["GET"])
    http_server.app.add_api_route("/omni/attn", attn_status, methods=["GET"])
    _registered = True
