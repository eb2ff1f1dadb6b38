"""KV bytes a real PD transfer moves per request, with the OmniAttn pattern and without.

Starts two real 1P1D pairs on this CPU (SmolLM2-135M, fp32, KV over Mooncake's TCP transport):
one with ``--omni-attn-pattern`` (the shipped pattern) on both servers, one without, each behind
its own OmniProxy (``oas``). The same prompts of about ``--tokens`` tokens (windows of
``paradise_lost.txt``) go through both; the figure compared is SGLang's own transfer size
(``sglang:kv_transfer_total_mb`` on each prefill server, which counts the pages every send
carried: full layers and, with the pattern, the compressed layers' sink + window), beside the
plugin's meter (``GET /omni/attn`` ``pd_transfer``) and the decode server's compressed-pool
use once the requests are decoding. Prints a table, writes ``results/omni_attn_transfer.json``.

    python benchmark/pd/omni_attn_transfer.py --tokens 2048 --requests 6   # ~4 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from tqdm import tqdm

import omniinfer.data
from omniinfer.child_process import free_port
from omniinfer.proxy.process import RouterProcess
from omniinfer.testbed.pd_servers import pd_server, router_args, started

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
PATTERN = ROOT / "python" / "omniinfer" / "attn" / "patterns" / "smollm2-135m.json"
TEXT = (Path(omniinfer.data.__file__).parent / "text" / "paradise_lost.txt").read_text()


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as r:
        return json.loads(r.read())


def transfer_mb(prefill_url: str) -> tuple[float, int]:
    """(sum, count) of SGLang's ``sglang:kv_transfer_total_mb`` histogram on a prefill server."""
    text = _get(prefill_url + "/metrics")
    total = sum(float(m) for m in re.findall(r"^sglang:kv_transfer_total_mb_sum\{[^}]*\} (\S+)",
                                             text, re.M))
    count = sum(int(float(m)) for m in re.findall(
        r"^sglang:kv_transfer_total_mb_count\{[^}]*\} (\S+)", text, re.M))
    return total, count


def prompts(tokens: int, n: int) -> list[str]:
    chars = int(tokens * 4.1)  # about 4 characters per SmolLM2 token on this verse
    return [TEXT[10000 + i * 9000: 10000 + i * 9000 + chars] for i in range(n)]


def run_pair(name: str, flags: list[str], texts: list[str], logs: Path) -> dict[str, Any]:
    prefill = pd_server(MODEL, "prefill", logs, 16384, flags, f"{name}-prefill")
    decode = pd_server(MODEL, "decode", logs, 16384, flags, f"{name}-decode")
    with started([prefill, decode]):
        args = [*router_args([prefill, decode]), "--prefill-policy", "oas", "--decode-policy",
                "oas", "--model-path", str(MODEL)]
        with RouterProcess(args, logs / f"{name}-router-{free_port()}.log") as router:
            before = transfer_mb(prefill.base_url)
            prompt_tokens = []
            for text in tqdm(texts, desc=name):
                answer = _post(router.base_url + "/generate", {
                    "text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
                prompt_tokens.append(answer["meta_info"]["prompt_tokens"])
            after = transfer_mb(prefill.base_url)
        attn = json.loads(_get(prefill.base_url + "/omni/attn"))
    requests = after[1] - before[1]
    return {"requests": requests, "prompt_tokens_mean": sum(prompt_tokens) / len(prompt_tokens),
            "sglang_transfer_mb_per_request": (after[0] - before[0]) / max(1, requests),
            "plugin_meter": attn.get("pd_transfer")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length (about)")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--out", default=str(HERE / "results" / "omni_attn_transfer.json"))
    args = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="omni-attn-transfer-"))
    texts = prompts(args.tokens, args.requests)
    plain = run_pair("no-pattern", ["--enable-metrics"], texts, logs)
    patterned = run_pair("pattern", ["--enable-metrics", "--omni-attn-pattern", str(PATTERN)],
                         texts, logs)
    saved = 1 - patterned["sglang_transfer_mb_per_request"] / plain[
        "sglang_transfer_mb_per_request"]
    result = {"tokens": args.tokens, "requests": args.requests, "pattern": PATTERN.name,
              "no_pattern": plain, "with_pattern": patterned, "saved_fraction": round(saved, 4)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'deployment':<12} {'prompt tokens':>13} {'MB per request (SGLang)':>24}")
    for name, row in (("no pattern", plain), ("pattern", patterned)):
        print(f"{name:<12} {row['prompt_tokens_mean']:>13.0f} "
              f"{row['sglang_transfer_mb_per_request']:>24.3f}")
    print(f"transferred bytes saved by the pattern: {100 * saved:.1f} %")
    print(f"plugin meter (pattern prefill): {patterned['plugin_meter']}")
    print("logs:", logs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
