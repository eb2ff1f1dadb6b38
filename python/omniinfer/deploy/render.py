"""A deployment for other machines: shell command lines, or Kubernetes manifests.

- ``commands``: one line per server node and one for the router; hosts are placeholders
  (``$PREFILL_0_HOST``, and ``$PREFILL_0_NODE_1_HOST`` for further nodes of an instance) to set
  before running each line on its machine.
- ``lws``: one LeaderWorkerSet (``leaderworkerset.x-k8s.io/v1``) per role, one replica per
  instance and ``size`` = its nodes, plus the router as a Deployment and Service running
  ``python -m omniinfer.router`` with the sglang_router flags over the leaders' DNS names.
- ``rbg``: one RoleBasedGroup (``workloads.x-k8s.io/v1alpha1``) with the roles router, prefill
  and decode (multi-node instances through the role's ``leaderWorkerSet``).
The servers' command lines are ``commands.server_command``'s, the same as the local run's.
"""

from __future__ import annotations

from typing import Any

from omniinfer.deploy.commands import (
    BOOTSTRAP_PORT,
    DIST_PORT,
    SERVER_PORT,
    Server,
    router_args,
    server_command,
    shell,
)
from omniinfer.deploy.spec import Deployment, Group
from omniinfer.proxy.process import router_command

ROUTER_PORT = 8000


def _server(group: Group, index: int, host: str, node: int, leader: str) -> Server:
    return Server(group.role, index, host, SERVER_PORT,
                  BOOTSTRAP_PORT if group.role == "prefill" else None, node,
                  f"{leader}:{DIST_PORT}" if group.nnodes > 1 else None)


def commands(dep: Deployment) -> str:
    """Shell lines, one per server node and one for the router."""
    lines = [f"# {dep.source}: {dep.prefill.count} prefill and {dep.decode.count} decode "
             "instances; set each $..._HOST, run each line on its machine"]
    prefills, decodes = [], []
    for group in dep.groups():
        for index in range(group.count):
            head = f"${group.role.upper()}_{index}_HOST"
            for node in range(group.nnodes):
                host = head if node == 0 else f"${group.role.upper()}_{index}_NODE_{node}_HOST"
                spec = _server(group, index, host, node, head)
                lines.append(f"# {spec.name}" + (f", node {node} of {group.nnodes}"
                                                 if group.nnodes > 1 else ""))
                lines.append(shell(server_command(dep, group, spec, "0.0.0.0", "python")))
            (prefills if group.role == "prefill" else decodes).append(
                f"http://{head}:{SERVER_PORT}")
    args = router_args(dep, [(u, BOOTSTRAP_PORT) for u in prefills], decodes)
    lines += ["# router", shell(router_command(args, dep.router.port, "0.0.0.0", "python"))]
    return "\n".join(lines) + "\n"


def _container(dep: Deployment, name: str, command: list[str], ports: list[int],
               gpus: int) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": name, "image": dep.kubernetes.image,
        "command": ["sh", "-c", shell(command)],
        "ports": [{"containerPort": p} for p in ports]}
    if gpus and dep.device != "cpu":
        resource = "huawei.com/ascend-1980" if dep.device == "npu" else "nvidia.com/gpu"
        container["resources"] = {"limits": {resource: str(gpus)}}
    if ports:
        container["readinessProbe"] = {"tcpSocket": {"port": ports[0]},
                                       "initialDelaySeconds": 30, "periodSeconds": 10}
    return container


def _gpus(dep: Deployment, group: Group) -> int:
    return min(dep.kubernetes.gpus_per_node, max(1, group.tp // group.nnodes))


def _pod(containers: list[dict[str, Any]], role: str, name: str) -> dict[str, Any]:
    return {"metadata": {"labels": {"app.kubernetes.io/name": name, "omniinfer/role": role}},
            "spec": {"containers": containers}}


def _lws_name(dep: Deployment, role: str) -> str:
    return f"{dep.kubernetes.name}-{role}"


def lws(dep: Deployment) -> list[dict[str, Any]]:
    """LeaderWorkerSets for prefill and decode, a Deployment and a Service for the router."""
    docs: list[dict[str, Any]] = []
    prefills, decodes = [], []
    for group in dep.groups():
        name = _lws_name(dep, group.role)
        template: dict[str, Any] = {"size": group.nnodes,
                                    "workerTemplate": _lws_pod(dep, group, name, leader=False)}
        if group.nnodes > 1:
            template["leaderTemplate"] = _lws_pod(dep, group, name, leader=True)
        else:
            template["workerTemplate"] = _lws_pod(dep, group, name, leader=True)
        docs.append({"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
                     "metadata": {"name": name, "namespace": dep.kubernetes.namespace},
                     "spec": {"replicas": group.count, "leaderWorkerTemplate": template,
                              "startupPolicy": "LeaderCreated"}})
        for index in range(group.count):  # the leader pod of replica i: NAME-i, headless NAME
            url = f"http://{name}-{index}.{name}:{SERVER_PORT}"
            (prefills if group.role == "prefill" else decodes).append(url)
    docs += _router_objects(dep, prefills, decodes)
    return docs


def _lws_pod(dep: Deployment, group: Group, name: str, leader: bool) -> dict[str, Any]:
    """A leader's or a worker's pod of one instance; its node rank is LWS's worker index."""
    spec = _server(group, 0, "$(LWS_LEADER_ADDRESS)", 0, "$(LWS_LEADER_ADDRESS)")
    command = server_command(dep, group, spec, "0.0.0.0", "python3")
    if group.nnodes > 1:
        at = command.index("--node-rank") + 1
        command[at] = "$(LWS_WORKER_INDEX)"
    ports = [SERVER_PORT] + ([BOOTSTRAP_PORT] if group.role == "prefill" else [])
    return _pod([_container(dep, f"sglang-{group.role}", command, ports if leader else [],
                            _gpus(dep, group))], group.role, name)


def _router_objects(dep: Deployment, prefills: list[str], decodes: list[str]
                    ) -> list[dict[str, Any]]:
    name = f"{dep.kubernetes.name}-router"
    command = router_command(router_args(dep, [(u, BOOTSTRAP_PORT) for u in prefills], decodes),
                             ROUTER_PORT, "0.0.0.0", "python3")
    labels = {"app.kubernetes.io/name": name, "omniinfer/role": "router"}
    pod = {"metadata": {"labels": labels},
           "spec": {"containers": [_container(dep, "omniproxy", command, [ROUTER_PORT], 0)]}}
    meta = {"name": name, "namespace": dep.kubernetes.namespace}
    return [{"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
             "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": pod}},
            {"apiVersion": "v1", "kind": "Service", "metadata": meta,
             "spec": {"selector": labels,
                      "ports": [{"port": dep.router.port, "targetPort": ROUTER_PORT}]}}]


def rbg(dep: Deployment) -> list[dict[str, Any]]:
    """One RoleBasedGroup: router, prefill and decode roles."""
    group_name = dep.kubernetes.name
    roles: list[dict[str, Any]] = []
    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    for group in dep.groups():
        spec = _server(group, 0, "$(POD_IP)", 0, "$(LWS_LEADER_ADDRESS)")
        command = server_command(dep, group, spec, "0.0.0.0", "python3")
        ports = [SERVER_PORT] + ([BOOTSTRAP_PORT] if group.role == "prefill" else [])
        role: dict[str, Any] = {
            "name": group.role, "replicas": group.count,
            "template": {"spec": {"containers": [
                _container(dep, f"sglang-{group.role}", command, ports, _gpus(dep, group))]}}}
        if group.nnodes > 1:
            role["leaderWorkerSet"] = {"size": group.nnodes}
        roles.append(role)
        for index in range(group.count):  # RBG names pods GROUP-ROLE-i behind s-GROUP-ROLE
            urls[group.role].append(
                f"http://{group_name}-{group.role}-{index}.s-{group_name}-{group.role}"
                f":{SERVER_PORT}")
    command = router_command(router_args(dep, [(u, BOOTSTRAP_PORT) for u in urls["prefill"]],
                                         urls["decode"]), ROUTER_PORT, "0.0.0.0", "python3")
    router = {"name": "router", "replicas": 1, "dependencies": ["prefill", "decode"],
              "template": {"spec": {"containers": [
                  _container(dep, "omniproxy", command, [ROUTER_PORT], 0)]}}}
    return [{"apiVersion": "workloads.x-k8s.io/v1alpha1", "kind": "RoleBasedGroup",
             "metadata": {"name": group_name, "namespace": dep.kubernetes.namespace},
             "spec": {"roles": [router, *roles]}}]


def manifests_yaml(docs: list[dict[str, Any]]) -> str:
    import yaml

    return yaml.safe_dump_all(docs, sort_keys=False, width=100)
