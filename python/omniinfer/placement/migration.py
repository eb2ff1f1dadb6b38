"""From one placement to the next with as few weight copies as possible, one spare slot each.

Device rows of the new placement are first matched to the old devices they overlap most
(devices are interchangeable for balance), and inside a device an expert that stays keeps its
slot. What remains are slot changes ``a -> b``; they become ordered steps:

* ``ADD``: copy expert ``b`` from a device that serves it into the spare slot of ``device``
  (straight into ``slot`` when that slot is unused);
* ``REMOVE``: ``slot`` of ``device`` drops ``a`` and serves the staged copy; the spare is free;
* ``SWAP``: two devices exchange one expert each (each stages the other's copy in its spare,
  then both switch at once).

Every device uses at most one spare slot at a time and every expert stays served by at least
one slot throughout, so inference goes on while weights move. :func:`apply_migration` replays
the steps and checks exactly that.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

from omniinfer.placement.layout import EMPTY, Placement, PlacementError


@dataclass(frozen=True)
class MigrationStep:
    """One instruction of a migration plan (see the module docstring for the semantics)."""

    op: str
    layer: int
    device: int
    slot: int
    expert: int
    source: int = -1
    peer_device: int = -1
    peer_slot: int = -1
    peer_expert: int = -1
    bytes: int = 0


@dataclass
class MigrationPlan:
    """Ordered steps plus totals; ``target`` is the new placement with slots aligned to the old."""

    steps: list[MigrationStep] = field(default_factory=list)
    target: Placement | None = None

    @property
    def experts_moved(self) -> int:
        return sum(2 if s.op == "SWAP" else 1 for s in self.steps if s.op != "REMOVE")

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.steps)

    def to_json(self) -> list[dict]:
        return [asdict(s) for s in self.steps]


# --------------------------------------------------------------------------- alignment


def _device_counts(slots: np.ndarray, num_experts: int) -> np.ndarray:
    out = np.zeros((slots.shape[0], num_experts + 1), dtype=np.int64)
    rows = np.repeat(np.arange(slots.shape[0]), slots.shape[1])
    np.add.at(out, (rows, np.where(slots >= 0, slots, num_experts).ravel()), 1)
    return out[:, :num_experts]


def align_layer(old: np.ndarray, new: np.ndarray, num_experts: int) -> np.ndarray:
    """Permute devices of ``new`` onto the old devices they overlap most, then keep every
    staying expert in its old slot. Devices only swap places with devices of equal size."""
    ko, kn = _device_counts(old, num_experts), _device_counts(new, num_experts)
    overlap = np.minimum(ko[:, None, :], kn[None, :, :]).sum(axis=2)
    size_old, size_new = (old >= 0).sum(axis=1), (new >= 0).sum(axis=1)
    overlap = np.where(size_old[:, None] == size_new[None, :], overlap, -1)
    num_devices = old.shape[0]
    row_of = np.full(num_devices, -1, dtype=np.int64)
    taken = np.zeros(num_devices, dtype=bool)
    for flat in np.argsort(-overlap, axis=None, kind="stable"):
        i, j = divmod(int(flat), num_devices)
        if row_of[i] < 0 and not taken[j] and overlap[i, j] >= 0:
            row_of[i], taken[j] = j, True
    for i in np.flatnonzero(row_of < 0):  # unequal sizes left over: any free row
        j = int(np.flatnonzero(~taken)[0])
        row_of[i], taken[j] = j, True
    out = np.full_like(old, EMPTY)
    for d in range(num_devices):
        want = Counter(new[row_of[d]].tolist())
        rest = []
        for s, e in enumerate(old[d].tolist()):
            if e >= 0 and want[e] > 0:
                out[d, s] = e
                want[e] -= 1
        for e, n in want.items():
            rest += [e] * n
        rest.sort(key=lambda e: e < 0)
        free = [s for s in range(old.shape[1]) if not (old[d, s] >= 0 and out[d, s] == old[d, s])]
        for s, e in zip(free, rest, strict=True):
            out[d, s] = e
    return out


def align(old: Placement, new: Placement) -> Placement:
    """``new`` with devices and slots reordered to move the fewest experts from ``old``."""
    if old.slots.shape != new.slots.shape or old.num_experts != new.num_experts:
        raise PlacementError(f"placements differ in shape: {old.slots.shape} vs {new.slots.shape}")
    slots = np.stack(
        [align_layer(o, n, old.num_experts) for o, n in zip(old.slots, new.slots, strict=True)]
    )
    return Placement(slots, old.num_experts)


def experts_moved(old: np.ndarray, new: np.ndarray) -> int:
    """Slots that receive another expert's weights (SGLang's updater copies exactly these)."""
    return int(((old != new) & (new >= 0)).sum())


# ---------------------------------------------------------------------------- ordering


def _order_layer(
    layer: int, old: np.ndarray, new: np.ndarray, expert_bytes: int
) -> tuple[list[MigrationStep], np.ndarray]:
    """Steps turning ``old`` into ``new`` (already aligned) with one spare slot per device, and
    the layout reached (``new`` up to slot order inside a device).

    A slot change ``a -> b`` is an ADD of ``b`` into the spare followed at once by the REMOVE of
    ``a``, allowed while ``a`` is served by another slot too. Changes left over form cycles of
    sole copies (each one's evicted expert is the next one's arrival); a SWAP with the slot that
    serves the wanted expert settles one change of the cycle and keeps every expert served.
    """
    current = old.copy()
    pending = {
        (d, s): (int(old[d, s]), int(new[d, s]))
        for d in range(old.shape[0])
        for s in range(old.shape[1])
        if old[d, s] != new[d, s]
    }
    steps: list[MigrationStep] = []

    def served_elsewhere(e: int) -> bool:
        return e < 0 or int((current == e).sum()) >= 2

    def source(b: int, d: int) -> int:
        holders = [x for x in range(current.shape[0]) if x != d and b in current[x]]
        keep = [x for x in holders if b in new[x]]
        return (keep or holders or [-1])[0]

    while pending:
        simple = next(
            (k for k, (a, b) in pending.items() if served_elsewhere(a) and (b < 0 or b in current)),
            None,
        )
        if simple is not None:
            (d, s), (a, b) = simple, pending.pop(simple)
            if b >= 0:
                src = source(b, d)
                steps.append(MigrationStep("ADD", layer, d, s, b, source=src, bytes=expert_bytes))
            if a >= 0:
                steps.append(MigrationStep("REMOVE", layer, d, s, a))
            current[d, s] = b
            continue
        swap = next(
            (
                (k, k2)
                for k, (a, b) in pending.items()
                for k2 in pending
                if k2[0] != k[0] and current[k2] == b
            ),
            None,
        )
        if swap is None:
            # The wanted expert sits in another changing slot of the same device: slot order
            # inside a device is free, so that slot keeps it and this slot takes the other's wish.
            local = next(
                (
                    (k, k2)
                    for k, (a, b) in pending.items()
                    for k2 in pending
                    if k2 != k and k2[0] == k[0] and current[k2] == b
                ),
                None,
            )
            if local is None:
                raise PlacementError(f"layer {layer}: migration cannot proceed with one spare slot")
            k, k2 = local
            pending[k] = (pending[k][0], pending.pop(k2)[1])
            if pending[k][0] == pending[k][1]:
                del pending[k]
            continue
        (d, s), (d2, s2) = swap
        a, b = pending.pop((d, s))
        steps.append(
            MigrationStep(
                "SWAP",
                layer,
                d,
                s,
                a,
                peer_device=d2,
                peer_slot=s2,
                peer_expert=b,
                bytes=2 * expert_bytes,
            )
        )
        current[d, s], current[d2, s2] = b, a
        wanted = pending.pop((d2, s2))[1]
        if wanted != a:
            pending[(d2, s2)] = (a, wanted)
    return steps, current


def plan_migration(old: Placement, new: Placement, expert_bytes: int = 0) -> MigrationPlan:
    """Align ``new`` to ``old`` and order the resulting slot changes into steps."""
    target = align(old, new)
    steps: list[MigrationStep] = []
    for layer in range(old.num_layers):
        layer_steps, final = _order_layer(
            layer, old.slots[layer], target.slots[layer], expert_bytes
        )
        steps += layer_steps
        target.slots[layer] = final
    return MigrationPlan(steps, target)


def apply_migration(old: Placement, steps: list[MigrationStep]) -> Placement:
    """Replay ``steps`` on ``old``; raise if a copy comes from a device that does not serve the
    expert, a device stages two copies at once, or an expert stops being served."""
    slots = old.slots.copy()
    spare: dict[tuple[int, int], tuple[int, int]] = {}
    for i, st in enumerate(steps):
        layer = slots[st.layer]
        if st.op == "ADD":
            if st.source >= 0 and st.expert not in layer[st.source]:
                raise PlacementError(
                    f"step {i}: device {st.source} does not hold expert {st.expert}"
                )
            if layer[st.device, st.slot] < 0:
                layer[st.device, st.slot] = st.expert
                continue
            if (st.layer, st.device) in spare:
                raise PlacementError(f"step {i}: device {st.device} needs a second spare slot")
            spare[(st.layer, st.device)] = (st.slot, st.expert)
        elif st.op == "REMOVE":
            gone = int(layer[st.device, st.slot])
            staged = spare.pop((st.layer, st.device), None)
            if staged is not None and staged[0] != st.slot:
                raise PlacementError(f"step {i}: staged copy was meant for slot {staged[0]}")
            layer[st.device, st.slot] = staged[1] if staged else EMPTY
            if gone >= 0 and gone not in layer:
                raise PlacementError(
                    f"step {i}: expert {gone} is no longer served in layer {st.layer}"
                )
        elif st.op == "SWAP":
            if (st.layer, st.device) in spare or (st.layer, st.peer_device) in spare:
                raise PlacementError(f"step {i}: SWAP needs a free spare slot on both devices")
            a, b = layer[st.device, st.slot], layer[st.peer_device, st.peer_slot]
            layer[st.device, st.slot], layer[st.peer_device, st.peer_slot] = b, a
        else:
            raise PlacementError(f"step {i}: unknown op {st.op!r}")
    if spare:
        raise PlacementError("migration ends with weights still staged in spare slots")
    return Placement(slots, old.num_experts)
