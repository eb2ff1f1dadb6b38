"""Review of the deploy renders: in a multi-node LeaderWorkerSet only the leader pod (node rank
0) serves HTTP, so only its template has container ports and a readiness probe; a worker pod
(ranks > 0) with a TCP probe on the server port would never become Ready."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from omniinfer.deploy import render
from omniinfer.deploy.commands import BOOTSTRAP_PORT, SERVER_PORT
from omniinfer.deploy.spec import load, parse

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "omni-1p1d-cpu.yaml"


def _multinode() -> Any:
    data = yaml.safe_load(EXAMPLE.read_text())
    data.update(device="gpu", prefill={"count": 2, "tp": 16, "ep": 16, "nnodes": 2},
                decode={"count": 1, "tp": 16, "ep": 16, "nnodes": 2})
    return parse(data, "m.yaml")


def _container(template: dict[str, Any]) -> dict[str, Any]:
    containers = template["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def test_multinode_lws_worker_pods_have_no_ports_and_no_readiness_probe() -> None:
    docs = render.lws(_multinode())
    for doc, ports in zip(docs[:2], ([SERVER_PORT, BOOTSTRAP_PORT], [SERVER_PORT]),
                          strict=True):
        template = doc["spec"]["leaderWorkerTemplate"]
        assert template["size"] == 2
        worker = _container(template["workerTemplate"])
        assert worker["ports"] == [], doc["metadata"]["name"]
        assert "readinessProbe" not in worker, doc["metadata"]["name"]
        leader = _container(template["leaderTemplate"])
        assert [p["containerPort"] for p in leader["ports"]] == ports
        assert leader["readinessProbe"]["httpGet"] == {"path": "/health", "port": SERVER_PORT}
        for container in (leader, worker):  # both still join the leader's process group
            command = container["command"]
            assert command[command.index("--dist-init-addr") + 1] == \
                "$(LWS_LEADER_ADDRESS):20000"
            assert command[command.index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"


def test_single_node_lws_pods_keep_their_ports_and_probe() -> None:
    for doc in render.lws(load(EXAMPLE))[:2]:
        template = doc["spec"]["leaderWorkerTemplate"]
        assert template["size"] == 1 and "leaderTemplate" not in template
        worker = _container(template["workerTemplate"])
        assert worker["ports"][0] == {"containerPort": SERVER_PORT}
        assert worker["readinessProbe"]["httpGet"] == {"path": "/health", "port": SERVER_PORT}


def _rbg_roles(dep: Any) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in render.rbg(dep)[0]["spec"]["roles"]}


def test_multinode_rbg_roles_are_leaderworkersets_with_node_ranks() -> None:
    """As RBG's own v1alpha1 examples write it: ``workload`` LeaderWorkerSet, its ``size``,
    every pod's rank from LWS's variables, the leader's patch adding ports and the probe."""
    roles = _rbg_roles(_multinode())
    for name, ports in (("prefill", [SERVER_PORT, BOOTSTRAP_PORT]), ("decode", [SERVER_PORT])):
        role = roles[name]
        assert role["workload"] == {"apiVersion": "leaderworkerset.x-k8s.io/v1",
                                    "kind": "LeaderWorkerSet"}
        assert role["leaderWorkerSet"]["size"] == 2
        pod = _container(role["template"])
        assert pod["ports"] == [] and "readinessProbe" not in pod
        command = pod["command"]
        assert command[command.index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"
        assert command[command.index("--dist-init-addr") + 1] == "$(LWS_LEADER_ADDRESS):20000"
        patch = role["leaderWorkerSet"]["patchLeaderTemplate"]["spec"]["containers"][0]
        assert patch["name"] == pod["name"]  # merged into the same container
        assert [p["containerPort"] for p in patch["ports"]] == ports
        assert patch["readinessProbe"]["httpGet"]["path"] == "/health"
    single = _rbg_roles(load(EXAMPLE))
    assert "workload" not in single["prefill"] and "leaderWorkerSet" not in single["prefill"]


def test_pods_get_shared_memory_the_models_claim_and_http_probes() -> None:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["kubernetes"] = {"model_pvc": "llm-models", "shm_size": "32Gi"}
    dep = parse(data, "m.yaml")
    for docs in (render.lws(dep), render.rbg(dep)):
        text = yaml.safe_dump_all(docs)
        assert "tcpSocket" not in text
        pods = _pod_specs(docs)
        servers = [p for p in pods if p["containers"][0]["name"].startswith("sglang")]
        routers = [p for p in pods if p["containers"][0]["name"] == "omniproxy"]
        assert servers and len(routers) == 1
        for pod in servers:
            volumes = {v["name"]: v for v in pod["volumes"]}
            assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
            assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "llm-models"
            container = pod["containers"][0]
            mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
            assert mounts == {"dshm": "/dev/shm", "models": "/models"}
            command = container["command"]
            assert command[command.index("--model-path") + 1] == \
                "/models/.cache/models/SmolLM2-135M-MoE"
            assert container["workingDir"] == "/opt/omniinfer"
        router = routers[0]["containers"][0]
        assert router["readinessProbe"]["httpGet"]["path"] == "/health"
        assert router["livenessProbe"]["httpGet"]["path"] == "/liveness"


def _pod_specs(doc: Any) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    if isinstance(doc, dict):
        if isinstance(doc.get("containers"), list) and any("command" in c
                                                           for c in doc["containers"]):
            found.append(doc)
        for value in doc.values():
            found += _pod_specs(value)
    elif isinstance(doc, list):
        for item in doc:
            found += _pod_specs(item)
    return found


def test_every_rendered_command_parses_with_the_real_parsers() -> None:
    """Each pod's argv (after the kubelet's expansion) is a command line SGLang 0.5.23's own
    parser (with the omni flags) and OmniProxy's accept, with no flag unknown."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    from omniinfer import flags
    from omniinfer.proxy import cli

    env = {"LWS_LEADER_ADDRESS": "10.0.0.1", "LWS_WORKER_INDEX": "1"}
    for dep in (_multinode(), load(EXAMPLE)):
        for docs in (render.lws(dep), render.rbg(dep)):
            for pod in _pod_specs(docs):
                argv = [_expand(a, env) for a in pod["containers"][0]["command"]]
                assert argv[:2] == ["python3", "-m"]
                if argv[2] == "sglang.launch_server":
                    parser = argparse.ArgumentParser(exit_on_error=False)
                    ServerArgs.add_cli_args(parser)
                    flags.add_arguments(parser)
                    args, unknown = parser.parse_known_args(argv[3:])
                    assert unknown == [], unknown
                    if "--node-rank" in argv:
                        assert args.node_rank == 1 and args.dist_init_addr == "10.0.0.1:20000"
                else:
                    assert argv[2] == "omniinfer.router"
                    parser = argparse.ArgumentParser(exit_on_error=False)
                    cli.add_arguments(parser)
                    config = cli.resolve(parser.parse_args(argv[3:]))
                    assert config.pd_disaggregation and config.prefill_urls


def _expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's expansion: ``$(VAR)`` of a defined variable, ``$$`` as ``$``."""
    out, i = "", 0
    while i < len(arg):
        if arg.startswith("$$", i):
            out, i = out + "$", i + 2
        elif arg.startswith("$(", i) and ")" in arg[i:]:
            end = arg.index(")", i)
            name = arg[i + 2:end]
            out, i = out + env.get(name, arg[i:end + 1]), end + 1
        else:
            out, i = out + arg[i], i + 1
    return out
