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
      image: omniinfer-sglang:0.1.0   # built by deploy/Dockerfile (SGLang's image + this)
      namespace: default
      gpus_per_node: 8
      name: omniinfer          # a DNS-1035 label of at most 40 characters
      model_pvc: models        # optional: this claim at /models; a relative model is under it
      shm_size: 16Gi           # /dev/shm of each server pod (memory)

The file is untrusted input (``safe_yaml``: at most 1 MiB of UTF-8, no anchors, aliases or
duplicate keys), and every value is bounded: ``count`` <= 256 instances per role, ``nnodes``
<= 256, at most 1024 server nodes in all, ``tp``/``ep`` <= 4096, ``gpus_per_node`` <= 64,
``max_total_tokens`` < 2**31, text values at most 1024 characters without control characters
or line breaks, ``args`` at most 128 entries and 8192 characters. A value from the file is
always data: ``commands`` quotes or escapes it wherever it goes and never lets a shell or the
kubelet read it as code. Every refusal is one ``DeployError`` line, values in it shortened.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from omniinfer.deploy.safe_yaml import MAX_FILE_BYTES as MAX_FILE_BYTES  # the size cap
from omniinfer.deploy.safe_yaml import Refused, printable, read, show

DEVICES = ("cpu", "gpu", "npu")
TRANSFER_BACKENDS = ("mooncake", "mooncake_tcp", "nixl", "ascend", "mori", "fake")

MAX_INSTANCES = 256  # count, per role
MAX_NODES = 256  # nnodes, per instance
MAX_SERVER_NODES = 1024  # count x nnodes, prefill and decode together
MAX_PARALLEL = 4096  # tp, ep
MAX_GPUS_PER_NODE = 64
MAX_TOTAL_TOKENS = 2**31 - 1
MAX_TEXT_CHARS = 1024  # any text value, one args entry included
MAX_ARGS = 128  # entries of one args list
MAX_ARGS_CHARS = 8192  # characters of one args list, all entries
MAX_NAME_CHARS = 40  # kubernetes.name: NAME-prefill-I-J and s-NAME-decode stay valid names
# RFC 1035 label (Services, hence kubernetes.name) and RFC 1123 label (namespaces)
DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
QUANTITY = re.compile(r"[1-9][0-9]{0,5}(Ki|Mi|Gi|Ti)")
IMAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@-]*")
MAX_IMAGE_CHARS = 512


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
    image: str = "omniinfer-sglang:0.1.0"  # deploy/Dockerfile: lmsysorg/sglang:v0.5.23 + this
    namespace: str = "default"
    gpus_per_node: int = 8
    name: str = "omniinfer"
    model_pvc: str | None = None  # a PersistentVolumeClaim mounted read-only at /models
    shm_size: str = "16Gi"  # the /dev/shm emptyDir (memory) of every server pod


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
    """Read and check a deployment file; any problem is one ``DeployError`` line."""
    source = printable(str(path))
    try:
        data = read(path)
    except Refused as exc:
        raise DeployError(f"{source}: {exc}") from None
    return parse(data, source)


def parse(data: Any, source: str = "<deployment>") -> Deployment:
    """A checked ``Deployment`` from the decoded YAML."""
    top = _Mapping(data, source, "")
    model = top.take("model", str, required=True)
    if not model:
        raise DeployError(f"{top.where('model')}: must not be empty")
    device = top.take("device", str, default="cpu", choices=DEVICES)
    backend = top.take("transfer_backend", str,
                       default="mooncake_tcp" if device == "cpu" else "mooncake",
                       choices=TRANSFER_BACKENDS)
    max_total = top.take("max_total_tokens", int, default=None, minimum=1,
                         maximum=MAX_TOTAL_TOKENS)
    groups = [_group(top.sub(role, required=True), role) for role in ("prefill", "decode")]
    nodes = sum(g.count * g.nnodes for g in groups)
    if nodes > MAX_SERVER_NODES:
        raise DeployError(f"{source}: prefill and decode: {nodes} server nodes in all (count x "
                          f"nnodes), more than the {MAX_SERVER_NODES} a deployment may have")
    router = _router(top.sub("router"))
    kube = _kube(top.sub("kubernetes"))
    top.done()
    return Deployment(model, groups[0], groups[1], router, device, backend, max_total, kube,
                      source)


def _group(m: _Mapping, role: str) -> Group:
    count = m.take("count", int, default=1, minimum=1, maximum=MAX_INSTANCES)
    tp = m.take("tp", int, default=1, minimum=1, maximum=MAX_PARALLEL)
    ep = m.take("ep", int, default=1, minimum=1, maximum=MAX_PARALLEL)
    nnodes = m.take("nnodes", int, default=1, minimum=1, maximum=MAX_NODES)
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
    from omniinfer.proxy.policy_api import available_policies

    known = available_policies()
    for key, name in (("prefill_policy", prefill), ("decode_policy", decode)):
        if name not in known:
            where = key if key in m.data else "policy"
            raise DeployError(f"{m.where(where)}: unknown policy {show(name)} (one of "
                              f"{', '.join(known)})")
    return RouterSpec(port, prefill, decode, args)


def _kube(m: _Mapping) -> KubeSpec:
    spec = KubeSpec(m.take("image", str, default=KubeSpec.image),
                    m.take("namespace", str, default=KubeSpec.namespace),
                    m.take("gpus_per_node", int, default=KubeSpec.gpus_per_node, minimum=0,
                           maximum=MAX_GPUS_PER_NODE),
                    m.take("name", str, default=KubeSpec.name),
                    m.take("model_pvc", str, default=None),
                    m.take("shm_size", str, default=KubeSpec.shm_size))
    m.done()
    if spec.model_pvc is not None and (not DNS1123_SUBDOMAIN.fullmatch(spec.model_pvc)
                                       or len(spec.model_pvc) > 253):
        raise DeployError(f"{m.where('model_pvc')}: must be a PersistentVolumeClaim name; got "
                          f"{show(spec.model_pvc)}")
    if not QUANTITY.fullmatch(spec.shm_size):
        raise DeployError(f"{m.where('shm_size')}: must be a memory quantity like 16Gi; got "
                          f"{show(spec.shm_size)}")
    if not DNS1035_LABEL.fullmatch(spec.name) or len(spec.name) > MAX_NAME_CHARS:
        raise DeployError(f"{m.where('name')}: must be a Kubernetes name: lower-case letters, "
                          "digits and '-', starting with a letter, ending with a letter or "
                          f"digit, at most {MAX_NAME_CHARS} characters; got {show(spec.name)}")
    if not DNS1123_LABEL.fullmatch(spec.namespace) or len(spec.namespace) > 63:
        raise DeployError(f"{m.where('namespace')}: must be a Kubernetes namespace: lower-case "
                          "letters, digits and '-', starting and ending with a letter or digit, "
                          f"at most 63 characters; got {show(spec.namespace)}")
    if not IMAGE.fullmatch(spec.image) or len(spec.image) > MAX_IMAGE_CHARS:
        raise DeployError(f"{m.where('image')}: must be an image reference (letters, digits, "
                          f"'._/:@-', at most {MAX_IMAGE_CHARS} characters); got "
                          f"{show(spec.image)}")
    return spec


def _text_problem(value: str) -> str | None:
    """Why a text value from the file cannot go into a command line, or None."""
    if len(value) > MAX_TEXT_CHARS:
        return f"longer than {MAX_TEXT_CHARS} characters"
    bad = next((c for c in value if not c.isprintable() and c != " "), None)
    if bad is not None:
        return (f"a control character or line break ({bad!r}) cannot go into a command "
                "line")
    return None


_KEY = re.compile(r"[A-Za-z0-9_.-]{1,40}")


class _Mapping:
    """One mapping of the file, its keys taken one by one; ``done`` refuses what is left."""

    def __init__(self, data: Any, source: str, prefix: str) -> None:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise DeployError(f"{source}: {prefix.rstrip('.') or 'the file'}: must be a mapping")
        self.data, self.source, self.prefix = data, source, prefix
        self.seen: set[str] = set()

    def where(self, key: Any) -> str:
        shown = key if isinstance(key, str) and _KEY.fullmatch(key) else show(key)
        return f"{self.source}: {self.prefix}{shown}"

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
            raise DeployError(f"{self.where(key)}: must be {kind.__name__}, got {show(value)}")
        if choices is not None and value not in choices:
            raise DeployError(f"{self.where(key)}: must be one of {', '.join(choices)}, "
                              f"got {show(value)}")
        if minimum is not None and value < minimum:
            raise DeployError(f"{self.where(key)}: must be >= {minimum}, got {show(value)}")
        if maximum is not None and value > maximum:
            raise DeployError(f"{self.where(key)}: must be <= {maximum}, got {show(value)}")
        if isinstance(value, str) and (problem := _text_problem(value)) is not None:
            raise DeployError(f"{self.where(key)}: {problem}")
        return value

    def take_args(self, key: str) -> tuple[str, ...]:
        value = self.take(key, list, default=[])
        if len(value) > MAX_ARGS:
            raise DeployError(f"{self.where(key)}: more than {MAX_ARGS} entries")
        if not all(isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in value):
            raise DeployError(f"{self.where(key)}: a list of flags and values (strings)")
        args = tuple(str(a) for a in value)
        for index, arg in enumerate(args):
            if (problem := _text_problem(arg)) is not None:
                raise DeployError(f"{self.where(key)}[{index}]: {problem}")
        if sum(len(a) for a in args) > MAX_ARGS_CHARS:
            raise DeployError(f"{self.where(key)}: more than {MAX_ARGS_CHARS} characters in all")
        return args

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.seen, key=str)
        if unknown:
            raise DeployError(f"{self.where(unknown[0])}: unknown key (known: "
                              f"{', '.join(sorted(self.seen))})")
