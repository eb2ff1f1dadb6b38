"""Where one client request ends on a connection: its head's framing fields and a body scanner.

The guarded listener (``listener.py``) must know when a request's head starts (to time it) and
whether a body is compressed (to refuse it before anything inflates it), without waiting for
aiohttp's handler task to run. ``HeadInfo.parse`` reads the fields that matter from a complete
head; ``BodyScanner`` then consumes the bytes of that request's body (Content-Length or chunked,
trailers included) and says where the next request begins. Malformed framing is not judged
here: the scanner swallows the rest of the connection and aiohttp's parser answers the 400.
"""

from __future__ import annotations

import dataclasses

MAX_CHUNK_LINE = 4096  # a chunk-size line (size and extensions) or a trailer line
_HEX = frozenset(b"0123456789abcdefABCDEF")


@dataclasses.dataclass(frozen=True, slots=True)
class HeadInfo:
    """What a request head says about its body."""

    content_length: int | None = None
    chunked: bool = False
    content_encoding: str | None = None  # anything but identity is a compressed body

    @classmethod
    def parse(cls, head: bytes) -> HeadInfo:
        """Fields of a head (request line and header lines, without the final CRLF CRLF)."""
        low = head.lower()
        length: int | None = None
        text = _field(low, b"\r\ncontent-length:")
        if text is not None:
            length = int(text) if text.isdigit() and len(text) <= 18 else -1
        coding = _field(low, b"\r\ntransfer-encoding:")
        encoding = None
        value = _field(low, b"\r\ncontent-encoding:")
        if value is not None:
            codings = [c.strip() for c in value.decode("latin-1").split(",")]
            codings = [c for c in codings if c and c != "identity"]
            encoding = ", ".join(codings) or None
        return cls(length, coding is not None and b"chunked" in coding, encoding)


def _field(low: bytes, name: bytes) -> bytes | None:
    """The (first) value of a header in a lower-cased head, stripped; None if absent."""
    start = low.find(name)
    if start < 0:
        return None
    start += len(name)
    end = low.find(b"\r\n", start)
    return low[start:end if end >= 0 else len(low)].strip()


class BodyScanner:
    """Consumes one request's body; ``feed`` returns how many of the bytes given belong to it
    (fewer than given: the body ended and the rest is the next request)."""

    __slots__ = ("_left", "_state", "_line", "done")

    def __init__(self, info: HeadInfo) -> None:
        self._line = b""
        if info.chunked:
            self._state, self._left, self.done = "size", 0, False
        elif info.content_length is not None and info.content_length < 0:
            self._state, self._left, self.done = "broken", 0, False  # aiohttp answers 400
        else:
            self._state, self._left = "length", info.content_length or 0
            self.done = self._left == 0

    def feed(self, data: bytes) -> int:
        pos, n = 0, len(data)
        while pos < n and not self.done:
            state = self._state
            if state == "broken":
                return n
            if state in ("length", "data"):
                take = min(self._left, n - pos)
                pos += take
                self._left -= take
                if self._left == 0:
                    if state == "length":
                        self.done = True
                    else:
                        self._state, self._left = "crlf", 2
            elif state == "crlf":
                take = min(self._left, n - pos)
                pos += take
                self._left -= take
                if self._left == 0:
                    self._state = "size"
            else:  # "size" or "trailer": one line at a time
                end = data.find(b"\n", pos)
                if end < 0:
                    self._line += data[pos:]
                    if len(self._line) > MAX_CHUNK_LINE:
                        self._state = "broken"
                    return n
                line = (self._line + data[pos:end]).rstrip(b"\r")
                self._line = b""
                pos = end + 1
                if state == "size":
                    size = line.partition(b";")[0].strip()
                    if not size or not _HEX.issuperset(size) or len(size) > 16:
                        self._state = "broken"
                        return n
                    self._left = int(size, 16)
                    self._state = "data" if self._left else "trailer"
                elif not line:  # the empty line after the last chunk (and any trailers)
                    self.done = True
        return pos
