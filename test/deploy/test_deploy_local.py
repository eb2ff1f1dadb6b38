"""``omniinfer deploy FILE`` on this machine: the whole system from the shipped file
(``deploy/omni-1p1d-cpu.yaml``: SmolLM2-MoE 1P1D, two expert-parallel ranks per server with two
redundant expert slots, the OmniAttn pattern and OmniPlacement on both, OmniProxy oas in
front), started once for the module:

- it serves through the router, ``scripts/demo.sh --attach`` against it prints an answer, the
  table and a line per technique, and migrations are adopted (the demo's traffic);
- after those migrations, greedy outputs equal the dense SmolLM2's in transformers token for
  token (short prompts: nothing to evict) and, for a prompt longer than sink + window, the dense
  model's under the pattern (the masked evaluator, which ``test_attn_equivalence`` pins to a
  really evicting cache); weights crossed ranks; the prefill sends only sink +
  window for compressed layers; the decode server ends up holding nothing;
- Ctrl-C stops every process.

One system start serves all three: the demo starts its own deployment through the same
``deploy.local.Local`` as ``omniinfer deploy``.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import omniinfer.data
from omni_testing import ROOT, hf_greedy, post_json, wait_until
from omniinfer.child_process import free_port

pytestmark = pytest.mark.server
EXAMPLE = ROOT / "deploy" / "omni-1p1d-cpu.yaml"
DENSE = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
TEXTS = ["O Romeo, Romeo! wherefore art thou Romeo? " * 2, "Now is the winter of our discontent",
         "To be, or not to be, that is the question"]
NEW_TOKENS = 12
ROUNDS = 3  # 9 + 1 requests one after the other: more prefill passes than the file's interval


def _closed(url: str) -> bool:
    host, port = url.rsplit("/", 1)[1].split(":")
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, int(port))) != 0


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The shipped file, with a free router port and a smaller pool, deployed once."""
    import yaml

    tmp = tmp_path_factory.mktemp("deploy")
    port = free_port()
    data = yaml.safe_load(EXAMPLE.read_text())
    if not (ROOT / data["model"] / "config.json").is_file():
        pytest.fail(f"{data['model']} is missing: scripts/setup.sh builds it")
    data["router"]["port"] = port
    data["max_total_tokens"] = 8192
    spec = tmp / "system.yaml"
    spec.write_text(yaml.safe_dump(data))
    proc = subprocess.Popen([sys.executable, "-m", "omniinfer", "deploy", str(spec),
                             "--log-dir", str(tmp / "logs")], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "deploy exited early:\n" + "".join(lines)
            lines.append(line)
            if line.startswith("serving;"):
                break
        urls = {ln.split(":", 1)[0]: ln.split()[1] for ln in lines
                if ln.split(":", 1)[0] in ("prefill-0", "decode-0", "router")}
        assert urls["router"] == f"http://127.0.0.1:{port}"
        yield {"proc": proc, "urls": urls, "spec": spec, "tmp": tmp, "data": data}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_deploy_serves_and_the_demo_attached_shows_every_technique(
        system: dict[str, Any]) -> None:
    urls = system["urls"]
    answer = post_json(urls["router"] + "/generate", {
        "text": "The capital of France is",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0}}, timeout=300)
    assert answer["meta_info"]["completion_tokens"] == 8
    assert _get(urls["decode-0"] + "/omni/attn")["enabled"] is True
    for role in ("prefill-0", "decode-0"):  # the controller runs on both servers
        status = _get(urls[role] + "/omni/placement")
        assert status["enabled"] is True and status["rank_count"] == 2, status
    output = system["tmp"] / "demo"
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "demo.sh"), "--attach", urls["router"], "--deployment",
         str(system["spec"]), "--output-dir", str(output), "--num-requests", "4",
         "--concurrency", "2", "--input-len", "64", "--output-len", "16"],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    demo_answer = next(line for line in lines if line.startswith("[demo] A:"))
    assert "Paris" in demo_answer
    assert "Requests per minute (QPM)" in result.stdout and "Completed / errors" in result.stdout
    assert "4 / 0" in result.stdout
    assert (output / "bench-summary.json").is_file()
    assert "OmniProxy (oas, PD mode) in front" in result.stdout
    assert "[demo] attached system left running" in result.stdout
    attn = next(line for line in lines if line.startswith("[demo] OmniAttn (decode server):"))
    assert "16 of 30 layers compressed" in attn
    sent = next(line for line in lines if line.startswith("[demo] OmniAttn (PD transfer):"))
    assert "% saved" in sent
    oas = next(line for line in lines if line.startswith("[demo] OmniProxy (OAS) decisions"))
    assert "prefill:" in oas and "decode:" in oas
    placement = next(line for line in lines
                     if line.startswith("[demo] OmniPlacement (decode server):"))
    assert int(placement.split(", ")[1].split()[0]) >= 1, placement  # migrations adopted
    assert system["proc"].poll() is None, "deploy stopped while the demo ran"


def _generate(router_url: str, ids: list[int]) -> list[int]:
    answer = post_json(router_url + "/generate", {"input_ids": ids, "sampling_params": {
        "max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}}, timeout=300)
    return answer["output_ids"]


def test_after_migrations_outputs_equal_the_dense_model_and_the_pattern_holds(
        system: dict[str, Any]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from omniinfer.attn import decode, masks
    from omniinfer.attn.pattern import load
    from omniinfer.testbed.pd_servers import wait_idle

    urls = system["urls"]
    pattern = load(ROOT / system["data"]["decode"]["omni_attn_pattern"])
    tokenizer = AutoTokenizer.from_pretrained(DENSE)
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    expected = [hf_greedy(DENSE, ids, NEW_TOKENS) for ids in prompts]
    text = (Path(omniinfer.data.__file__).parent / "text" / "paradise_lost.txt").read_text()
    long_ids = tokenizer.encode(text[8000:11200] + "\n\nWho is the speaker?",
                                add_special_tokens=False)  # 903 tokens: > sink + window
    assert len(long_ids) > pattern.sink + pattern.recent + NEW_TOKENS
    dense = AutoModelForCausalLM.from_pretrained(DENSE, dtype=torch.float32).eval()
    masks.use(dense)  # the masked evaluator, which test_attn_equivalence pins to an evicting cache
    long_expected = decode.masked_greedy(dense, long_ids, NEW_TOKENS, masks.windows_for(
        pattern.mask, pattern.sink, pattern.recent))
    assert long_expected != hf_greedy(DENSE, long_ids, NEW_TOKENS)  # the pattern matters here
    sent_before = _get(urls["prefill-0"] + "/omni/attn")["pd_transfer"] or {}
    for round_ in range(ROUNDS):
        for ids, want in zip(prompts, expected, strict=True):
            assert _generate(urls["router"], ids) == want, f"round {round_}"
    assert _generate(urls["router"], long_ids) == long_expected
    placement = _get(urls["decode-0"] + "/omni/placement")
    adopted = [m for m in placement["migrations"] if m["state"] == "adopted"]
    assert adopted, placement
    assert all(m["switched_at_pass"] > m["decided_at_pass"] for m in adopted)
    assert any(m["remote_copies"] > 0 for m in adopted)  # weights crossed ranks
    prefill_placement: dict[str, Any] = {}

    def prefill_decided() -> bool:  # the controller's thread writes its status after deciding
        prefill_placement.update(_get(urls["prefill-0"] + "/omni/placement"))
        return bool(prefill_placement["decisions"])

    assert wait_until(prefill_decided, timeout=10, step=0.2), json.dumps(prefill_placement)
    attn = _get(urls["decode-0"] + "/omni/attn")
    assert attn["enabled"] and attn["pattern"]["sink"] == pattern.sink
    sent: dict[str, float] = {}

    def sent_since() -> bool:  # the status file is rewritten twice a second
        now = _get(urls["prefill-0"] + "/omni/attn")["pd_transfer"] or {}
        sent.update({key: value - sent_before.get(key, 0) for key, value in now.items()
                     if isinstance(value, int | float)})
        return sent.get("requests", 0) >= ROUNDS * len(TEXTS) + 1

    assert wait_until(sent_since, timeout=10, step=0.2), sent
    assert sent["compressed_layer_bytes"] < sent["bytes_without_pattern"] - sent[
        "full_layer_bytes"]  # the long prompt's compressed layers sent sink + window only
    reading = wait_idle(urls["decode-0"], 60)
    assert not any(reading.values()), reading


def test_ctrl_c_stops_everything(system: dict[str, Any]) -> None:
    proc = system["proc"]
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 0
    assert all(_closed(url) for url in system["urls"].values()), system["urls"]
