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
        assert leader["readinessProbe"]["tcpSocket"]["port"] == SERVER_PORT
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
        assert worker["readinessProbe"]["tcpSocket"]["port"] == SERVER_PORT
