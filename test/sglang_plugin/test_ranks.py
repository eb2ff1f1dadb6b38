"""``ranks.tp_rank``: None only while SGLang says the rank is not written; other errors raise."""

from __future__ import annotations

from typing import Any

import pytest


class _Context:
    def __init__(self, read: Any) -> None:
        self._read = read

    @property
    def tp_rank(self) -> Any:
        return self._read()


def _with_context(monkeypatch: pytest.MonkeyPatch, read: Any) -> None:
    import sglang.srt.runtime_context as runtime_context

    monkeypatch.setattr(runtime_context, "get_parallel", lambda: _Context(read))


def test_tp_rank_is_none_only_while_the_rank_is_not_written(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.runtime_context import get_parallel

    from omniinfer.sglang_plugin.ranks import tp_rank

    with pytest.raises(RuntimeError, match="has not been written"):
        get_parallel().tp_rank  # noqa: B018 - SGLang's own answer in a process without ranks
    assert tp_rank() is None
    _with_context(monkeypatch, lambda: 3)
    assert tp_rank() == 3


@pytest.mark.parametrize("error", [AttributeError("ParallelContext has no 'tp_rank'"),
                                   ValueError("config namespace 'parallel' not published"),
                                   KeyError("tp_rank")])
def test_tp_rank_lets_any_other_error_through(error: Exception,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from omniinfer.sglang_plugin.ranks import tp_rank

    def read() -> Any:
        raise error

    _with_context(monkeypatch, read)
    with pytest.raises(type(error)):
        tp_rank()


def test_tp_rank_fails_on_a_rank_that_is_no_integer(monkeypatch: pytest.MonkeyPatch) -> None:
    from omniinfer.sglang_plugin.ranks import tp_rank

    _with_context(monkeypatch, lambda: "zero")
    with pytest.raises(ValueError):
        tp_rank()
