"""``demo --attach``: which servers it reads from a router's ``/list_workers``, and what it
refuses (an answer too large, not JSON, or without a prefill and a decode server)."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from omniinfer.testbed.demo import MAX_WORKER_LIST_BYTES, attached_servers, main


@contextmanager
def _router_answering(body: bytes) -> Iterator[str]:
    """An HTTP server on a free port that answers every GET with ``body``."""

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _workers(*described: dict[str, object]) -> bytes:
    return json.dumps({"workers": list(described)}).encode()


def test_the_first_prefill_and_decode_worker_are_used() -> None:
    body = _workers({"url": "http://p1:30000", "role": "prefill"},
                    {"url": "http://p2:30000", "role": "prefill"},
                    {"url": "http://d1:30000/", "role": "decode"})
    with _router_answering(body) as url:
        assert attached_servers(url) == ("http://p1:30000", "http://d1:30000")


@pytest.mark.parametrize(("body", "reason"), [
    (b"x" * (MAX_WORKER_LIST_BYTES + 10), "more than"),
    (b"<html>", "not JSON"),
    (_workers({"url": "http://p:1", "role": "prefill"}), "no decode"),
    (_workers({"url": "http://r:1", "role": "regular"}), "no prefill and no decode"),
    (_workers({"url": "file:///etc/passwd", "role": "prefill"},
              {"url": "http://d:1", "role": "decode"}), "no prefill"),
    (json.dumps({"workers": "nope"}).encode(), "no prefill"),
])
def test_a_worker_list_it_cannot_use_is_refused_by_name(body: bytes, reason: str) -> None:
    with _router_answering(body) as url, pytest.raises(ValueError, match=reason):
        attached_servers(url)


def test_the_cli_answers_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with _router_answering(b"[]") as url:
        assert main(["--attach", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith("[demo] --attach:") and "no prefill" in err


def test_a_report_past_its_bound_is_refused() -> None:
    from omniinfer.testbed import demo_report

    with _router_answering(b"{" + b" " * demo_report.MAX_REPORT_BYTES + b"}") as url, \
            pytest.raises(ValueError, match="more than"):
        demo_report.attn_lines(url, url)
    with _router_answering(b'{"enabled": false}') as url:
        assert demo_report.attn_lines(url, url) == ["OmniAttn: off (no pattern)"]
