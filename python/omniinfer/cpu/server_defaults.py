"""Launch defaults that make the stock SGLang commands work on the CPU engine.

Applied by the plugin's ``ServerArgs.from_cli_args`` hook in the launcher, only when
:func:`omniinfer.cpu.detect.cpu_engine_active` holds. Each default fills in something the user
left unset; a value the user gave is never overridden. Pure Python: reads and writes an
``argparse.Namespace`` and an environment mapping, imports nothing of SGLang.

Why each one:

- ``--sleep-on-idle``: an idle scheduler otherwise busy-polls a whole core (10 core-seconds per
  10 s idle measured on a 2-core machine); with two servers that is the whole machine.
- PD with Mooncake (``--disaggregation-transfer-backend mooncake`` / ``mooncake_tcp``):
  the TCP transport (``MC_FORCE_TCP=1``) since there is no RDMA device; the prefill server's
  early send of a cached prefix is off (it builds a ``torch.cuda.Event``); the decode server keeps
  retraction backups in plain CPU tensors (the default HiCache host pool calls
  ``cudaHostRegister``); a server listening on loopback advertises loopback for the transfer.
  The scheduler side (Mooncake's sender takes NumPy page indices, not pinned tensors) is a hook,
  switched on through :data:`PD_MOONCAKE_ENV`.
- The DP controller waits without spinning (:data:`DP_WAIT_MS_ENV`, with ``--dp-size`` > 1):
  SGLang's ``DataParallelController.event_loop`` polls its socket without ever blocking, 10
  core-seconds per 10 s idle; the hook waits on the socket instead (a request wakes it at once).
- PD waits without spinning (:data:`PD_POLL_MS_ENV`): a PD scheduler with requests queued but
  nothing to compute (a decode server waiting for KV, a prefill server waiting for its decode
  peer) loops with ``time.sleep(0)``, taking a whole core; when prefill and decode share a
  machine's cores, the prefill forward then runs 2-3x slower (measured by
  benchmark/pd/transfer.py). The hook waits a few milliseconds on the scheduler's sockets instead.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import MutableMapping

from omniinfer.net import is_loopback

PD_MOONCAKE_ENV = "OMNIINFER_CPU_PD_MOONCAKE"
PD_POLL_MS_ENV = "OMNIINFER_CPU_PD_POLL_MS"
PD_POLL_MS_DEFAULT = "2"
DP_WAIT_MS_ENV = "OMNIINFER_CPU_DP_WAIT_MS"
DP_WAIT_MS_DEFAULT = "50"  # only bounds how often its watchdog is fed while idle
EARLY_SEND_ENV = "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX"
HOST_IP_ENV = "SGLANG_HOST_IP"
MOONCAKE_BACKENDS = ("mooncake", "mooncake_tcp")


def apply_cpu_server_defaults(
    namespace: argparse.Namespace,
    environ: MutableMapping[str, str] | None = None,
    busy_poll: bool = False,
) -> list[str]:
    """Fill in the CPU defaults; returns one line per change, for the launch log."""
    env = os.environ if environ is None else environ
    changes: list[str] = []
    if not busy_poll and hasattr(namespace, "sleep_on_idle") and not namespace.sleep_on_idle:
        namespace.sleep_on_idle = True
        changes.append("--sleep-on-idle (an idle scheduler would spin a whole core)")

    dp_size = getattr(namespace, "dp_size", 1)
    if not busy_poll and isinstance(dp_size, int) and dp_size > 1 and DP_WAIT_MS_ENV not in env:
        env[DP_WAIT_MS_ENV] = DP_WAIT_MS_DEFAULT
        changes.append(f"{DP_WAIT_MS_ENV}={DP_WAIT_MS_DEFAULT} (the DP controller waits on its "
                       "socket instead of spinning a core)")
    mode = getattr(namespace, "disaggregation_mode", None) or "null"
    backend = getattr(namespace, "disaggregation_transfer_backend", None)
    if mode == "null" or backend not in MOONCAKE_BACKENDS:
        return changes

    if backend == "mooncake":
        namespace.disaggregation_transfer_backend = "mooncake_tcp"
        changes.append("--disaggregation-transfer-backend mooncake_tcp (no RDMA on the CPU engine)")
    env[PD_MOONCAKE_ENV] = "1"
    if not busy_poll and PD_POLL_MS_ENV not in env:
        env[PD_POLL_MS_ENV] = PD_POLL_MS_DEFAULT
        changes.append(f"{PD_POLL_MS_ENV}={PD_POLL_MS_DEFAULT} (a PD scheduler waiting for KV or "
                       "its peer polls every 2 ms instead of spinning a core)")
    if mode == "prefill" and EARLY_SEND_ENV not in env:
        env[EARLY_SEND_ENV] = "0"
        changes.append(f"{EARLY_SEND_ENV}=0 (its early send builds a CUDA event)")
    if mode == "decode" and getattr(namespace, "disaggregation_decode_retraction_backup", None) is None:
        namespace.disaggregation_decode_retraction_backup = "cpu_tensor"
        changes.append("--disaggregation-decode-retraction-backup cpu_tensor (host pool needs CUDA)")
    if HOST_IP_ENV not in env and "HOST_IP" not in env and is_loopback(getattr(namespace, "host", None)):
        env[HOST_IP_ENV] = "127.0.0.1"
        changes.append(f"{HOST_IP_ENV}=127.0.0.1 (the server listens on loopback only)")
    return changes
