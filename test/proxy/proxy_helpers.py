"""Helpers for the router tests: HTTP calls, SSE parsing, polling. The workers are emulated
SGLang workers (``omniinfer.emulator.process.EmulatorProcess``), faults switched per test."""

from __future__ import annotations

from omni_testing import get, post, sse_events, wait_until  # noqa: F401  (re-exported for the tests)
