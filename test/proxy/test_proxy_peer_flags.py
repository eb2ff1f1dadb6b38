"""A command line written for sglang-router 0.3.2 starts OmniProxy or names each refused flag.

The peer's own parser (the installed ``sglang_router``) lists its flags; each gets a realistic
value of the type and choices that parser declares.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from omniinfer.proxy import cli
from omniinfer.proxy.peer_flags import BY_DEST, PEER_FLAGS, REFUSED

PD = ["--pd-disaggregation", "--prefill", "http://127.0.0.1:30001", "9001",
      "--decode", "http://127.0.0.1:30002"]


def peer_actions() -> list[argparse.Action]:
    from sglang_router.launch_router import RouterArgs

    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def realistic(action: argparse.Action) -> list[str]:
    """A value the peer's parser accepts for ``action`` (nothing for a switch)."""
    if action.nargs == 0:
        return []
    if action.choices:
        value = str(sorted(map(str, action.choices))[0])
    elif action.type is int:
        value = "8"
    elif action.type is float:
        value = "2.5"
    elif "path" in action.dest or "dir" in action.dest:
        value = "/etc/sglang/file"
    else:
        value = "value"
    return [value]


def ours() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    cli.add_arguments(parser)
    return parser


def test_every_sglang_router_flag_is_known_to_omniproxy() -> None:
    parser = ours()
    known = {o for a in parser._actions for o in a.option_strings}
    missing = [a.option_strings[0] for a in peer_actions()
               if not set(a.option_strings) & known]
    assert missing == []
    assert len(PEER_FLAGS) == len(BY_DEST)  # no flag listed twice
    peer = {a.dest for a in peer_actions()}
    assert {f for f in BY_DEST if f not in peer} == {"dp_minimum_tokens_scheduler",
                                                     "disable_load_monitoring"}  # smg's


def test_a_line_of_every_peer_flag_names_each_refused_flag_with_its_reason(
    capsys: pytest.CaptureFixture[str]
) -> None:
    skip = {"worker_urls", "prefill", "decode", "pd_disaggregation", "config", "policy",
            "prefill_policy", "decode_policy", "dp_aware", "host", "port", "log_level",
            "log_dir"}
    line = list(PD)
    for action in peer_actions():
        if action.dest not in skip:
            line += [action.option_strings[0], *realistic(action)]
    args = ours().parse_args(line)  # no flag is unknown
    assert cli.run(args) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    refused = {f"--{f.name}" for f in PEER_FLAGS if f.status == REFUSED}
    named = {e.split(": ")[2].split(" ")[0].rstrip(":") for e in errors}
    assert refused <= named and all(e.startswith("omniinfer router: error: --") for e in errors)
    for error in errors:
        flag = error.split(": ")[2].split(" ")[0].rstrip(":")
        reason = BY_DEST[flag[2:].replace("-", "_")].reason
        assert error.endswith(reason) or reason in error  # each with its reason
    assert "--backend" in named  # 'openai' (the first choice) is refused
    assert "--history-backend" not in named  # 'memory' (the first choice) is accepted
    assert len(errors) == len(named)  # one line per flag


def test_a_line_of_the_accepted_peer_flags_resolves_with_a_note_each(tmp_path: Path) -> None:
    line = list(PD)
    accepted = [f for f in PEER_FLAGS if f.status != REFUSED]
    for flag in accepted:
        option = "--" + flag.name
        line += [option] if flag.nargs == "switch" else [option, (flag.accepts or ("5",))[0]]
    line += ["--shutdown-grace-period-secs", "30", "--log-dir", str(tmp_path)]
    config, notes = cli.resolve_with_notes(ours().parse_args(line))
    assert len(notes) == len(accepted)
    assert config.shutdown_grace_period_secs == 30.0 and config.log_dir == str(tmp_path)
    assert config.pd_disaggregation and config.prefill_urls == [("http://127.0.0.1:30001", 9001)]


def test_a_default_only_flag_refuses_another_value_and_a_file_can_carry_peer_flags(
    tmp_path: Path
) -> None:
    with pytest.raises(cli.RefusedFlags) as refused:
        cli.resolve(ours().parse_args([*PD, "--history-backend", "redis"]))
    assert refused.value.lines == ["--history-backend redis: conversation history storage (the "
                                   "responses API's) is not supported (accepted: memory, none)"]
    path = tmp_path / "router.json"
    path.write_text('{"eviction_interval_secs": 30, "mini_lb": true, "jwt_issuer": '
                    '"https://issuer"}')
    with pytest.raises(cli.RefusedFlags) as refused:
        cli.resolve(ours().parse_args([*PD, "--config", str(path)]))
    assert [line.split(":")[0] for line in refused.value.lines] == ["--jwt-issuer"]
    path.write_text('{"eviction_interval_secs": 30, "mini_lb": true, "enable_trace": false}')
    config, notes = cli.resolve_with_notes(ours().parse_args([*PD, "--config", str(path)]))
    assert [n.split(" ")[0] for n in notes] == ["--eviction-interval-secs", "--mini-lb"]


def test_the_grace_period_and_the_metrics_port_are_bounded() -> None:
    with pytest.raises(ValueError, match="shutdown-grace-period-secs"):
        cli.resolve(ours().parse_args([*PD, "--shutdown-grace-period-secs", "-1"]))
    with pytest.raises(ValueError, match="prometheus-port"):
        cli.resolve(ours().parse_args([*PD, "--prometheus-port", "70000"]))


def test_smg_names_for_the_load_poll_are_aliases() -> None:
    config = cli.resolve(ours().parse_args([*PD, "--load-monitor-interval", "0.5"]))
    assert config.loads_poll_interval_secs == 0.5
    config, notes = cli.resolve_with_notes(ours().parse_args([*PD, "--disable-load-monitoring"]))
    assert config.loads_poll_interval_secs == 1.0 and notes  # smg's switch: polling stays on
    config, notes = cli.resolve_with_notes(ours().parse_args(
        [*PD, "--dp-aware", "--dp-minimum-tokens-scheduler"]))
    assert config.dp_aware and notes[0].startswith("--dp-minimum-tokens-scheduler accepted")


def test_metrics_on_the_peers_default_port_and_a_taken_one_is_skipped_unless_asked_for(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/metrics on :29000 by default (a scrape config written for sglang-router keeps working);
    with that port taken the router still starts, and an explicit taken port is an error. The
    default is moved to a port this test holds, so that routers of other tests running at the
    same time (which listen on the real default when it is free) cannot race it."""
    import asyncio
    import socket
    import urllib.request

    from router_inproc import free_port

    from omniinfer.proxy import server
    from omniinfer.proxy.config import RouterConfig

    assert server.DEFAULT_METRICS_PORT == 29000  # sglang-router's and smg's
    default = free_port()
    monkeypatch.setattr(server, "DEFAULT_METRICS_PORT", default)

    def config(**extra: object) -> RouterConfig:
        return RouterConfig(worker_urls=["http://127.0.0.1:9"], host="127.0.0.1",
                            port=free_port(), loads_poll_interval_secs=0,
                            disable_health_check=True, **extra)

    async def main() -> None:
        blocker = socket.socket()
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT
        blocker.bind(("127.0.0.1", default))
        blocker.listen()
        serving = await server.open_router(config())
        try:
            assert serving.extra is None  # started without the metrics port
            assert f"metrics port {default} not available" in caplog.text
        finally:
            await serving.close()
        with pytest.raises(OSError):
            await server.open_router(config(prometheus_port=default))
        blocker.close()
        keyed = await server.open_router(config(api_key="secret"))  # that listener asks no key
        try:
            assert keyed.extra is None  # the port is free, yet not opened
        finally:
            await keyed.close()
        serving = await server.open_router(config())
        try:
            url = f"http://127.0.0.1:{default}/metrics"
            body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
            assert b"# TYPE" in body
        finally:
            await serving.close()

    asyncio.run(main())


@pytest.mark.parametrize("line", [
    # SGLang's PD docs (sglang_router.launch_router with the mini load balancer)
    ["--pd-disaggregation", "--mini-lb", "--prefill", "http://127.0.0.1:30000",
     "--decode", "http://127.0.0.1:30001", "--host", "0.0.0.0", "--port", "8000"],
    # smg's PD docs: a bootstrap port per prefill, policies per role, its monitor interval
    ["--pd-disaggregation", "--prefill", "http://prefill1:8000", "9000",
     "--prefill", "http://prefill2:8000", "9001", "--decode", "http://decode1:8001",
     "--prefill-policy", "cache_aware", "--decode-policy", "round_robin",
     "--load-monitor-interval", "5", "--host", "0.0.0.0", "--port", "30000"],
])
def test_the_pd_command_lines_of_sglang_and_smg_docs_start_omniproxy(line: list[str]) -> None:
    config, notes = cli.resolve_with_notes(ours().parse_args(line))
    assert config.pd_disaggregation and config.decode_urls and config.prefill_urls
    assert all(not note.startswith("--pd") for note in notes)
