"""A deployment for other machines: shell command lines, or Kubernetes manifests.

- ``commands``: one line per server node and one for the router; hosts are placeholders
  (``${PREFILL_0_HOST}``, and ``${PREFILL_0_NODE_1_HOST}`` for further nodes of an instance)
  to set before running each line on its machine; every value of the file is single-quoted.
- ``lws``: one LeaderWorkerSet (``leaderworkerset.x-k8s.io/v1``) per role, one replica per
  instance and ``size`` = its nodes, plus the router as a Deployment and Service running
  ``python -m omniinfer.router`` with the sglang_router flags over the leaders' DNS names.
- ``rbg``: one RoleBasedGroup (``workloads.x-k8s.io/v1alpha1``) with the roles router, prefill
  and decode (multi-node instances through the role's ``leaderWorkerSet``).
The servers' command lines are ``commands.server_command``'s, the same as the local run's.
Containers run their program directly (no shell): ``command`` is the argv, values of the file
with each ``$`` doubled so that the kubelet's ``$(VAR)`` expansion leaves them as written, and
only the renderer's placeholders (``$(LWS_LEADER_ADDRESS)``, ``$(LWS_WORKER_INDEX)``) expanded.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omniinfer.deploy.commands import (
    BOOTSTRAP_PORT,
    DIST_PORT,
    SERVER_PORT,
    Arg,
    Server,
    Var,
    kube_args,
    router_args,
    server_command,
    shell,
    word,
)
from omniinfer.deploy.safe_yaml import printable
from omniinfer.deploy.spec import Deployment, Group
from omniinfer.proxy.process import router_command

ROUTER_PORT = 8000
IMAGE_WORKDIR = "/opt/omniinfer"  # deploy/Dockerfile's WORKDIR: relative pattern paths resolve
MODELS_MOUNT = "/models"


def _server(group: Group, index: int, host: Arg, node: int | Var, leader: Arg) -> Server:
    return Server(group.role, index, host, SERVER_PORT,
                  BOOTSTRAP_PORT if group.role == "prefill" else None, node,
                  word(leader, f":{DIST_PORT}") if group.nnodes > 1 else None)


def _router(dep: Deployment, prefills: list[Arg], decodes: list[Arg], port: int,
            python: str) -> list[Arg]:
    """The router's command: ``router_command``'s program and ``--host``/``--port``, then
    ``router_args`` (kept out of ``router_command``, which takes text only)."""
    return [*router_command([], port, "0.0.0.0", python),
            *router_args(dep, [(u, BOOTSTRAP_PORT) for u in prefills], decodes)]


def commands(dep: Deployment) -> str:
    """Shell lines, one per server node and one for the router; each value of the file is
    quoted, each host is a ``${..._HOST}`` variable of the machine running the line."""
    lines = [f"# {printable(dep.source)}: {dep.prefill.count} prefill and {dep.decode.count} "
             "decode instances; set each ${..._HOST}, run each line on its machine"]
    prefills: list[Arg] = []
    decodes: list[Arg] = []
    for group in dep.groups():
        for index in range(group.count):
            role = f"{group.role.upper()}_{index}"
            head = Var(f"{role}_HOST")
            for node in range(group.nnodes):
                host = head if node == 0 else Var(f"{role}_NODE_{node}_HOST")
                spec = _server(group, index, word(host), node, word(head))
                lines.append(f"# {spec.name}" + (f", node {node} of {group.nnodes}"
                                                 if group.nnodes > 1 else ""))
                lines.append(shell(server_command(dep, group, spec, "0.0.0.0", "python")))
            (prefills if group.role == "prefill" else decodes).append(
                word("http://", head, f":{SERVER_PORT}"))
    lines += ["# router", shell(_router(dep, prefills, decodes, dep.router.port, "python"))]
    return "\n".join(lines) + "\n"


def _container(dep: Deployment, name: str, command: list[Arg], ports: list[int],
               gpus: int, server: bool = True) -> dict[str, Any]:
    """One container: the image, its argv, its ports and HTTP probes (a server: readiness on
    ``/health``, which answers once the model is loaded; the router: readiness on ``/health``,
    every role served, and liveness on ``/liveness``); a server's mounts the pod's volumes."""
    container: dict[str, Any] = {
        "name": name, "image": dep.kubernetes.image, "workingDir": IMAGE_WORKDIR,
        "command": kube_args(command),
        "ports": [{"containerPort": p} for p in ports]}
    if gpus and dep.device != "cpu":
        resource = "huawei.com/ascend-1980" if dep.device == "npu" else "nvidia.com/gpu"
        container["resources"] = {"limits": {resource: str(gpus)}}
    if ports:
        container["readinessProbe"] = {"httpGet": {"path": "/health", "port": ports[0]},
                                       "initialDelaySeconds": 30 if server else 5,
                                       "periodSeconds": 10,
                                       "failureThreshold": 3}
    if ports and not server:
        container["livenessProbe"] = {"httpGet": {"path": "/liveness", "port": ports[0]},
                                      "initialDelaySeconds": 10, "periodSeconds": 10,
                                      "failureThreshold": 6}
    if server:
        mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
        if dep.kubernetes.model_pvc:
            mounts.append({"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True})
        container["volumeMounts"] = mounts
    return container


def _volumes(dep: Deployment) -> list[dict[str, Any]]:
    """A server pod's volumes: ``/dev/shm`` in memory (NCCL and the transfer engine use it),
    and the models' claim when the file names one."""
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {
        "medium": "Memory", "sizeLimit": dep.kubernetes.shm_size}}]
    if dep.kubernetes.model_pvc:
        volumes.append({"name": "models", "persistentVolumeClaim": {
            "claimName": dep.kubernetes.model_pvc, "readOnly": True}})
    return volumes


def in_cluster(dep: Deployment) -> Deployment:
    """The deployment as its pods see it: with a models claim, a relative model path is a
    path under ``/models`` (an absolute one, or a hub id with no claim, stays as written)."""
    model = dep.model
    if dep.kubernetes.model_pvc and not model.startswith("/"):
        model = f"{MODELS_MOUNT}/{model}"
    return dataclasses.replace(dep, model=model)


def _gpus(dep: Deployment, group: Group) -> int:
    return min(dep.kubernetes.gpus_per_node, max(1, group.tp // group.nnodes))


def _pod(dep: Deployment, containers: list[dict[str, Any]], role: str, name: str
         ) -> dict[str, Any]:
    return {"metadata": {"labels": {"app.kubernetes.io/name": name, "omniinfer/role": role}},
            "spec": {"containers": containers, "volumes": _volumes(dep)}}


def _lws_name(dep: Deployment, role: str) -> str:
    return f"{dep.kubernetes.name}-{role}"


def lws(dep: Deployment) -> list[dict[str, Any]]:
    """LeaderWorkerSets for prefill and decode, a Deployment and a Service for the router."""
    dep = in_cluster(dep)
    docs: list[dict[str, Any]] = []
    prefills: list[Arg] = []
    decodes: list[Arg] = []
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
    """A leader's or a worker's pod of one instance; its node rank is LWS's worker index.

    Only a leader pod (node rank 0, or the one pod of a single-node instance) serves HTTP: it
    alone gets the container ports and the TCP readiness probe; a worker pod of a multi-node
    instance gets neither (it would never become Ready)."""
    address = word(Var("LWS_LEADER_ADDRESS"))
    rank = Var("LWS_WORKER_INDEX") if group.nnodes > 1 else 0
    command = server_command(dep, group, _server(group, 0, address, rank, address), "0.0.0.0",
                             "python3")
    ports = [SERVER_PORT] + ([BOOTSTRAP_PORT] if group.role == "prefill" else [])
    return _pod(dep, [_container(dep, f"sglang-{group.role}", command, ports if leader else [],
                                 _gpus(dep, group))], group.role, name)


def _router_objects(dep: Deployment, prefills: list[Arg], decodes: list[Arg]
                    ) -> list[dict[str, Any]]:
    name = f"{dep.kubernetes.name}-router"
    command = _router(dep, prefills, decodes, ROUTER_PORT, "python3")
    labels = {"app.kubernetes.io/name": name, "omniinfer/role": "router"}
    pod = {"metadata": {"labels": labels},
           "spec": {"containers": [_container(dep, "omniproxy", command, [ROUTER_PORT], 0,
                                              server=False)]}}
    meta = {"name": name, "namespace": dep.kubernetes.namespace}
    return [{"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
             "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": pod}},
            {"apiVersion": "v1", "kind": "Service", "metadata": meta,
             "spec": {"selector": labels,
                      "ports": [{"port": dep.router.port, "targetPort": ROUTER_PORT}]}}]


def _rbg_role(dep: Deployment, group: Group) -> dict[str, Any]:
    """A prefill or decode role. A multi-node instance is a LeaderWorkerSet workload (RBG's
    ``workload`` + ``leaderWorkerSet``): every pod runs the same argv, its node rank from LWS's
    ``$(LWS_WORKER_INDEX)`` and the first node's address from ``$(LWS_LEADER_ADDRESS)``; only
    the leader's patch adds the ports and the probe (a worker pod serves no HTTP)."""
    multi = group.nnodes > 1
    address = word(Var("LWS_LEADER_ADDRESS"))
    rank = Var("LWS_WORKER_INDEX") if multi else 0
    spec = _server(group, 0, address, rank, address)
    command = server_command(dep, group, spec, "0.0.0.0", "python3")
    ports = [SERVER_PORT] + ([BOOTSTRAP_PORT] if group.role == "prefill" else [])
    name = f"sglang-{group.role}"
    container = _container(dep, name, command, [] if multi else ports, _gpus(dep, group))
    role: dict[str, Any] = {"name": group.role, "replicas": group.count,
                            "template": {"spec": {"containers": [container],
                                                  "volumes": _volumes(dep)}}}
    if multi:
        served = _container(dep, name, command, ports, _gpus(dep, group))
        role["workload"] = {"apiVersion": "leaderworkerset.x-k8s.io/v1",
                            "kind": "LeaderWorkerSet"}
        role["leaderWorkerSet"] = {"size": group.nnodes, "patchLeaderTemplate": {
            "spec": {"containers": [{"name": name, "ports": served["ports"],
                                     "readinessProbe": served["readinessProbe"]}]}}}
    return role


def rbg(dep: Deployment) -> list[dict[str, Any]]:
    """One RoleBasedGroup: router, prefill and decode roles."""
    dep = in_cluster(dep)
    group_name = dep.kubernetes.name
    roles: list[dict[str, Any]] = []
    urls: dict[str, list[Arg]] = {"prefill": [], "decode": []}
    for group in dep.groups():
        roles.append(_rbg_role(dep, group))
        for index in range(group.count):  # RBG names pods GROUP-ROLE-i behind s-GROUP-ROLE
            urls[group.role].append(
                f"http://{group_name}-{group.role}-{index}.s-{group_name}-{group.role}"
                f":{SERVER_PORT}")
    command = _router(dep, urls["prefill"], urls["decode"], ROUTER_PORT, "python3")
    router = {"name": "router", "replicas": 1, "dependencies": ["prefill", "decode"],
              "template": {"spec": {"containers": [
                  _container(dep, "omniproxy", command, [ROUTER_PORT], 0, server=False)]}}}
    return [{"apiVersion": "workloads.x-k8s.io/v1alpha1", "kind": "RoleBasedGroup",
             "metadata": {"name": group_name, "namespace": dep.kubernetes.namespace},
             "spec": {"roles": [router, *roles]}}]


def manifests_yaml(docs: list[dict[str, Any]]) -> str:
    import yaml

    return yaml.safe_dump_all(docs, sort_keys=False, width=100)
