"""CPU-engine launch defaults and the hook-target check, without starting a server."""

from __future__ import annotations

import argparse

import pytest

from omniinfer.cpu.server_defaults import (
    DP_WAIT_MS_ENV,
    EARLY_SEND_ENV,
    HOST_IP_ENV,
    PD_MOONCAKE_ENV,
    PD_POLL_MS_ENV,
    apply_cpu_server_defaults,
)


def _ns(**values: object) -> argparse.Namespace:
    base = dict(sleep_on_idle=False, disaggregation_mode="null",
                disaggregation_transfer_backend="mooncake",
                disaggregation_decode_retraction_backup=None, host="127.0.0.1")
    base.update(values)
    return argparse.Namespace(**base)


def test_plain_server_gets_sleep_on_idle_only() -> None:
    ns, env = _ns(), {}
    changes = apply_cpu_server_defaults(ns, env)
    assert ns.sleep_on_idle is True and len(changes) == 1
    assert ns.disaggregation_transfer_backend == "mooncake"  # not a PD server: untouched
    assert env == {}


def test_a_data_parallel_server_gets_a_waiting_controller() -> None:
    env: dict[str, str] = {}
    changes = apply_cpu_server_defaults(_ns(dp_size=2), env)
    assert env == {DP_WAIT_MS_ENV: "50"} and len(changes) == 2
    for quiet in ({"dp_size": 1}, {}):  # one rank: no controller loop to fix
        env = {}
        apply_cpu_server_defaults(_ns(**quiet), env)
        assert DP_WAIT_MS_ENV not in env
    env = {DP_WAIT_MS_ENV: "7"}  # the user's value stays
    apply_cpu_server_defaults(_ns(dp_size=4), env)
    assert env[DP_WAIT_MS_ENV] == "7"
    env = {}
    apply_cpu_server_defaults(_ns(dp_size=2), env, busy_poll=True)
    assert env == {}


def test_the_controllers_non_blocking_receive_waits_for_a_message_and_no_longer() -> None:
    """Before, SGLang's DP controller called a non-blocking receive in a loop that never
    slept (10 core-seconds per 10 s idle); wrapped, an empty receive sleeps in the kernel."""
    import time

    import zmq

    from omniinfer.sglang_plugin.cpu_fixes import WaitingReceiver

    context = zmq.Context.instance()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        receiver = WaitingReceiver(pull, wait_ms=2000)
        start, cpu = time.perf_counter(), time.process_time()
        with pytest.raises(zmq.Again):
            receiver.recv(flags=zmq.NOBLOCK)
        assert time.perf_counter() - start >= 1.9  # it waited for a message
        assert time.process_time() - cpu < 0.5  # asleep, not spinning
        push.send_pyobj({"rid": "a"})
        start = time.perf_counter()
        assert receiver.recv_pyobj(flags=zmq.NOBLOCK) == {"rid": "a"}
        assert time.perf_counter() - start < 1.0  # a queued message comes at once (not after the 2 s wait)
        assert receiver.getsockopt(zmq.TYPE) == zmq.PULL  # the rest is the socket's own
    finally:
        pull.close(0)
        push.close(0)


def test_busy_poll_keeps_sglang_default() -> None:
    ns = _ns()
    assert apply_cpu_server_defaults(ns, {}, busy_poll=True) == []
    assert ns.sleep_on_idle is False
    env: dict[str, str] = {}
    apply_cpu_server_defaults(_ns(disaggregation_mode="decode"), env, busy_poll=True)
    assert PD_POLL_MS_ENV not in env and env[PD_MOONCAKE_ENV] == "1"


def test_prefill_on_mooncake() -> None:
    ns, env = _ns(disaggregation_mode="prefill"), {}
    apply_cpu_server_defaults(ns, env)
    assert ns.disaggregation_transfer_backend == "mooncake_tcp"
    assert env == {PD_MOONCAKE_ENV: "1", EARLY_SEND_ENV: "0", HOST_IP_ENV: "127.0.0.1",
                   PD_POLL_MS_ENV: "2"}
    assert ns.disaggregation_decode_retraction_backup is None  # a decode-side setting


def test_decode_on_mooncake_tcp_keeps_user_choices() -> None:
    ns = _ns(disaggregation_mode="decode", disaggregation_transfer_backend="mooncake_tcp",
             disaggregation_decode_retraction_backup="none", host="0.0.0.0")
    env = {EARLY_SEND_ENV: "1"}
    apply_cpu_server_defaults(ns, env)
    assert ns.disaggregation_decode_retraction_backup == "none"  # the user's value stays
    assert HOST_IP_ENV not in env  # listening on every interface: no loopback guess
    assert env[PD_MOONCAKE_ENV] == "1" and env[EARLY_SEND_ENV] == "1"
    ns = _ns(disaggregation_mode="decode")
    apply_cpu_server_defaults(ns, {HOST_IP_ENV: "10.0.0.7"})
    assert ns.disaggregation_decode_retraction_backup == "cpu_tensor"


def test_other_transfer_backends_are_left_alone() -> None:
    ns, env = _ns(disaggregation_mode="prefill", disaggregation_transfer_backend="nixl"), {}
    apply_cpu_server_defaults(ns, env)
    assert ns.disaggregation_transfer_backend == "nixl" and env == {}


def test_unresolvable_hook_target_fails_loudly() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from omniinfer.sglang_plugin import hooks
    from omniinfer.sglang_plugin.targets import Target

    good = "omniinfer.cpu.server_defaults.apply_cpu_server_defaults"
    bad = "omniinfer.cpu.server_defaults.no_such_function"
    patched_before = set(HookRegistry._patched)
    try:
        for path, why in ((good, "test: resolves"), (bad, "test: does not")):
            hooks.register(Target(path, frozenset({"after"}), why),
                           lambda result, *a, **k: result, HookType.AFTER)
        HookRegistry.apply_hooks()
        assert bad in hooks.unapplied() and good not in hooks.unapplied()
        with pytest.raises(hooks.HookTargetError, match="no_such_function.*test: does not"):
            hooks.verify()
    finally:
        import omniinfer.cpu.server_defaults as module

        for target in (good, bad):
            HookRegistry._hooks.pop(target, None)
            hooks._REGISTERED.pop(target, None)
        HookRegistry._patched.clear()
        HookRegistry._patched.update(patched_before)
        module.apply_cpu_server_defaults = apply_cpu_server_defaults  # undo the wrapper
