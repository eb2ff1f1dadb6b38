"""The deployment file: one model, prefill and decode groups, a transfer backend, a router.

A YAML mapping, every key checked (an unknown or ill-typed key is one ``DeployError`` naming
it, as ``FILE: prefill.tp: ...``)::

    model: .cache/models/SmolLM2-135M-Instruct   # path or hub id, as --model-path takes it
    device: cpu                # cpu: the CPU engine's flags are added; gpu / npu: none
    transfer_backend: mooncake_tcp
    max_total_tokens: 16384    # per server (optional)
    prefill:
      count: 1                 # instances
      tp: 1                    # --tp per instance
      ep: 1                    # --ep per instance (expert parallelism)
      nnodes: 1                # nodes per instance (multi-node render only)
      omni_attn_pattern: python/omniinfer/attn/patterns/smollm2-135m.json
      omni_placement: false    # --enable-omni-placement
      args: []                 # further sglang.launch_server flags, verbatim
    decode: {count: 1, omni_attn_pattern: ...}
    router:
      port: 8000
      policy: oas              # or prefill_policy / decode_policy
      args: []                 # further python -m omniinfer.router flags
    kubernetes:                # the render only
      image: lmsysorg/sglang:v0.5.23
      namespace: default
      gpus_per_node: 8
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

DEVICES = ("cpu", "gpu", "npu")
TRANSFER_BACKENDS = ("mooncake", "mooncake_tcp", "nixl", "ascend", "mori", "fake")


class DeployError(ValueError):
    """A deployment file that cannot be used; the message names the file and the key."""


@dataclasses.dataclass(frozen=True)
class Group:
    """The prefill or the decode servers: how many, how each is parallelised, its omni flags."""

    role: str
    count: int = 1
    tp: int = 1
    ep: int = 1
    nnodes: int = 1
    omni_attn_pattern: str | None = None
    omni_placement: bool = False
    args: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class RouterSpec:
    port: int = 8000
    prefill_policy: str = "oas"
    decode_policy: str = "oas"
    args: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class KubeSpec:
    image: str = "lmsysorg/sglang:v0.5.23"
    namespace: str = "default"
    gpus_per_node: int = 8
    name: str = "omniinfer"


@dataclasses.dataclass(frozen=True)
class Deployment:
    model: str
    prefill: Group
    decode: Group
    router: RouterSpec
    device: str = "cpu"
    transfer_backend: str = "mooncake_tcp"
    max_total_tokens: int | None = None
    kubernetes: KubeSpec = KubeSpec()
    source: str = "<deployment>"

    def groups(self) -> tuple[Group, Group]:
        return self.prefill, self.decode


def load(path: str | Path) -> Deployment:
    """Read and check a deployment file."""
    import yaml

    source = str(path)
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise DeployError(f"{source}: cannot read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise DeployError(f"{source}: not valid YAML{where}") from None
    return parse(data, source)


def parse(data: Any, source: str = "<deployment>") -> Deployment:
    """A checked ``Deployment`` from the decoded YAML."""
    top = _Mapping(data, source, "")
    model = top.take("model", str, required=True)
    device = top.take("device", str, default="cpu", choices=DEVICES)
    backend = top.take("transfer_backend", str,
                       default="mooncake_tcp" if device == "cpu" else "mooncake",
                       choices=TRANSFER_BACKENDS)
    max_total = top.take("max_total_tokens", int, default=None, minimum=1)
    groups = [_group(top.sub(role, required=True), role) for role in ("prefill", "decode")]
    router = _router(top.sub("router"))
    kube = _kube(top.sub("kubernetes"))
    top.done()
    return Deployment(model, groups[0], groups[1], router, device, backend, max_total, kube,
                      source)


def _group(m: _Mapping, role: str) -> Group:
    count = m.take("count", int, default=1, minimum=1)
    tp = m.take("tp", int, default=1, minimum=1)
    ep = m.take("ep", int, default=1, minimum=1)
    nnodes = m.take("nnodes", int, default=1, minimum=1)
    pattern = m.take("omni_attn_pattern", str, default=None)
    placement = m.take("omni_placement", bool, default=False)
    args = m.take_args("args")
    m.done()
    if ep > tp:
        raise DeployError(f"{m.where('ep')}: must not exceed tp ({tp})")
    if placement and ep < 2:
        raise DeployError(f"{m.where('omni_placement')}: needs expert parallelism (ep >= 2)")
    return Group(role, count, tp, ep, nnodes, pattern, placement, args)


def _router(m: _Mapping) -> RouterSpec:
    port = m.take("port", int, default=8000, minimum=1, maximum=65535)
    policy = m.take("policy", str, default="oas")
    prefill = m.take("prefill_policy", str, default=policy)
    decode = m.take("decode_policy", str, default=policy)
    args = m.take_args("args")
    m.done()
    from omniinfer.proxy.base import available_policies

    known = available_policies()
    for key, name in (("prefill_policy", prefill), ("decode_policy", decode)):
        if name not in known:
            where = key if key in m.data else "policy"
            raise DeployError(f"{m.where(where)}: unknown policy {name!r} (one of "
                              f"{', '.join(known)})")
    return RouterSpec(port, prefill, decode, args)


def _kube(m: _Mapping) -> KubeSpec:
    spec = KubeSpec(m.take("image", str, default=KubeSpec.image),
                    m.take("namespace", str, default=KubeSpec.namespace),
                    m.take("gpus_per_node", int, default=KubeSpec.gpus_per_node, minimum=0),
                    m.take("name", str, default=KubeSpec.name))
    m.done()
    if not spec.name.replace("-", "").isalnum() or not spec.name.islower():
        raise DeployError(f"{m.where('name')}: a Kubernetes name (lower case, digits, '-')")
    return spec


class _Mapping:
    """One mapping of the file, its keys taken one by one; ``done`` refuses what is left."""

    def __init__(self, data: Any, source: str, prefix: str) -> None:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise DeployError(f"{source}: {prefix.rstrip('.') or 'the file'}: must be a mapping")
        self.data, self.source, self.prefix = data, source, prefix
        self.seen: set[str] = set()

    def where(self, key: str) -> str:
        return f"{self.source}: {self.prefix}{key}"

    def sub(self, key: str, required: bool = False) -> _Mapping:
        self.seen.add(key)
        if required and key not in self.data:
            raise DeployError(f"{self.where(key)}: required")
        return _Mapping(self.data.get(key), self.source, f"{self.prefix}{key}.")

    def take(self, key: str, kind: type, *, required: bool = False, default: Any = None,
             choices: tuple[str, ...] | None = None, minimum: int | None = None,
             maximum: int | None = None) -> Any:
        self.seen.add(key)
        if key not in self.data:
            if required:
                raise DeployError(f"{self.where(key)}: required")
            return default
        value = self.data[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise DeployError(f"{self.where(key)}: must be {kind.__name__}, got {value!r}")
        if choices is not None and value not in choices:
            raise DeployError(f"{self.where(key)}: must be one of {', '.join(choices)}, "
                              f"got {value!r}")
        if minimum is not None and value < minimum:
            raise DeployError(f"{self.where(key)}: must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise DeployError(f"{self.where(key)}: must be <= {maximum}, got {value}")
        return value

    def take_args(self, key: str) -> tuple[str, ...]:
        value = self.take(key, list, default=[])
        if not all(isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in value):
            raise DeployError(f"{self.where(key)}: a list of flags and values (strings)")
        return tuple(str(a) for a in value)

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.seen, key=str)
        if unknown:
            raise DeployError(f"{self.where(str(unknown[0]))}: unknown key (known: "
                              f"{', '.join(sorted(self.seen))})")
