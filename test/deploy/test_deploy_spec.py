"""The deployment file: every key checked with one error naming it; renders that Kubernetes
would accept (checked against the published CRD schemas) and command lines SGLang parses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from omniinfer.deploy import render
from omniinfer.deploy.spec import DeployError, load, parse

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "omni-1p1d-cpu.yaml"
SCHEMAS = ROOT / "test" / "data" / "k8s"


def _base(**changes: Any) -> dict[str, Any]:
    data = yaml.safe_load(EXAMPLE.read_text())
    data.update(changes)
    return data


@pytest.mark.parametrize(("change", "message"), [
    ({"modle": "x"}, "modle: unknown key"),
    ({"model": 3}, "model: must be str"),
    ({"prefill": {"count": 0}}, "prefill.count: must be >= 1"),
    ({"prefill": {"count": "two"}}, "prefill.count: must be int"),
    ({"decode": {"tp": 1, "ep": 2}}, "decode.ep: must not exceed tp"),
    ({"decode": {"omni_placement": True}}, "decode.omni_placement: needs expert parallelism"),
    ({"decode": {"flags": []}}, "decode.flags: unknown key"),
    ({"router": {"policy": "fastest"}}, "router.policy: unknown policy 'fastest'"),
    ({"router": {"port": 70000}}, "router.port: must be <= 65535"),
    ({"device": "tpu"}, "device: must be one of cpu, gpu, npu"),
    ({"prefill": [1, 2]}, "prefill: must be a mapping"),
    ({"kubernetes": {"name": "Omni_Infer"}}, "kubernetes.name: must be a Kubernetes name"),
])
def test_a_bad_file_gets_one_error_naming_the_key(change: dict[str, Any], message: str) -> None:
    data = _base(**change)
    with pytest.raises(DeployError) as err:
        parse(data, "d.yaml")
    assert str(err.value).startswith("d.yaml: ") and message in str(err.value)
    assert "\n" not in str(err.value)
    without_model = _base()
    del without_model["model"]
    with pytest.raises(DeployError, match="model: required"):
        parse(without_model, "d.yaml")


def test_the_cli_prints_one_line_for_a_bad_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: m\nprefill: {count: 1}\ndecode: {count: 1, tpp: 2}\n")
    done = subprocess.run([sys.executable, "-m", "omniinfer", "deploy", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"omniinfer deploy: error: {bad}: decode.tpp: unknown key (known: args, count, ep, "
        "nnodes, omni_attn_pattern, omni_placement, tp)"]
    bad.write_text("model: [unclosed\n")
    done = subprocess.run([sys.executable, "-m", "omniinfer", "deploy", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "not valid YAML" in done.stderr


def _multinode() -> Any:
    return parse(_base(device="gpu", transfer_backend="mooncake",
                       prefill={"count": 2, "tp": 16, "ep": 16, "nnodes": 2,
                                "omni_attn_pattern": "/patterns/p.json"},
                       decode={"count": 1, "tp": 8, "ep": 8, "omni_placement": True,
                               "omni_attn_pattern": "/patterns/p.json"}), "m.yaml")


def _schema(name: str) -> dict[str, Any]:
    return json.loads((SCHEMAS / name).read_text())["openAPIV3Schema"]


@pytest.mark.parametrize("dep_kind", ["single", "multi"])
def test_lws_and_rbg_manifests_validate_against_the_published_crds(dep_kind: str) -> None:
    dep = load(EXAMPLE) if dep_kind == "single" else _multinode()
    lws_docs = render.lws(dep)
    kinds = [d["kind"] for d in lws_docs]
    assert kinds == ["LeaderWorkerSet", "LeaderWorkerSet", "Deployment", "Service"]
    validator = jsonschema.Draft7Validator(_schema("leaderworkerset-v1.schema.json"))
    for doc in lws_docs[:2]:
        errors = [e.message for e in validator.iter_errors(doc)]
        assert not errors, errors
    rbg_docs = render.rbg(dep)
    errors = [e.message for e in jsonschema.Draft7Validator(
        _schema("rolebasedgroup-v1alpha1.schema.json")).iter_errors(rbg_docs[0])]
    assert not errors, errors
    router = lws_docs[2]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert router[:3] == ["python3", "-m", "omniinfer.router"]  # argv: no shell in the pod
    assert "--pd-disaggregation" in router and router.count("--prefill") == dep.prefill.count
    if dep_kind == "multi":
        prefill = lws_docs[0]["spec"]["leaderWorkerTemplate"]
        assert prefill["size"] == 2 and "leaderTemplate" in prefill
        worker = prefill["workerTemplate"]["spec"]["containers"][0]["command"]
        assert worker[worker.index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"
        assert worker[worker.index("--dist-init-addr") + 1] == "$(LWS_LEADER_ADDRESS):20000"
        assert "--enable-omni-placement" in lws_docs[1]["spec"]["leaderWorkerTemplate"][
            "workerTemplate"]["spec"]["containers"][0]["command"]


def test_a_manifest_the_crd_refuses_is_caught() -> None:
    """The check has teeth: a wrong type and a missing required field fail it."""
    doc = render.lws(load(EXAMPLE))[0]
    doc["spec"]["replicas"] = "two"
    del doc["spec"]["leaderWorkerTemplate"]
    validator = jsonschema.Draft7Validator(_schema("leaderworkerset-v1.schema.json"))
    assert len(list(validator.iter_errors(doc))) == 2


def test_rendered_command_lines_parse_as_sglang_server_args() -> None:
    """Every server line of the render is accepted by SGLang 0.5.23's own parser (with the
    plugin's flags), placeholders filled in; the router line by the router's parser."""
    script = r'''
import shlex, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import ServerArgs
import argparse
from omniinfer.proxy.cli import add_arguments, resolve
lines = [l for l in sys.stdin.read().splitlines() if l and not l.startswith("#")]
for line in lines:
    line = line.replace("${PREFILL_0_HOST}", "10.0.0.1").replace("${DECODE_0_HOST}", "10.0.0.2")
    argv = shlex.split(line)
    if argv[2] == "sglang.launch_server":
        p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p)
        ns = p.parse_args(argv[3:])
        print("server", ns.disaggregation_mode, ns.omni_attn_pattern, ns.tp_size, ns.ep_size,
              ns.enable_omni_placement, ns.ep_num_redundant_experts)
    else:
        p = argparse.ArgumentParser(); add_arguments(p)
        print("router", resolve(p.parse_args(argv[3:])).pd_disaggregation)
'''
    text = render.commands(load(EXAMPLE))
    done = subprocess.run([sys.executable, "-c", script], input=text, capture_output=True,
                          text=True, timeout=300, env={**__import__("os").environ,
                                                       "SGLANG_USE_CPU_ENGINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    pattern = "python/omniinfer/attn/patterns/smollm2-135m-moe.json"
    system = f"{pattern} 2 2 True 2"  # the whole system: pattern, tp 2, ep 2, placement
    assert done.stdout.split("\n")[:3] == [f"server prefill {system}",
                                            f"server decode {system}", "router True"]


def test_local_servers_get_the_cpu_engine_only_on_a_cpu(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A gpu deployment's servers keep this process's environment (PATH, CUDA settings) and
    are not switched to the CPU engine; a cpu one's are, with a thread binding per TP rank."""
    from omniinfer.deploy.local import Local

    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    monkeypatch.setenv("DEPLOY_TEST_MARK", "kept")
    gpu = Local(parse(_base(device="gpu", prefill={"tp": 2}), "g.yaml"), tmp_path)
    for _, process in gpu.servers:
        assert process.env.get("DEPLOY_TEST_MARK") == "kept"
        assert "SGLANG_USE_CPU_ENGINE" not in process.env
        assert "--device" not in process.command
    cpu = Local(parse(_base(prefill={"tp": 2}), "c.yaml"), tmp_path)
    prefill = cpu.servers[0][1]
    assert prefill.env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert "SGLANG_CPU_OMP_THREADS_BIND" in prefill.env
    assert prefill.env.get("DEPLOY_TEST_MARK") == "kept"
