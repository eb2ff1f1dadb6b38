"""OmniAttn's PD decode hook fails loudly when SGLang stops passing what it reads.

``around_send_kv_metadata`` places the sink span from ``decode_prefix_len``, which SGLang
0.5.23 passes to ``DecodePreallocQueue._send_kv_metadata`` on every call (checked in the
wheel's source here); a call without it must stop with a clear error instead of assuming a
prefix of 0 and sending the wrong pages. The transfers themselves run in ``test/pd``.
"""

from __future__ import annotations

import inspect
import re

import pytest

from omniinfer.sglang_plugin.omni_attn import pd


def test_a_call_without_decode_prefix_len_is_refused() -> None:
    called = []
    with pytest.raises(RuntimeError, match="decode_prefix_len"):
        pd.around_send_kv_metadata(lambda *a, **k: called.append(a), object(), object(),
                                   [1, 2], 1, None)
    assert not called


def test_sglang_passes_decode_prefix_len_at_every_call() -> None:
    from sglang.srt.disaggregation import decode

    source = inspect.getsource(decode.DecodePreallocQueue)
    calls = [m.start() for m in re.finditer(r"self\._send_kv_metadata\(", source)]
    assert calls, "DecodePreallocQueue no longer calls _send_kv_metadata"
    for start in calls:
        call = source[start : source.index(")\n", start)]
        spread = re.search(r"\*\*(\w+)", call)
        passed = "decode_prefix_len" in call or (
            spread is not None
            and re.search(rf"{spread.group(1)} = \{{\"decode_prefix_len\"", source) is not None
        )
        assert passed, call
