"""OmniProxy: an SGLang-protocol router (regular and prefill/decode) with pluggable policies.

Start it with ``python -m omniinfer.router`` or ``omniinfer router``; from Python, use
:class:`omniinfer.proxy.process.RouterProcess`. Policies live in ``omniinfer.proxy.policies``
(one file each) and ``omniinfer.proxy.oas`` (the deferring ones), registered by name with
``omniinfer.proxy.policy_api``.
"""

from __future__ import annotations

__all__ = ["RouterProcess", "main"]


def main(argv: list[str] | None = None) -> int:
    from omniinfer.proxy.cli import main as cli_main

    return cli_main(argv)


def __getattr__(name: str) -> object:
    if name == "RouterProcess":
        from omniinfer.proxy.process import RouterProcess

        return RouterProcess
    raise AttributeError(name)
