"""Routes the plugin adds to SGLang's HTTP server (launcher process)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from omniinfer.flags import current_config

STATE_DIR_ENV = "OMNIINFER_STATE_DIR"
_registered = False


async def placement_status() -> Any:
    """GET /omni/placement: per-layer imbalance, decisions (adopted or rejected), migrations."""
    from fastapi.responses import JSONResponse

    if not current_config().enable_omni_placement:
        return JSONResponse({"enabled": False}, status_code=200)
    directory = os.environ.get(STATE_DIR_ENV)
    path = Path(directory) / "placement.json" if directory else None
    if path is None or not path.is_file():
        return JSONResponse({"enabled": True, "state": "starting"}, status_code=200)
    return JSONResponse(json.loads(path.read_text()))


async def attn_status() -> Any:
    """GET /omni/attn: KV memory of full vs compressed layers, usage, compressed slots freed."""
    from fastapi.responses import JSONResponse

    if current_config().omni_attn_pattern is None:
        return JSONResponse({"enabled": False}, status_code=200)
    directory = os.environ.get(STATE_DIR_ENV)
    path = Path(directory) / "attn.json" if directory else None
    if path is None or not path.is_file():
        return JSONResponse({"enabled": True, "state": "starting"}, status_code=200)
    return JSONResponse(json.loads(path.read_text()))


def register_routes() -> None:
    global _registered
    if _registered:
        return
    from sglang.srt.entrypoints import http_server

    http_server.app.add_api_route("/omni/placement", placement_status, methods=["GET"])
    http_server.app.add_api_route("/omni/attn", attn_status, methods=["GET"])
    _registered = True
