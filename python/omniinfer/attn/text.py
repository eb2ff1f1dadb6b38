"""Evaluation text: the texts shipped in ``omniinfer.data``, cut into windows.

The texts are of different kinds (verse, drama, a report, a novel, C headers with their API
documentation, scripture, legal prose, questions with worked answers, technical prose, a
glossary; public domain or freely licensed, sources and licences in ``data/text/SOURCES.md``)
because a pattern scored on one kind overfits it. Each text is split once into two halves by
characters: a search scores patterns on the first half only and the evaluation reports on the
second (held out); texts a search never used at all are the real test of a pattern.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

# Shipped text name -> (file, marker of where the book starts after its Gutenberg preamble).
SHIPPED: dict[str, tuple[str, str | None]] = {
    "paradise_lost": ("paradise_lost.txt", "\nBook I "),  # verse
    "tinyshakespeare": ("tinyshakespeare.txt", None),  # drama
    "lcet10": ("lcet10.txt", "\n                      WORKSHOP ON ELECTRONIC TEXTS"),  # report
    "alice": ("alice29.txt", None),  # novel
    "asyoulik": ("asyoulik.txt", None),  # drama, a play tinyshakespeare does not have
    "sqlite3_h": ("sqlite3_h.txt", None),  # C header with its API documentation
    "stb_truetype_h": ("stb_truetype_h.txt", None),  # another C header, another author
    "kjv_exodus": ("kjv_exodus.txt", None),  # scripture (King James Version, Exodus 1-30)
    "licences": ("licences.txt", None),  # legal prose (GPL 3 and 2, LGPL 2.1, MPL 2, Apache 2)
    "gsm8k_qa": ("gsm8k_qa.txt", None),  # questions and worked answers (GSM8K test, first 200)
    "python_datamodel": ("python_datamodel.txt", None),  # technical prose (Python reference)
    "python_glossary": ("python_glossary.txt", None),  # a list: terms and their definitions
}
PARTS = ("search", "heldout", "all")


def read(name_or_path: str | Path) -> str:
    """A shipped text by name (preamble removed), or any UTF-8 file by path."""
    name = str(name_or_path)
    stem = Path(name).stem
    if name in SHIPPED or (stem in SHIPPED and not Path(name).exists()):
        filename, start = SHIPPED[stem]
        text = resources.files("omniinfer.data").joinpath(f"text/{filename}").read_text("utf-8")
        return text[text.index(start) + 1 :] if start else text
    return Path(name).read_text(encoding="utf-8")


def part(text: str, which: str) -> str:
    """The search half, the held-out half, or all of ``text`` (cut at a line break)."""
    if which not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {which!r}")
    if which == "all":
        return text
    cut = text.find("\n", len(text) // 2)
    cut = len(text) // 2 if cut < 0 else cut
    return text[:cut] if which == "search" else text[cut:]


def windows(tokenizer: Any, text: str, context: int, count: int) -> list[list[int]]:
    """``count`` non-overlapping windows of ``context`` tokens, spread evenly over ``text``."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    available = len(ids) // context
    if available < count:
        raise ValueError(
            f"text has {len(ids)} tokens: room for {available} windows of {context}, "
            f"{count} asked"
        )
    stride = len(ids) // count
    return [ids[i * stride : i * stride + context] for i in range(count)]
