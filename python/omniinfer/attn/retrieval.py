"""Retrieval as a search constraint: passkey cases by kind, haystack and depth band.

A pattern that keeps perplexity can still lose what the model retrieves from the middle of a
long prompt (a compressed layer evicts a needle once it is ``recent`` tokens back). The check
holds cases of both kinds of :mod:`omniinfer.attn.passkey` (one key; three look-alike keys) on
two haystacks (the classic repeated filler and natural text), spread evenly over depth; the full
model's answers are computed once (and kept on disk with ``cache_dir``), then each pattern costs
one forward pass per case. A band is (kind, haystack, depth fifth); a pattern's retrieval loss
is the largest drop, in points, of its accuracy below the full model's in any band. Bands where
the full model itself fails nothing count against a pattern.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omniinfer.attn import masks, passkey, text

BANDS = 5  # depth fifths


@dataclass(frozen=True)
class Band:
    kind: str
    haystack: str
    depth: int  # 0..BANDS-1: the fifth of the haystack the asked needle sits in

    @property
    def label(self) -> str:
        low = self.depth / BANDS
        return f"{self.kind}/{self.haystack}/{low:.1f}-{low + 1 / BANDS:.1f}"


def band_of(case: passkey.PasskeyCase, haystack: str) -> Band:
    return Band(case.kind, haystack, min(BANDS - 1, int(case.depth * BANDS)))


def haystack_text(name: str, tokens: int, part: str) -> str:
    """The repeated filler (``passkey.REPEATED_FILLER``) or a shipped text's ``part`` half."""
    if name == passkey.REPEATED_FILLER:
        return passkey.repeated_filler(tokens)
    return text.part(text.read(name), part)


def loss_points(full: dict[Band, float], pattern: dict[Band, float]) -> tuple[float, Band | None]:
    """The largest accuracy drop of ``pattern`` below ``full`` over the bands, in points, and
    the band where it is (None when no band drops)."""
    worst, where = 0.0, None
    for band, accuracy in full.items():
        drop = 100.0 * (accuracy - pattern.get(band, 0.0))
        if drop > worst:
            worst, where = drop, band
    return worst, where


def accuracy_by_band(bands: Sequence[Band], passed: Sequence[bool]) -> dict[Band, float]:
    totals: dict[Band, list[int]] = {}
    for band, ok in zip(bands, passed, strict=True):
        totals.setdefault(band, [0, 0])
        totals[band][0] += int(ok)
        totals[band][1] += 1
    return {band: hit / count for band, (hit, count) in totals.items()}


class RetrievalCheck:
    """Cases at ``context`` tokens, ``per_kind`` of each kind on each haystack, depths spread
    evenly; ``score(compressed, sink, recent)`` gives the pattern's loss against the full model.

    ``part`` chooses which half of a natural-text haystack the cases come from ("search" for a
    search, "heldout" to judge), so a judgement never reuses a search's haystack text.
    """

    def __init__(self, model: Any, tokenizer: Any, context: int, per_kind: int,
                 haystacks: Sequence[str] = (passkey.REPEATED_FILLER, "tinyshakespeare"),
                 kinds: Sequence[str] = passkey.KINDS, part: str = "search", seed: int = 0,
                 cache_dir: Path | None = None) -> None:
        if per_kind < 1:
            raise ValueError("per_kind must be >= 1")
        self.model = model
        depths = [(i + 0.5) / per_kind for i in range(per_kind)]
        self.cases: list[passkey.PasskeyCase] = []
        self.bands: list[Band] = []
        for name in haystacks:
            hay = haystack_text(name, context * per_kind * len(kinds), part)
            for kind in kinds:
                for case in passkey.build_cases(tokenizer, hay, context, depths, seed, kind):
                    self.cases.append(case)
                    self.bands.append(band_of(case, name))
        self.full_passed = self._full(cache_dir)
        self.full = accuracy_by_band(self.bands, self.full_passed)

    def _full(self, cache_dir: Path | None) -> list[bool]:
        if cache_dir is None:
            return passkey.retrieved(self.model, self.cases, None)
        key = hashlib.sha1(str(self.model.config.name_or_path).encode())
        for case in self.cases:
            key.update((",".join(map(str, case.ids)) + f"|{case.answer_start}|").encode())
        path = Path(cache_dir) / f"retrieval-full-{key.hexdigest()[:16]}.json"
        if path.exists():
            saved = json.loads(path.read_text())
            if isinstance(saved, list) and len(saved) == len(self.cases):
                return [bool(v) for v in saved]
        passed = passkey.retrieved(self.model, self.cases, None)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(passed))
        return passed

    def score(self, compressed: Sequence[bool], sink: int, recent: int) -> dict[str, Any]:
        windows = masks.windows_for(tuple(compressed), sink, recent)
        passed = passkey.retrieved(self.model, self.cases, windows)
        mine = accuracy_by_band(self.bands, passed)
        loss, where = loss_points(self.full, mine)
        return {"retrieval_loss_points": loss,
                "retrieval_worst_band": None if where is None else where.label,
                "retrieval_full": sum(self.full_passed) / len(self.cases),
                "retrieval_pattern": sum(passed) / len(self.cases),
                "retrieval_cases": len(self.cases)}


def constraint(ppl_drop: float, max_drop: float, loss: float, max_loss: float) -> float:
    """Both bounds as one figure on the perplexity scale: at most ``max_drop`` exactly when the
    perplexity increase is within ``max_drop`` and the retrieval loss within ``max_loss``
    points; above it, the larger of the two violations (each in its bound's units)."""
    if max_drop <= 0 or max_loss <= 0:
        raise ValueError("both bounds must be > 0")
    return max(ppl_drop, loss / max_loss * max_drop)
