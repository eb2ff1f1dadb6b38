"""The saving-against-quality front of one layer ranking, and the point a pattern ships at.

A retrieval-aware ranking orders the layers by what compressing each one alone costs, on the
search's texts and haystacks only: its perplexity increase and the drop of the key's
log-probability in passkey cases (a continuous figure, unlike pass or fail, so that a single
layer's effect shows). The first ``k`` layers of that order are the front's ``k``-th pattern;
each is judged on kinds of text and haystacks the ranking never read, beside the first-``k``
pattern of the same size. The shipped point is the largest ``k`` whose judged perplexity and
retrieval both hold their bounds; the point after it says which bound binds.

Pure Python: tested without a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def rank_layers(ppl_drop: Sequence[float], key_drop: Sequence[float]) -> list[int]:
    """Layer ids from the cheapest to compress alone to the costliest.

    Each layer's cost is its perplexity increase over the largest one of any layer plus its
    key log-probability drop over the largest one (both clipped at zero: a layer that helps is
    as cheap as one that does nothing); ties keep the lower id first."""
    if len(ppl_drop) != len(key_drop) or not ppl_drop:
        raise ValueError("one perplexity and one key drop per layer, at least one layer")
    ppl = [max(0.0, d) for d in ppl_drop]
    key = [max(0.0, d) for d in key_drop]
    ppl_scale, key_scale = max(ppl) or 1.0, max(key) or 1.0
    cost = [p / ppl_scale + k / key_scale for p, k in zip(ppl, key, strict=True)]
    return sorted(range(len(cost)), key=lambda layer: (cost[layer], layer))


@dataclass(frozen=True)
class Judged:
    """One pattern on the judged data: ``ppl_drop`` the worst relative perplexity increase over
    the judged kinds (``worst_text`` the kind), ``retrieval_loss`` the worst band's lost points
    against the full model (``worst_band`` its label, None when nothing was lost)."""

    layers: tuple[int, ...]
    kv_saved: float
    ppl_drop: float
    worst_text: str
    retrieval_loss: float
    worst_band: str | None

    def holds(self, max_drop: float, max_loss: float) -> bool:
        return self.ppl_drop <= max_drop and self.retrieval_loss <= max_loss

    def beats(self, other: Judged) -> bool:
        """At least as good as ``other`` on both measures and better on one."""
        return (self.ppl_drop <= other.ppl_drop and self.retrieval_loss <= other.retrieval_loss
                and (self.ppl_drop < other.ppl_drop
                     or self.retrieval_loss < other.retrieval_loss))


@dataclass(frozen=True)
class FrontPoint:
    k: int
    ranked: Judged
    first_k: Judged


def shipped_point(front: Sequence[FrontPoint], max_drop: float,
                  max_loss: float) -> FrontPoint | None:
    """The largest ``k`` whose ranked pattern holds both bounds (None: no point does)."""
    holding = [point for point in front if point.ranked.holds(max_drop, max_loss)]
    return max(holding, key=lambda point: point.k, default=None)


def binding_bounds(front: Sequence[FrontPoint], shipped: FrontPoint | None, max_drop: float,
                   max_loss: float) -> list[str]:
    """What stops the front past ``shipped``: the bounds the next larger point breaks
    ("perplexity", "retrieval"), empty when no larger point was judged."""
    after = [p for p in front if shipped is None or p.k > shipped.k]
    if not after:
        return []
    nearest = min(after, key=lambda point: point.k).ranked
    broken = []
    if nearest.ppl_drop > max_drop:
        broken.append("perplexity")
    if nearest.retrieval_loss > max_loss:
        broken.append("retrieval")
    return broken
