"""Hardening, round three (review): Unicode spellings of a worker's address, secrets inside
JSON-encoded strings and URL userinfo in relayed info, cumulative load counters, an info route
that gives up after one hostile worker, and ``/health_generate`` amplification. Each test
fails on the router before the fix."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from router_inproc import ScriptedWorker, router_for

from omniinfer.proxy.redact import hidden, redact
from omniinfer.proxy.workers import WorkerLoads, normalize_url

USER, ADMIN = "sk-user-3b", "sk-admin-3b"
KEYS = [f"u1:app:user:{USER}", f"a1:ops:admin:{ADMIN}"]


def run(coro: Any, timeout: float = 120) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def _answer(data: Any, status: int = 200) -> Any:
    async def route(request: web.Request) -> web.Response:
        return web.json_response(data, status=status)
    return route


def _raw(body: bytes, status: int = 200) -> Any:
    async def route(request: web.Request) -> web.Response:
        return web.Response(body=body, status=status, content_type="application/json")
    return route


# 1. Unicode spellings ------------------------------------------------------------------------

UNICODE_HOSTS = ("http://１２７．０．０．１:30000", "http://ⓛocalhost:1", "http://127.0.0.1。:1",
                 "http://０．０．０．０:1", "http://ｌｏｃａｌｈｏｓｔ:1", "http://127.0.0.%31:1",
                 "http://loc%61lhost:1", "http://localhost..:1", "http://.localhost:1",
                 "http://a..b:1", "http://exämple.com:1")


@pytest.mark.parametrize("url", UNICODE_HOSTS)
def test_non_ascii_and_percent_encoded_hosts_are_refused(url: str) -> None:
    with pytest.raises(ValueError, match="not a worker URL"):
        normalize_url(url)


def test_one_trailing_dot_names_the_same_host() -> None:
    assert normalize_url("http://localhost.:30000") == "http://127.0.0.1:30000"
    assert normalize_url("http://127.0.0.1.:30000") == "http://127.0.0.1:30000"
    assert normalize_url("http://Worker-1.example.:8000") == "http://worker-1.example:8000"
    with pytest.raises(ValueError, match="unspecified"):
        normalize_url("http://0.0.0.0.:1")


def test_a_worker_cannot_be_added_again_under_a_unicode_spelling() -> None:
    async def main() -> None:
        async with router_for([ScriptedWorker()]) as (base, serving):
            port = int(serving.router.pool.all()[0].url.rsplit(":", 1)[1])
            wide = "".join(chr(ord(c) + 0xFEE0) for c in str(port))  # fullwidth digits
            spellings = (f"http://１２７．０．０．１:{port}", f"http://ⓛocalhost:{port}",
                         f"http://127.0.0.1。:{port}", f"http://localhost.:{port}",
                         f"http://127.0.0.1:{wide}", f"http://０．０．０．０:{port}")
            async with aiohttp.ClientSession() as s:
                for spelling in spellings:
                    async with s.post(base + "/add_worker", json={"url": spelling}) as r:
                        assert r.status == 400, (spelling, await r.text())
            assert len(serving.router.pool.all()) == 1
    run(main())


# 2. Redaction --------------------------------------------------------------------------------

NAMES = ("authorization", "basic_auth", "Proxy-Authorization", "oauth_client", "api_key",
         "hf_token", "token", "access_token", "client_secret", "db_password", "passwd",
         "aws_credentials", "max_total_num_tokens", "tokenizer_path", "author", "model_path")


def test_the_strict_view_hides_everything_the_full_view_hides() -> None:
    for name in NAMES:
        if hidden(name, strict=False):
            assert hidden(name, strict=True), name
    assert hidden("authorization", strict=True) and hidden("basic_auth", strict=True)


S3_SECRET, LOADER_SECRET, OVERRIDE_SECRET = "AKIA-s3-secret", "loader-secret", "override-secret"
URL_PASSWORD = "url-password-secret"


def _leaky_info() -> dict[str, Any]:
    return {
        "model_path": "m", "max_total_num_tokens": 4096,
        "authorization": "Basic dXNlcjpwYXNz", "basic_auth": "user:pass",
        "hicache_storage_backend_extra_config": json.dumps(
            {"endpoint": "s3.example", "access_key": S3_SECRET, "bucket": "b"}),
        "model_loader_extra_config": json.dumps({"nested": [{"secret_key": LOADER_SECRET}]}),
        "json_model_override_args": json.dumps({"hf_token": OVERRIDE_SECRET, "rope": 2}),
        "hicache_storage_backend": f"redis://admin:{URL_PASSWORD}@cache.local:6379/0",
        "internal_states": [{"download_dir": f"https://bob:{URL_PASSWORD}@hub.example/path",
                             "mirrors": [f"s3+https://k:{URL_PASSWORD}@a.b/c d",
                                         f"mongodb://u:p@ss{URL_PASSWORD}@h/x"]}],
    }


SECRETS = ("dXNlcjpwYXNz", "user:pass", S3_SECRET, LOADER_SECRET, OVERRIDE_SECRET, URL_PASSWORD)


def test_secrets_in_json_strings_and_url_userinfo_reach_no_one() -> None:
    info = _leaky_info()
    routes = {"/server_info": _answer(info), "/model_info": _answer(info)}

    async def main() -> None:
        async with router_for([ScriptedWorker(routes)], control_plane_api_keys=KEYS) as (base, _):
            async with aiohttp.ClientSession() as s:
                for key in (USER, ADMIN):
                    for path in ("/server_info", "/model_info"):
                        async with s.get(base + path,
                                         headers={"Authorization": f"Bearer {key}"}) as r:
                            raw = await r.text()
                            assert r.status == 200, raw
                        leaked = [x for x in SECRETS if x in raw]
                        assert leaked == [], (key, path, leaked)
                        view = json.loads(raw)
                        assert view["model_path"] == "m"
                        assert view["hicache_storage_backend"] == \
                            "redis://***@cache.local:6379/0"
                        assert view["internal_states"][0]["download_dir"] == \
                            "https://***@hub.example/path"
                        extra = view.get("hicache_storage_backend_extra_config")
                        if extra is not None:  # kept only without its secret
                            assert json.loads(extra) == {"endpoint": "s3.example", "bucket": "b"}
    run(main())


def test_redact_contracts_on_strings() -> None:
    assert redact("http://u:p@h:1/x", strict=False) == "http://***@h:1/x"
    assert redact("plain text with user@example.com", strict=False) == \
        "plain text with user@example.com"  # no scheme: not a URL
    assert redact("ftp://host/a@b", strict=True) == "ftp://host/a@b"  # @ past the authority
    kept = '{"a": 1,  "b": [1, 2]}'
    assert redact(kept, strict=True) == kept  # nothing hidden: the string is unchanged
    assert redact('["x", {"api_key": "k"}]', strict=False) == '["x",{}]'
    nested = json.dumps({"inner": json.dumps({"password": "pw", "x": 1})})
    assert "pw" not in redact(nested, strict=True)
    assert redact("{not json", strict=True) == "{not json"


# 4. Cumulative counters ----------------------------------------------------------------------

def test_a_30_day_cumulative_counter_passes_unchanged() -> None:
    thirty_days_us = 30 * 86_400 * 1_000_000  # 2.6e12 us: one rank busy for 30 days
    tokens = 40 * 10**12  # 40 T prefill tokens over a long life
    ranks = [{"total_prefill_busy_us": thirty_days_us,
              "total_prefill_uncached_tokens": tokens}] * 8
    loads = WorkerLoads.from_json({"loads": ranks}, 0.0)
    assert loads.prefill_busy_us == 8 * thirty_days_us
    assert loads.prefill_uncached_tokens == 8 * tokens
    assert float(loads.prefill_busy_us) == loads.prefill_busy_us  # exact in float64


# 5. Info routes try the next worker ----------------------------------------------------------

HONEST = {"object": "list", "data": [{"id": "honest-model", "object": "model"}]}


@pytest.mark.parametrize("hostile", ["too_large", "not_json", "error_500"])
def test_one_hostile_worker_does_not_break_v1_models(hostile: str) -> None:
    cap = 4096
    bad = {"too_large": _raw(b'{"data": "' + b"x" * (4 * cap) + b'"}'),
           "not_json": _raw(b"<html>nope</html>"),
           "error_500": _answer({"error": "down"}, status=500)}[hostile]
    first, second = ScriptedWorker({"/v1/models": bad}), ScriptedWorker({"/v1/models":
                                                                         _answer(HONEST)})

    async def main() -> None:
        async with router_for([first, second], max_response_size=cap) as (base, serving):
            assert first.server is not None  # the hostile worker is asked first
            assert serving.router.pool.all()[0].url.endswith(f":{first.server.port}")
            async with aiohttp.ClientSession() as s:
                for _ in range(3):
                    async with s.get(base + "/v1/models") as r:
                        body = await r.json()
                        assert r.status == 200, body
                        assert body == HONEST
        assert first.paths().count("/v1/models") == 3  # each worker once per request
        assert second.paths().count("/v1/models") == 3
    run(main())


def test_info_routes_answer_502_when_no_worker_gives_a_usable_answer() -> None:
    workers = [ScriptedWorker({"/v1/models": _raw(b"<html>")}),
               ScriptedWorker({"/v1/models": _raw(b"x" * 10_000)})]

    async def main() -> None:
        async with router_for(workers, max_response_size=4096) as (base, _):
            async with aiohttp.ClientSession() as s:
                async with s.get(base + "/v1/models") as r:
                    assert r.status == 502, await r.text()
                    assert (await r.json())["error"]["type"] == "upstream_error"
        assert [w.paths().count("/v1/models") for w in workers] == [1, 1]
    run(main())


# 6. /health_generate is shared ---------------------------------------------------------------

class Counting:
    """A /health_generate that takes a while and counts its calls."""

    def __init__(self, delay: float = 0.3) -> None:
        self.calls, self.delay = 0, delay

    async def __call__(self, request: web.Request) -> web.Response:
        self.calls += 1
        await asyncio.sleep(self.delay)
        return web.Response(status=200)


async def _flood(url: str, n: int = 50) -> list[int]:
    async with aiohttp.ClientSession() as s:
        async def one() -> int:
            async with s.get(url) as r:
                await r.read()
                return r.status
        return list(await asyncio.gather(*(one() for _ in range(n))))


def test_a_flood_of_anonymous_health_generate_calls_is_not_amplified() -> None:
    probe = Counting()

    async def main() -> None:
        async with router_for([ScriptedWorker({"/health_generate": probe})],
                              control_plane_api_keys=KEYS) as (base, _):
            statuses = await _flood(base + "/health_generate")
            assert statuses == [200] * 50
            assert probe.calls <= 2, probe.calls
            await asyncio.sleep(1.2)  # the shared answer expires
            assert await _flood(base + "/health_generate", 5) == [200] * 5
            assert 2 <= probe.calls <= 3, probe.calls
    run(main())


def test_pd_health_generate_flood_probes_each_worker_at_most_twice() -> None:
    probes = [Counting(), Counting(), Counting(), Counting()]
    prefills = [ScriptedWorker({"/health_generate": probes[0]}),
                ScriptedWorker({"/health_generate": probes[1]})]
    decodes = [ScriptedWorker({"/health_generate": probes[2]}),
               ScriptedWorker({"/health_generate": probes[3]})]

    async def main() -> None:
        p_urls = [await w.start() for w in prefills]
        d_urls = [await w.start() for w in decodes]
        try:
            async with router_for([], pd_disaggregation=True, worker_urls=[],
                                  prefill_urls=[(u, None) for u in p_urls],
                                  decode_urls=d_urls) as (base, _):
                statuses = await _flood(base + "/health_generate")
                assert statuses == [200] * 50
        finally:
            for w in prefills + decodes:
                await w.close()
        assert all(p.calls <= 2 for p in probes), [p.calls for p in probes]
    run(main())


def test_a_shared_health_generate_answer_is_still_redacted() -> None:
    async def leaky(request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "authorization": "Basic c2VjcmV0",
                                  "url": "https://u:pw@h.example/x"})

    async def main() -> None:
        async with router_for([ScriptedWorker({"/health_generate": leaky})],
                              control_plane_api_keys=KEYS) as (base, _):
            async with aiohttp.ClientSession() as s:
                for _ in range(2):  # the first asks the worker, the second reads the share
                    async with s.get(base + "/health_generate") as r:
                        assert await r.json() == {"ok": True, "url": "https://***@h.example/x"}
    run(main())


def test_no_secret_named_member_in_a_decoded_json_string() -> None:
    out = redact({"x_extra_config": json.dumps({"api_key": "k", "ok": 1})}, strict=True)
    assert not re.search("api_key", json.dumps(out))
