"""TLS: a TLS client reaches a TLS router, which reaches a worker that requires client
certificates (the emulator with SGLang's ``--ssl-*`` flags, mutual TLS); real handshakes with
certificates the test makes. A client without a certificate is refused by that worker, so is a
router without one, a plain-HTTP client by the TLS router, and a client that does not trust
the router's CA. Bad certificate flags are usage errors at start-up."""

from __future__ import annotations

import asyncio
import json
import ssl
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from proxy_helpers import sse_events
from tls_certs import CertAuthority

from omniinfer.child_process import free_port
from omniinfer.emulator.profile import load_profile
from omniinfer.emulator.server import WorkerServer
from omniinfer.emulator.tls import tls_context
from omniinfer.proxy.cli import main as router_main
from omniinfer.proxy.config import RouterConfig
from omniinfer.proxy.server import open_router


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("pki")
    ca, other = CertAuthority(folder, "ca"), CertAuthority(folder, "other-ca")
    return {"ca": ca.path, "other_ca": other.path, "router": ca.issue("router"),
            "worker": ca.issue("worker"), "router_client": ca.issue("router-client", server=False,
                                                                    client=True)}


async def _worker(pki: dict[str, Any], require_client: bool = True) -> WorkerServer:
    cert, key = pki["worker"]
    context = tls_context(str(cert), str(key), str(pki["ca"]) if require_client else None)
    server = WorkerServer(load_profile("cpu-smollm2"), free_port(), time_scale=0.02,
                          ssl_context=context)
    await server.start()
    return server


def _client_context(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


async def _generate(url: str, context: ssl.SSLContext | bool, n: int = 5) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/generate", ssl=context, json={
                "text": "hello over tls", "stream": True,
                "sampling_params": {"max_new_tokens": n}}) as resp:
            text = (await resp.read()).decode()
            return resp.status, sse_events(text) if resp.status == 200 else json.loads(text)


def _router_config(pki: dict[str, Any], worker_port: int, **extra: Any) -> RouterConfig:
    cert, key = pki["router"]
    client_cert, client_key = pki["router_client"]
    settings: dict[str, Any] = {
        "worker_urls": [f"https://127.0.0.1:{worker_port}"], "host": "127.0.0.1",
        "port": free_port(), "prometheus_port": 0, "loads_poll_interval_secs": 0,
        "disable_health_check": True, "retry_max_retries": 0,
        "tls_cert_path": str(cert), "tls_key_path": str(key), "ca_cert_paths": [str(pki["ca"])],
        "client_cert_path": str(client_cert), "client_key_path": str(client_key), **extra}
    return RouterConfig(**settings)


def test_tls_client_tls_router_mtls_worker(pki: dict[str, Any]) -> None:
    async def run() -> None:
        worker = await _worker(pki)
        try:
            config = _router_config(pki, worker.info.port)
            serving = await open_router(config)
            try:
                base = f"https://127.0.0.1:{config.port}"
                status, events = await _generate(base, _client_context(pki["ca"]))
                assert status == 200 and events[-1] == "[DONE]"
                assert events[-2]["meta_info"]["completion_tokens"] == 5
                # plain HTTP to the TLS port gets no answer
                with pytest.raises(aiohttp.ClientError):
                    await _generate(f"http://127.0.0.1:{config.port}", False)
                # a client that does not trust the router's CA refuses the handshake
                with pytest.raises(aiohttp.ClientConnectorCertificateError):
                    await _generate(base, _client_context(pki["other_ca"]))
                # the worker: a client without a certificate is refused
                worker_url = f"https://127.0.0.1:{worker.info.port}"
                with pytest.raises(aiohttp.ClientError):
                    await _generate(worker_url, _client_context(pki["ca"]))
                # ... one with the router's client certificate is served
                own = _client_context(pki["ca"])
                own.load_cert_chain(*map(str, pki["router_client"]))
                assert (await _generate(worker_url, own))[0] == 200
            finally:
                await serving.close()
        finally:
            await worker.close()

    asyncio.run(run())


def test_a_router_without_a_client_certificate_cannot_reach_an_mtls_worker(
        pki: dict[str, Any]) -> None:
    async def run() -> None:
        worker = await _worker(pki)
        try:
            config = _router_config(pki, worker.info.port, client_cert_path=None,
                                    client_key_path=None)
            serving = await open_router(config)
            try:
                status, body = await _generate(f"https://127.0.0.1:{config.port}",
                                               _client_context(pki["ca"]))
                assert status in (502, 503) and "error" in body
            finally:
                await serving.close()
        finally:
            await worker.close()

    asyncio.run(run())


def test_a_worker_certificate_from_an_unknown_ca_is_refused(pki: dict[str, Any]) -> None:
    async def run() -> None:
        worker = await _worker(pki, require_client=False)
        try:
            config = _router_config(pki, worker.info.port, ca_cert_paths=[str(pki["other_ca"])])
            serving = await open_router(config)
            try:
                status, _ = await _generate(f"https://127.0.0.1:{config.port}",
                                            _client_context(pki["ca"]))
                assert status in (502, 503)
            finally:
                await serving.close()
        finally:
            await worker.close()

    asyncio.run(run())


@pytest.mark.parametrize(("flags", "message"), [
    (["--tls-cert-path", "CERT"], "--tls-cert-path needs --tls-key-path"),
    (["--client-key-path", "KEY"], "--client-key-path needs --client-cert-path"),
    (["--tls-cert-path", "ABSENT", "--tls-key-path", "ABSENT"], "cannot load"),
    (["--ca-cert-paths", "KEY"], "--ca-cert-paths"),
])
def test_bad_certificate_flags_are_usage_errors(pki: dict[str, Any], flags: list[str],
                                                message: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    cert, key = pki["router"]
    words = [{"CERT": str(cert), "KEY": str(key), "ABSENT": str(cert) + ".absent"}.get(f, f)
             for f in flags]
    assert router_main(["--worker-urls", "http://127.0.0.1:9", *words]) == 2
    assert message in capsys.readouterr().err
