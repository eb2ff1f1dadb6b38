"""Hardening, round two: what an adversarial probe of the router found (large bodies cut at the
head timeout, a user key with admin powers, compressed-body memory bombs, clients that never
read, and the smaller holes). Each test fails on the router before the fix."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from router_inproc import ScriptedWorker, raw_exchange, router_for

from omniinfer.net import is_loopback
from omniinfer.proxy.auth import AccessControl
from omniinfer.proxy.workers import normalize_url

SLOW_S = 1.2


def run(coro: Any, timeout: float = 60) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def _status_and_json(raw: bytes) -> tuple[int, dict[str, str], Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        headers[k.strip().lower().decode()] = v.strip().decode()
    return int(lines[0].split()[1]), headers, json.loads(body) if body else None


async def _slow_generate(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    await asyncio.sleep(SLOW_S)
    if not body.get("stream"):
        return web.json_response({"text": "done", "meta_info": {"completion_tokens": 1}})
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    for i in range(40):  # a stream that keeps making progress past the head timeout
        await out.write(f"data: {json.dumps({'text': str(i)})}\n\n".encode())
        await asyncio.sleep(SLOW_S / 40)
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out


def test_a_large_body_with_a_slow_answer_is_not_cut_at_the_head_timeout() -> None:
    """Body bytes that arrived before aiohttp's handler task ran used to arm a head deadline
    that nothing cleared: the connection was closed at --client-header-timeout-secs."""
    async def main() -> None:
        worker = ScriptedWorker({"/generate": _slow_generate})
        async with router_for([worker], client_header_timeout_secs=0.4) as (base, serving):
            port = serving.router.config.port
            for stream in (False, True):
                body = (b'{"text": "hi",' + b" " * (1 << 20) +
                        b'"stream": ' + (b"true" if stream else b"false") +
                        b', "sampling_params": {"max_new_tokens": 1}}')
                request = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: "
                           b"application/json\r\nConnection: close\r\nContent-Length: " +
                           str(len(body)).encode() + b"\r\n\r\n" + body)
                started = time.monotonic()
                raw = await raw_exchange(port, request, timeout=20)
                assert time.monotonic() - started >= SLOW_S
                assert raw.startswith(b"HTTP/1.1 200"), raw[:200]
                if stream:
                    assert raw.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
                    assert raw.count(b"data:") == 41
            assert serving.listener.head_timeouts == 0
            # and a trickled head is still cut
            raw = await raw_exchange(port, b"POST /generate HTTP/1.1\r\nHost: x\r\n", timeout=5)
            assert raw == b"" and serving.listener.head_timeouts == 1
    run(main())


def test_user_keys_have_no_admin_powers_once_control_plane_keys_exist() -> None:
    access = AccessControl("sk-W", ["u1:app:user:sk-user"])
    for path in ("/add_worker", "/remove_worker", "/flush_cache", "/list_workers"):
        for key in ("sk-user", "sk-W"):  # from loopback too (a reverse proxy on the host)
            denied, _ = access.check(_request(path, key=key))
            assert denied is not None and denied.status == 403, (path, key)
        assert access.check(_request(path))[0].status == 401
    assert access.check(_request("/generate", key="sk-user"))[0] is None


def _request(path: str, key: str | None = None, remote: str = "127.0.0.1") -> Any:
    from unittest import mock

    from aiohttp.test_utils import make_mocked_request

    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: (
        (remote, 40000) if name == "peername" else default)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return make_mocked_request("POST", path, headers=headers, transport=transport)


def test_a_candidate_worker_is_not_shown_the_worker_key() -> None:
    async def main() -> None:
        known, candidate = ScriptedWorker(), ScriptedWorker()
        async with router_for([known], api_key="sk-W") as (base, serving):
            url = await candidate.start()
            async with aiohttp.ClientSession() as s:
                async with s.post(base + "/add_worker", json={"url": url},
                                  headers={"Authorization": "Bearer sk-W"}) as r:
                    assert r.status == 200, await r.text()
            probes = [h for _, path, h, _ in candidate.seen if path == "/health"]
            assert probes and all("Authorization" not in h for h in probes)
            await serving.router.check_health()  # accepted now: it gets the key
            assert candidate.seen[-1][2].get("Authorization") == "Bearer sk-W"
        await candidate.close()
    run(main())


def test_compressed_request_bodies_are_refused_before_they_inflate() -> None:
    async def main() -> None:
        worker = ScriptedWorker({"/generate": _slow_generate})
        async with router_for([worker]) as (base, serving):
            port = serving.router.config.port
            bomb = gzip.compress(b'{"text": "' + b" " * (48 << 20) + b'"}', 9)
            assert len(bomb) < 100_000
            for encoding, body in ((b"gzip", bomb), (b"deflate", b'{"text": "plain"}'),
                                   (b"identity, br", b'{"text": "x"}')):
                raw = await raw_exchange(port, b"POST /generate HTTP/1.1\r\nHost: x\r\n"
                                         b"Content-Encoding: " + encoding + b"\r\nContent-Length: "
                                         + str(len(body)).encode() + b"\r\n\r\n" + body)
                status, headers, answer = _status_and_json(raw)
                assert status == 415 and headers["content-type"] == "application/json"
                assert answer["error"]["code"] == 415 and "uncompressed" in \
                    answer["error"]["message"]
            assert "/generate" not in worker.paths()
            assert serving.listener.encoded_refused == 3
            # identity is no compression: forwarded as usual
            async with aiohttp.ClientSession() as s, s.post(
                    base + "/generate", data=b'{"text": "id"}',
                    headers={"Content-Encoding": "identity",
                             "Content-Type": "application/json"}) as r:
                assert r.status == 200
    run(main(), 120)


async def _endless_stream(request: web.Request) -> web.StreamResponse:
    await request.read()
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    event = b"data: " + json.dumps({"text": "x" * 4000}).encode() + b"\n\n"
    for _ in range(20_000):  # 80 MB: far more than every socket buffer on the way
        await out.write(event)
    return out


def test_a_client_that_never_reads_loses_its_slot_and_the_worker_is_told() -> None:
    async def main() -> None:
        worker = ScriptedWorker({"/generate": _endless_stream})
        async with router_for([worker], client_write_timeout_secs=0.5,
                              max_concurrent_requests=3, queue_size=0) as (base, serving):
            loop = asyncio.get_running_loop()
            socks = []
            body = b'{"text": "never read", "stream": true}'
            for _ in range(3):
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.setblocking(False)
                await loop.sock_connect(sock, ("127.0.0.1", serving.router.config.port))
                await loop.sock_sendall(sock, b"POST /generate HTTP/1.1\r\nHost: x\r\n"
                                        b"Content-Type: application/json\r\nContent-Length: " +
                                        str(len(body)).encode() + b"\r\n\r\n" + body)
                socks.append(sock)
            deadline = time.monotonic() + 30
            while (serving.router.admission.active or worker.paths().count("/abort_request") < 3
                   ) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert serving.router.admission.active == 0
            assert worker.paths().count("/abort_request") == 3
            assert serving.listener.write_timeouts == 3
            async with aiohttp.ClientSession() as s, s.get(base + "/list_workers") as r:
                workers = (await r.json())["workers"]
            assert [w["inflight_requests"] for w in workers] == [0]
            for sock in socks:
                sock.close()
    run(main(), 90)


async def _huge_answer(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"text": "y" * (4 << 20)})


def test_a_non_streamed_answer_over_the_cap_is_a_502_without_a_retry() -> None:
    async def main() -> None:
        a, b = ScriptedWorker({"/generate": _huge_answer}), ScriptedWorker({"/generate":
                                                                            _huge_answer})
        async with router_for([a, b], max_response_size=1 << 20, policy="round_robin") as (
                base, serving):
            async with aiohttp.ClientSession() as s, s.post(base + "/generate",
                                                            json={"text": "big"}) as r:
                assert r.status == 502
                answer = await r.json()
            assert "max-response-size" in answer["error"]["message"]
            assert (a.paths() + b.paths()).count("/generate") == 1  # not run twice
    run(main())


async def _failing(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(status=503, text="secret-internal-detail at 10.0.0.7")


def test_502_answers_name_no_worker_and_carry_no_worker_text() -> None:
    async def main() -> None:
        worker = ScriptedWorker({"/generate": _failing})
        async with router_for([worker]) as (base, serving):
            url = serving.router.pool.all()[0].url
            async with aiohttp.ClientSession() as s, s.post(base + "/generate",
                                                            json={"text": "x"}) as r:
                text = await r.text()
            assert r.status == 502 and "HTTP 503" in text
            assert url not in text and "secret" not in text and "127.0.0.1" not in text
    run(main())


def test_one_worker_cannot_be_registered_under_other_spellings() -> None:
    port = 38001
    spellings = [f"localhost:{port}", f"HTTP://127.0.0.1:{port}", f"http://127.0.0.1:0{port}",
                 f"http://[::ffff:127.0.0.1]:{port}", f"http://127.0.0.1:{port}/"]
    assert {normalize_url(u) for u in spellings} == {f"http://127.0.0.1:{port}"}
    assert normalize_url("https://Example.COM:443") == "https://example.com"
    assert normalize_url("http://[0:0::1]:80") == "http://[::1]"

    async def main() -> None:
        worker = ScriptedWorker()
        async with router_for([worker]) as (base, serving):
            known = serving.router.pool.all()[0].url
            port_text = known.rsplit(":", 1)[1]
            async with aiohttp.ClientSession() as s:
                for url in (f"localhost:{port_text}", known.upper(),
                            f"http://[::ffff:127.0.0.1]:0{port_text}"):
                    async with s.post(base + "/add_worker", json={"url": url}) as r:
                        assert r.status == 400 and "already" in (await r.text()), url
            assert len(serving.router.pool.all()) == 1
    run(main())


def test_ipv4_mapped_loopback_is_loopback() -> None:
    assert is_loopback("::ffff:127.0.0.1") and is_loopback("[::1]")
    assert not is_loopback("::ffff:10.0.0.1") and not is_loopback("")


def test_n_above_one_is_refused_where_sglang_reads_it_in_pd_mode() -> None:
    async def main() -> None:
        p, d = ScriptedWorker(), ScriptedWorker()
        p_url, d_url = await p.start(), await d.start()
        from router_inproc import free_port

        from omniinfer.proxy.config import RouterConfig
        from omniinfer.proxy.server import open_router

        port = free_port()
        serving = await open_router(RouterConfig(
            pd_disaggregation=True, prefill_urls=[(p_url, None)], decode_urls=[d_url],
            host="127.0.0.1", port=port, loads_poll_interval_secs=0, disable_health_check=True))
        try:
            base = f"http://127.0.0.1:{port}"
            bodies = [("/generate", {"text": "x", "sampling_params": {"n": 2}}),
                      ("/generate", {"text": ["x", "y"], "sampling_params": [{}, {"n": 3}]}),
                      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                "n": 2}),
                      ("/v1/completions", {"prompt": "x", "n": 2})]
            async with aiohttp.ClientSession() as s:
                for path, body in bodies:
                    async with s.post(base + path, json=body) as r:
                        assert r.status == 400, (path, body)
                        assert "PD mode" in (await r.json())["error"]["message"]
            assert not {"/generate", "/v1/chat/completions"} & set(p.paths() + d.paths())
        finally:
            await serving.close()
            await p.close()
            await d.close()
    run(main())


@pytest.mark.parametrize("raw", [
    b"GET / HTTP/1.1\r\nBad header line\r\n\r\n",
    b"POST /generate HTTP/1.1\r\nHost: x\r\nExpect: 200-ok\r\nContent-Length: 2\r\n\r\n{}",
    b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
])
def test_malformed_requests_get_one_json_answer(raw: bytes) -> None:
    async def main() -> None:
        async with router_for([ScriptedWorker()]) as (base, serving):
            out = await raw_exchange(serving.router.config.port, raw, timeout=10)
            status, headers, answer = _status_and_json(out)
            assert 400 <= status < 500 and headers["content-type"].startswith("application/json")
            assert answer["error"]["code"] == status
    run(main())


def test_a_kept_alive_connection_outlives_a_short_head_timeout() -> None:
    """Idle keep-alive was twice the head timeout: with a 1 s head timeout a client reusing
    its connection after 2 s lost its POST (found by the 20-minute soak)."""
    async def main() -> None:
        async with router_for([ScriptedWorker({"/generate": _small_answer})],
                              client_header_timeout_secs=1.0) as (base, serving):
            reader, writer = await asyncio.open_connection("127.0.0.1",
                                                           serving.router.config.port)
            request = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                       b"\r\nContent-Length: 13\r\n\r\n{\"text\": \"a\"}")
            for _ in range(2):
                writer.write(request)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                assert head.startswith(b"HTTP/1.1 200")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                await asyncio.sleep(2.5)  # idle past the old keep-alive, then reuse
            writer.close()
    run(main())


async def _small_answer(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"text": "ok"})


async def _done_then_slow_end(request: web.Request) -> web.StreamResponse:
    await request.read()
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    await out.write(b'data: {"text": "a", "meta_info": {"completion_tokens": 1}}\n\n')
    await out.write(b"data: [DONE]\n\n")
    await asyncio.sleep(0.5)  # the client has read [DONE] and gone before the stream ends
    await out.write_eof()
    return out


def test_a_client_that_leaves_after_done_got_its_whole_answer() -> None:
    """Streaming clients (the OpenAI SDK, bench_serving) stop reading at ``data: [DONE]`` and
    close the connection, often before the router writes the chunked terminator. That answer
    was delivered: it counts as a 200, and the worker is not told to abort a finished request."""

    async def main() -> None:
        worker = ScriptedWorker({"/generate": _done_then_slow_end})
        async with router_for([worker]) as (base, serving):
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", serving.router.config.port)
            body = b'{"text": "hi", "stream": true}'
            writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                         b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()
            seen = b""
            async with asyncio.timeout(10):
                while b"[DONE]" not in seen:
                    seen += await reader.read(4096)
            writer.close()
            await asyncio.sleep(1.0)  # the worker ends its stream; the router finishes
            async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
                metrics = await r.text()
            assert 'omniproxy_requests_total{endpoint="generate",status="200"} 1.0' in metrics
            assert 'status="499"' not in metrics
            assert "/abort_request" not in worker.paths()
            assert serving.router.admission.active == 0

    run(main())
