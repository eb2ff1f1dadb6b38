"""Algorithm 1, static placement: budget per layer, replicas per expert, experts onto devices.

The steps follow the OmniPlacement paper: AllocateBudgetByImbalance gives redundant slots to the
layers whose balance gains most from them, DetermineReplicas adds copies heap-greedily to the
expert with the highest load per copy, GeneratePlacement packs the copies onto the least-loaded
device (at most one copy of an expert per device), then a swap search lowers the busiest device,
and a topology-aware remap puts copies of hot experts on distinct nodes so tokens find a copy
on their own node. Of the candidate placements the one with the least imbalance B is kept.
"""

from __future__ import annotations

import heapq

import numpy as np

from omniinfer.placement.layout import (
    EMPTY,
    Placement,
    PlacementError,
    imbalance_of_loads,
    slot_loads,
)
from omniinfer.placement.loads import validate_counts

_BIG = 1e300
# Stop searching once B is within this of the lower bound: less than any measurable gain.
GOOD_ENOUGH = 1e-3
# Further candidates are planned only while the best is farther than this from the bound.
TRY_MORE = 2e-3
# Two copies of an expert on one device are used only when they lower B by more than this.
DUPLICATE_GAIN = 4e-3


def check_shape(num_experts: int, num_devices: int, num_redundant: int, num_nodes: int = 1) -> int:
    """Validate an SGLang-compatible configuration; return the slots per device."""
    if num_devices < 1:
        raise PlacementError(f"number of devices must be >= 1, got {num_devices}")
    if num_redundant < 0:
        raise PlacementError(f"number of redundant experts must be >= 0, got {num_redundant}")
    if num_nodes < 1 or num_devices % num_nodes:
        raise PlacementError(f"num nodes N={num_nodes} must divide num devices R={num_devices}")
    total = num_experts + num_redundant
    if total % num_devices:
        raise PlacementError(
            f"num devices R={num_devices} does not divide E+K={num_experts}+{num_redundant}={total}"
            " physical slots"
        )
    if num_redundant > num_experts * (num_devices - 1):
        raise PlacementError(
            f"K={num_redundant} redundant experts exceed one copy of each expert per device"
        )
    return total // num_devices


# --------------------------------------------------------------------- DetermineReplicas


def replicate(counts: np.ndarray, num_slots: int, max_replicas: int) -> np.ndarray:
    """Copies per expert: each extra slot goes to the expert with the highest load per copy."""
    num_experts = counts.shape[0]
    reps = np.ones(num_experts, dtype=np.int64)
    heap = [(-float(c), e) for e, c in enumerate(counts)]
    heapq.heapify(heap)
    for _ in range(num_slots - num_experts):
        while True:
            _, e = heapq.heappop(heap)
            if reps[e] < max_replicas:
                break
        reps[e] += 1
        if reps[e] < max_replicas:
            heapq.heappush(heap, (-float(counts[e]) / reps[e], e))
    return reps


def peak_curve(counts: np.ndarray, max_extra: int, max_replicas: int) -> np.ndarray:
    """Highest load per copy after 0..max_extra extra copies (the lower bound on device load)."""
    reps = np.ones(counts.shape[0], dtype=np.int64)
    heap = [(-float(c), e) for e, c in enumerate(counts)]
    heapq.heapify(heap)
    out = np.empty(max_extra + 1)
    for k in range(max_extra + 1):
        out[k] = -heap[0][0] if heap else 0.0
        if k == max_extra or not heap:
            out[k + 1 :] = out[k]
            break
        _, e = heapq.heappop(heap)
        reps[e] += 1
        if reps[e] < max_replicas:
            heapq.heappush(heap, (-float(counts[e]) / reps[e], e))
    return out


# ---------------------------------------------------------------------- GeneratePlacement


def _items(counts: np.ndarray, reps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """All copies as (expert, load) sorted by load, hottest first."""
    experts = np.repeat(np.arange(counts.shape[0]), reps)
    loads = counts[experts] / reps[experts]
    order = np.lexsort((experts, -loads))
    return experts[order], loads[order]


def pack_greedy(
    counts: np.ndarray, reps: np.ndarray, capacity: np.ndarray, distinct: bool = True
) -> np.ndarray:
    """Hottest copy first onto the least-loaded device with room that lacks that expert
    (``distinct=False`` lets a device hold two copies of one expert)."""
    num_devices, width = capacity.shape[0], int(capacity.max())
    num_experts = counts.shape[0]
    slots = np.full((num_devices, width), EMPTY, dtype=np.int64)
    filled = np.zeros(num_devices, dtype=np.int64)
    loads = np.zeros(num_devices)
    present = np.zeros((num_devices, num_experts), dtype=bool)
    cap = capacity.tolist()
    heap = [(0.0, d) for d in range(num_devices) if cap[d] > 0]
    experts, item_loads = _items(counts, reps)
    for e, w in zip(experts.tolist(), item_loads.tolist(), strict=True):
        skipped = []
        while heap and distinct and present[heap[0][1], e]:
            skipped.append(heapq.heappop(heap))
        if heap:
            load, d = heapq.heappop(heap)
        else:
            d = _make_room(slots, filled, capacity, present, loads, counts, reps, e)
            heap = [(float(loads[x]), x) for x in range(num_devices) if filled[x] < cap[x]]
            heap = [h for h in heap if h[1] != d]
            heapq.heapify(heap)
        for item in skipped:
            heapq.heappush(heap, item)
        slots[d, filled[d]] = e
        filled[d] += 1
        loads[d] += w
        present[d, e] = True
        if filled[d] < cap[d]:
            heapq.heappush(heap, (float(loads[d]), d))
    return slots


def _make_room(slots, filled, capacity, present, loads, counts, reps, e) -> int:
    """Every device with room already holds ``e``: move one copy off a device lacking ``e``."""
    free = np.flatnonzero(filled < capacity)
    for d_free in free:
        for d in np.argsort(loads):
            if present[d, e] or d == d_free:
                continue
            for s in range(filled[d]):
                x = slots[d, s]
                if not present[d_free, x]:
                    w = counts[x] / reps[x]
                    slots[d_free, filled[d_free]] = x
                    filled[d_free] += 1
                    present[d_free, x] = True
                    loads[d_free] += w
                    slots[d, s : filled[d] - 1] = slots[d, s + 1 : filled[d]]
                    filled[d] -= 1
                    slots[d, filled[d]] = EMPTY
                    present[d, x] = False
                    loads[d] -= w
                    return int(d)
    raise PlacementError(f"cannot place another copy of expert {e}: every device already holds it")


def pack_snake(
    counts: np.ndarray, reps: np.ndarray, capacity: np.ndarray, distinct: bool = True
) -> np.ndarray:
    """Boustrophedon deal of the sorted copies: a different start for the swap search."""
    num_devices = capacity.shape[0]
    experts, _ = _items(counts, reps)
    order = np.concatenate([np.arange(num_devices), np.arange(num_devices)[::-1]])
    slots = np.full((num_devices, int(capacity.max())), EMPTY, dtype=np.int64)
    filled = np.zeros(num_devices, dtype=np.int64)
    present = np.zeros((num_devices, counts.shape[0]), dtype=bool)
    pos = 0
    for e in experts.tolist():
        for _ in range(2 * num_devices):
            d = int(order[pos % order.size])
            pos += 1
            if filled[d] < capacity[d] and not (distinct and present[d, e]):
                break
        else:
            return pack_greedy(counts, reps, capacity, distinct)
        slots[d, filled[d]] = e
        filled[d] += 1
        present[d, e] = True
    return slots


def refine_swaps(
    slots: np.ndarray,
    counts: np.ndarray,
    distinct: bool = True,
    bound: float = 1.0,
    max_iter: int = 400,
) -> np.ndarray:
    """Swap search: exchange a copy on the busiest device with one elsewhere while max load drops.

    Copies per expert stay fixed, so the load per copy stays fixed; empty slots act as zero-load
    copies, so moving a copy onto spare room is a swap as well. Stops once B <= ``bound``.
    """
    slots = slots.copy()
    num_devices, width = slots.shape
    num_experts = counts.shape[0]
    w = slot_loads(slots, counts)
    dev = w.sum(axis=1)
    present = np.zeros((num_devices, num_experts + 1), dtype=bool)
    rows = np.repeat(np.arange(num_devices), width)
    present[rows, np.where(slots >= 0, slots, num_experts).ravel()] = True
    present[:, num_experts] = False
    col = np.where(slots >= 0, slots, num_experts)
    tol = 1e-9 * max(float(dev.max()), 1.0)
    good_enough = (bound + GOOD_ENOUGH) * dev.mean()
    for _ in range(max_iter):
        m = int(np.argmax(dev))
        if dev[m] <= good_enough:
            break
        delta = w[m][:, None, None] - w[None, :, :]  # [i on m, device d, slot j]
        new_max = np.maximum(dev[m] - delta, dev[None, :, None] + delta)
        bad = delta <= tol
        if distinct:
            bad |= present[:, col[m]].T[:, :, None] | present[m][col][None, :, :]
        bad[:, m, :] = True
        new_max = np.where(bad, np.inf, new_max)
        flat = int(np.argmin(new_max))
        if not new_max.flat[flat] < dev[m] - tol:
            break
        i, d, j = np.unravel_index(flat, new_max.shape)
        a, b = col[m, i], col[d, j]
        col[m, i], col[d, j] = b, a
        w[m, i], w[d, j] = w[d, j], w[m, i]
        present[m, a], present[d, a] = False, a != num_experts
        present[d, b], present[m, b] = False, b != num_experts
        dev[m] = w[m].sum()
        dev[d] = w[d].sum()
    return np.where(col == num_experts, EMPTY, col)


# --------------------------------------------------------------------- topology-aware remap


def cross_node_fraction(slots: np.ndarray, counts: np.ndarray, num_nodes: int) -> float:
    """Share of routed tokens that leave their node when a token uses a copy on its own node
    if there is one (SGLang's static dispatch prefers same-node copies) and tokens start evenly
    on all nodes."""
    if num_nodes <= 1:
        return 0.0
    per_node = slots.reshape(num_nodes, -1)
    hosted = np.zeros((num_nodes, counts.shape[0]), dtype=bool)
    for n in range(num_nodes):
        used = per_node[n][per_node[n] >= 0]
        hosted[n, used] = True
    local = (counts * hosted.sum(axis=0)).sum() / num_nodes
    return float(1.0 - local / counts.sum())


def remap_topology(slots: np.ndarray, counts: np.ndarray, num_nodes: int) -> np.ndarray:
    """Reorder devices over nodes so copies of one expert land on distinct nodes.

    Device contents are untouched, so B does not change; only which node a device sits on.
    """
    num_devices = slots.shape[0]
    if num_nodes <= 1 or num_devices == num_nodes:
        return slots
    per_node = num_devices // num_nodes
    reps = np.bincount(slots[slots >= 0], minlength=counts.shape[0])
    weight = np.where(reps > 1, counts, 0.0)
    rows = [[e for e in row if e >= 0 and weight[e] > 0] for row in slots.tolist()]
    wl = weight.tolist()
    order = sorted(range(num_devices), key=lambda d: -sum(wl[e] for e in rows[d]))
    hosted: list[set[int]] = [set() for _ in range(num_nodes)]
    members: list[list[int]] = [[] for _ in range(num_nodes)]
    for d in order:
        best_n, best_gain = -1, -1.0
        for n in range(num_nodes):
            if len(members[n]) >= per_node:
                continue
            gain = sum(wl[e] for e in rows[d] if e not in hosted[n])
            if gain > best_gain + 1e-12 or (
                abs(gain - best_gain) <= 1e-12 and len(members[n]) < len(members[best_n])
            ):
                best_n, best_gain = n, gain
        members[best_n].append(d)
        hosted[best_n].update(rows[d])
    remapped = slots[np.concatenate(members)]
    if cross_node_fraction(remapped, counts, num_nodes) < cross_node_fraction(
        slots, counts, num_nodes
    ):
        return remapped
    return slots


# ------------------------------------------------------------------------ plan one layer


def plan_layer(
    counts: np.ndarray, capacity: np.ndarray, num_nodes: int = 1, candidates: int = 2
) -> np.ndarray:
    """Best-of-candidates placement of one layer onto devices with ``capacity[d]`` slots each."""
    num_devices = capacity.shape[0]
    num_slots = int(capacity.sum())
    packers = (pack_greedy, pack_snake)[: max(1, candidates)]
    # One copy per device is the rule; two copies on one device is kept as a fallback candidate:
    # it splits a hot expert 2:1 over devices (or more copies than devices), and with few
    # devices the rule can block every improving swap.
    options = [(replicate(counts, num_slots, num_devices), True, packers)]
    if candidates > 1:
        options.append((replicate(counts, num_slots, num_slots), False, packers[:1]))
    # No placement beats the highest load per copy of the greedy replica counts (they minimise
    # it), so a candidate that reaches this bound ends the search.
    mean = counts.sum() / num_devices
    bound = max(float((counts / options[-1][0]).max()), mean) / mean if mean > 0 else 1.0
    best, best_b = None, np.inf
    for reps, distinct, packs in options:
        for pack in packs:
            slots = refine_swaps(pack(counts, reps, capacity, distinct), counts, distinct, bound)
            b = imbalance_of_loads(slot_loads(slots, counts).sum(axis=1))
            if b < best_b - (1e-12 if distinct else DUPLICATE_GAIN):  # duplicates must pay off
                best, best_b = slots, b
            if best_b <= bound + TRY_MORE:
                break
        if best_b <= bound + TRY_MORE:
            break
    assert best is not None
    return remap_topology(best, counts, num_nodes)


def plan_static(
    counts: np.ndarray,
    num_devices: int,
    num_redundant: int,
    num_nodes: int = 1,
    candidates: int = 2,
) -> Placement:
    """SGLang-compatible placement: ``E+K`` slots in every layer, ``(E+K)/R`` per device."""
    counts = validate_counts(counts)
    width = check_shape(counts.shape[1], num_devices, num_redundant, num_nodes)
    capacity = np.full(num_devices, width, dtype=np.int64)
    slots = np.stack([plan_layer(c, capacity, num_nodes, candidates) for c in counts])
    return Placement(slots, counts.shape[1])


# ------------------------------------------------------------ AllocateBudgetByImbalance


def allocate_budget_by_imbalance(
    counts: np.ndarray, num_devices: int, total_redundant: int, horizon: int | None = None
) -> np.ndarray:
    """Redundant slots per layer: each chunk goes to the layer whose imbalance bound falls most
    per slot. The bound of a layer is max(mean device load, highest load per copy) / mean."""
    counts = validate_counts(counts)
    num_layers, num_experts = counts.shape
    cap = num_experts * (num_devices - 1)
    if total_redundant < 0 or total_redundant > cap * num_layers:
        raise PlacementError(
            f"total redundant budget {total_redundant} is outside 0..{cap * num_layers}"
        )
    horizon = horizon or num_devices
    mean = counts.sum(axis=1) / num_devices
    bounds = [
        np.maximum(peak_curve(c, min(cap, total_redundant), num_devices), m) / m
        for c, m in zip(counts, mean, strict=True)
    ]
    budget = np.zeros(num_layers, dtype=np.int64)
    left = total_redundant
    while left > 0:
        best = (0.0, -1, 0)
        for layer in range(num_layers):
            k, curve = int(budget[layer]), bounds[layer]
            top = min(k + horizon, k + left, curve.size - 1)
            if top <= k:
                continue
            gains = (curve[k] - curve[k + 1 : top + 1]) / np.arange(1, top - k + 1)
            j = int(np.argmax(gains))
            if gains[j] > best[0] + 1e-15:
                best = (float(gains[j]), layer, j + 1)
        if best[1] < 0:  # no layer gains any more: spread the rest evenly
            budget += left // num_layers
            budget[: left % num_layers] += 1
            break
        budget[best[1]] += best[2]
        left -= best[2]
    return budget


def layer_capacities(num_experts: int, num_devices: int, budget: np.ndarray) -> np.ndarray:
    """Slots per device per layer, ``[L, R]``: uneven remainders rotate so that the memory each
    device spends over all layers differs by at most one slot."""
    used = np.zeros(num_devices, dtype=np.int64)
    caps = np.empty((budget.shape[0], num_devices), dtype=np.int64)
    for layer, k in enumerate(budget.tolist()):
        base, extra = divmod(num_experts + k, num_devices)
        cap = np.full(num_devices, base, dtype=np.int64)
        cap[np.argsort(used, kind="stable")[:extra]] += 1
        caps[layer] = cap
        used += cap
    return caps


def plan_layerwise(
    counts: np.ndarray,
    num_devices: int,
    total_redundant: int,
    num_nodes: int = 1,
    candidates: int = 2,
) -> tuple[Placement, np.ndarray]:
    """Placement under a total memory budget: layers get different numbers of redundant slots.

    Candidate budgets (imbalance-driven and even) are planned in full and the one with the least
    mean B wins, so the result is never worse than spreading the budget evenly.
    """
    counts = validate_counts(counts)
    num_layers, num_experts = counts.shape
    if num_nodes < 1 or num_devices % num_nodes:
        raise PlacementError(f"num nodes N={num_nodes} must divide num devices R={num_devices}")
    even = np.full(num_layers, total_redundant // num_layers, dtype=np.int64)
    even[: total_redundant % num_layers] += 1
    options = [allocate_budget_by_imbalance(counts, num_devices, total_redundant), even]
    best: tuple[float, Placement, np.ndarray] | None = None
    for budget in options:
        caps = layer_capacities(num_experts, num_devices, budget)
        width = int(caps.max())
        slots = np.full((num_layers, num_devices, width), EMPTY, dtype=np.int64)
        for layer in range(num_layers):
            s = plan_layer(counts[layer], caps[layer], num_nodes, candidates)
            slots[layer, :, : s.shape[1]] = s
        placement = Placement(slots, num_experts)
        score = float(placement.imbalance(counts).mean())
        if best is None or score < best[0] - 1e-12:
            best = (score, placement, budget)
    assert best is not None
    return best[1], best[2]
