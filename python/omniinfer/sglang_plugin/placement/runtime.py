"""OmniPlacement inside SGLang's MoE runtime (scheduler processes, expert parallelism).

SGLang's EPLBManager rebalances every N forward passes with no improvement margin and moves
expert weights synchronously inside the forward loop. With ``--enable-omni-placement`` its
per-pass callback is replaced by :class:`PlacementController`:

- main thread, every forward pass: count the pass, hand the recorder's per-slot counts to a
  queue (a tensor clone), every ``interval`` passes enqueue a tick, and switch in a staged
  layout when its agreed pass arrives — a weight copy per changed slot plus SGLang's masked
  in-place metadata update, the same step on every rank;
- background thread: fold counts into per-expert load, run Algorithm 2 on rank 0
  (:class:`omniinfer.placement.dynamic.DynamicPlanner`: trigger, prediction, margin), broadcast
  the decision, stage the changed slots (local copies or point-to-point from the rank holding
  the expert), then agree with all ranks on success and on the pass to switch at. A failed
  staging on any rank leaves the old layout serving everywhere; its cause on every rank is
  reported and rank 0 never proposes that layout again.

The switch itself is agreed at its pass (:mod:`.agreement`): every rank votes when the target
pass ends, and a rank whose background thread posted the layout too late votes "not ready", so
all ranks switch at that pass or none does; an aborted switch is retried at a later agreed pass
(up to ``SWITCH_ATTEMPTS`` times), then dropped. A vote that times out, or a switch that fails
on any rank after an agreed vote, is fatal: every rank that learns it raises
:class:`~.agreement.SwitchBroken` from the forward loop and its background thread stops.

Devices (through :mod:`omniinfer.platform` only): staging runs on a dedicated stream, over
NCCL/HCCL when the weights live on a device (gloo on CPU), and the switch makes the forward
stream wait for the staging event instead of blocking the host; activation counts leave the
device by a non-blocking copy into pinned memory (:mod:`omniinfer.placement.staging`). Control
messages (decisions, verdicts) always use a gloo group over host tensors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from omniinfer.flags import OmniConfig
from omniinfer.placement.dynamic import DynamicPlanner
from omniinfer.placement.layout import Placement
from omniinfer.placement.served import planner_config
from omniinfer.placement.staging import HostCopy, SlotStager, StagedWeights
from omniinfer.placement.transfers import logical_counts, plan_slot_copies
from omniinfer.platform import CPU, Platform, for_tensor
from omniinfer.sglang_plugin.placement.agreement import SwitchAgreement, SwitchBroken

logger = logging.getLogger("omniinfer")

STATE_DIR_ENV = "OMNIINFER_STATE_DIR"
STATUS_FILE = "placement.json"
SWITCH_DELAY_PASSES = 2  # first attempt: the slowest rank's pass + 2
SWITCH_ATTEMPTS = 3  # each retry waits 4x as many passes (2, 8, 32)
HISTORY_LIMIT = 200
FAILED_LAYOUTS_LIMIT = 64
COUNTERS = ("decisions", "migrations_adopted", "migrations_failed", "switches_aborted",
            "migrations_abandoned", "layouts_skipped")


@dataclasses.dataclass
class Staged:
    """Weights staged for one migration, waiting for their switch pass."""

    new_map: np.ndarray
    metadata: Any
    layers: list[int]
    weights: StagedWeights  # (layer, local slot) -> tensors, and their ready event
    record: dict[str, Any]


class PlacementController:
    """One per scheduler process; see the module docstring."""

    def __init__(self, manager: Any, config: OmniConfig) -> None:
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

        from omniinfer.sglang_plugin.ranks import tp_rank

        self.config = config
        # EPLBManager's private fields, declared in internals (EPLB_GET_MODEL, EPLB_MODEL_CONFIG)
        self.model = manager._get_model()
        self.model_config = manager._model_config
        self.metadata = get_global_expert_location_metadata()
        self.num_ranks = int(self.metadata.ep_size)
        rank = tp_rank()
        assert rank is not None, "the placement runtime runs inside a scheduler"
        self.rank = rank % self.num_ranks
        self.weights = routed_expert_weights(self.model)
        self.moe_layers = sorted(int(k) for k in self.weights.keys())
        self.num_experts = int(self.metadata.num_logical_experts)
        self.map = self.metadata.physical_to_logical_map_cpu.numpy().copy()
        self.per_rank = self.map.shape[1] // self.num_ranks
        # Separate groups so staging traffic never interleaves with the forward pass's
        # collectives: gloo for control messages, the device's library for weights on a device.
        ranks = list(range(dist.get_world_size()))
        self.group = dist.new_group(ranks=ranks, backend="gloo")
        self.platform = _weights_platform(self.weights)
        data_group = (dist.new_group(ranks=ranks, backend=self.platform.collective_backend)
                      if self.platform.is_device else self.group)
        self.stager = SlotStager(self.platform, self.rank, self.per_rank, self.weights, data_group)
        self.agreement: SwitchAgreement[Staged] = SwitchAgreement(self.group)
        self.versions = 0  # switch attempts so far: the same sequence on every rank
        self.failed_layouts: dict[str, dict[str, str]] = {}  # signature -> causes by rank
        self.inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.status: dict[str, Any] = {
            "enabled": True, "rank_count": self.num_ranks, "moe_layers": self.moe_layers,
            "trigger": config.omni_placement_trigger, "margin": config.omni_placement_margin,
            "interval_passes": config.omni_placement_interval, "decisions": [], "migrations": [],
            "layer_imbalance": {}, "counters": dict.fromkeys(COUNTERS, 0), "last_failure": None,
        }
        self.planner: DynamicPlanner | None = None
        if self.rank == 0:
            slots = self.map[self.moe_layers].reshape(len(self.moe_layers), self.num_ranks, self.per_rank)
            self.planner = DynamicPlanner(
                Placement(slots.copy(), self.num_experts),
                planner_config(config),
            )
        self.thread = threading.Thread(target=self._run, name="omni-placement", daemon=True)
        self.thread.start()
        self._write_status()
        logger.info("omniinfer: OmniPlacement on rank %d: %d MoE layers, %d ranks, %d slots per rank",
                    self.rank, len(self.moe_layers), self.num_ranks, self.per_rank)

    @property
    def passes(self) -> int:
        """Forward passes ended on this rank (the same count on every rank between passes)."""
        return self.agreement.passes

    # ------------------------------------------------------------------ main thread

    def on_counts(self, global_physical_count: torch.Tensor) -> None:
        if self.rank == 0:  # no host sync: the background thread waits for the copy
            counts_platform = for_tensor(global_physical_count)
            self.inbox.put(("counts", HostCopy.start(global_physical_count, counts_platform)))

    def on_forward_pass_end(self) -> None:
        """Count the pass; at a staged layout's target pass, vote and switch iff all agreed.
        Raises :class:`SwitchBroken` (fatal for the scheduler) when the ranks can no longer be
        known to share one expert map: a vote that timed out, a switch that failed anywhere."""
        self.agreement.pass_end(self._switch)
        if self.passes % self.config.omni_placement_interval == 0:
            self.inbox.put(("tick", self.passes))

    def _switch(self, staged: Staged) -> None:
        started = time.perf_counter()
        self.stager.last_switch = staged.weights.switch_in(self.weights, self.stager.device)
        self.metadata.update(staged.metadata, update_layer_ids=staged.layers)
        staged.record.update(switched_at_pass=self.passes, switched_unix=time.time(),
                             switch_ms=round(1000 * (time.perf_counter() - started), 3), state="adopted")
        self.inbox.put(("switched", staged.new_map))

    # ------------------------------------------------------------- background thread

    def _run(self) -> None:
        window = np.zeros((self.map.shape[0], self.num_experts))
        fold_map = self.map.copy()
        while True:
            kind, payload = self.inbox.get()
            if kind == "counts":
                window += logical_counts(payload.get().numpy(), fold_map, self.num_experts)
            elif kind == "switched":
                fold_map = payload
            elif kind == "tick":
                try:
                    self._tick(int(payload), window)
                except SwitchBroken as exc:  # no collective of this rank may follow
                    logger.error("omniinfer: placement thread on rank %d stopped: %s", self.rank, exc)
                    return
                except Exception as exc:  # keep serving on the old layout
                    logger.exception("omniinfer: placement tick failed: %s", exc)
                window[:] = 0.0

    def _tick(self, pass_id: int, window: np.ndarray) -> None:
        new_map = self._decide(pass_id, window) if self.rank == 0 else None
        header = torch.tensor([0 if new_map is None else 1], dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.group)
        if int(header.item()) == 0:
            return
        buffer = torch.from_numpy(new_map).to(torch.int64) if new_map is not None else \
            torch.empty(self.map.shape, dtype=torch.int64)
        dist.broadcast(buffer, src=0, group=self.group)
        self._migrate(pass_id, buffer.numpy().copy())

    def _decide(self, pass_id: int, window: np.ndarray) -> np.ndarray | None:
        """Rank 0: one Algorithm 2 step on the window's counts; the new map, or None (nothing
        adopted, or a layout that failed before: it is skipped and counted)."""
        assert self.planner is not None
        counts = window[self.moe_layers]
        if counts.sum() <= 0:
            return None
        counts = counts + 1e-6  # an idle expert must not make a layer's load undefined
        before = self.planner.placement.imbalance(counts)
        self.status["layer_imbalance"] = {
            str(layer): round(float(b), 4) for layer, b in zip(self.moe_layers, before, strict=True)
        }
        result = self.planner.observe(counts)
        triggered = [self.moe_layers[i] for i in np.flatnonzero(result.predicted_b > self.config.omni_placement_trigger)]
        adopted = [self.moe_layers[i] for i in result.adopted_layers]
        after = result.placement.imbalance(counts)
        decision: dict[str, Any] = {
            "pass": pass_id, "time": time.time(), "triggered_layers": triggered,
            "adopted_layers": adopted, "rejected_by_margin": sorted(set(triggered) - set(adopted)),
            "b_before": [round(float(b), 4) for b in before],
            "b_after_planned": [round(float(b), 4) for b in after],
        }
        self._remember("decisions", decision)
        self.status["counters"]["decisions"] += 1
        new_map: np.ndarray | None = None
        if adopted:
            new_map = self.map.copy()
            new_map[self.moe_layers] = result.placement.slots.reshape(len(self.moe_layers), -1)
            layout = layout_signature(new_map)
            if layout in self.failed_layouts:
                decision["skipped_failed_layout"] = layout
                self.status["counters"]["layouts_skipped"] += 1
                self._reset_planner(self.map)
                logger.info("omniinfer: placement layout %s not proposed again: it failed before "
                            "(%s)", layout, _causes_text(self.failed_layouts[layout]))
                new_map = None
        self._write_status()
        return new_map

    def _migrate(self, pass_id: int, new_map: np.ndarray) -> None:
        """Every rank, for the same decision: stage, agree that every rank staged, then switch
        at an agreed pass (:meth:`_switch_agreed`). Same collectives in the same order on every
        rank, whatever happens locally."""
        from sglang.srt.eplb.expert_location import ExpertLocationMetadata

        layout = layout_signature(new_map)
        record: dict[str, Any] = {"decided_at_pass": pass_id, "layout": layout, "state": "staging",
                                  "staging_started_unix": time.time()}
        started = time.perf_counter()
        old_map = self.map
        copies = plan_slot_copies(old_map, new_map, self.num_ranks, self.moe_layers)
        weights = StagedWeights({}, None, self.platform)
        cause: str | None = None
        metadata = None
        try:
            weights = self.stager.stage(copies)
            metadata = ExpertLocationMetadata.init_by_mapping(
                self.model_config, torch.from_numpy(new_map), moe_ep_rank=self.rank)
        except Exception as exc:  # reported below; every rank still joins the verdict
            cause = f"{type(exc).__name__}: {exc}"
            logger.error("omniinfer: placement migration decided at pass %d (layout %s) failed "
                         "on rank %d: %s", pass_id, layout, self.rank, cause)
            logger.debug("omniinfer: placement migration failure on rank %d", self.rank,
                         exc_info=True)
        verdict = torch.tensor([0 if cause else 1], dtype=torch.int64)
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=self.group)
        layers = sorted({c.layer for c in copies})
        record.update(
            layers=layers, slots_copied=len(copies),
            remote_copies=sum(1 for c in copies if not c.is_local),
            bytes_staged=weights.nbytes,
            staging_ms=round(1000 * (time.perf_counter() - started), 3), staged_unix=time.time(),
        )
        if int(verdict.item()) == 0:
            self._failed(record, cause, old_map)
        elif self._switch_agreed(Staged(new_map, metadata, layers, weights, record)):
            self.map = new_map
            self.status["counters"]["migrations_adopted"] += 1
            logger.info("omniinfer: placement migration adopted on rank %d: %s", self.rank, record)
        else:
            record["state"] = "abandoned: a rank was not ready at the switch pass; old layout kept"
            self.status["counters"]["migrations_abandoned"] += 1
            self._reset_planner(old_map)
        self._remember("migrations", record)
        self._write_status()

    def _switch_agreed(self, staged: Staged) -> bool:
        """Agree on a pass a little ahead of the slowest rank and post the layout for it; every
        rank votes at that pass (:class:`SwitchAgreement`). If a rank was not ready, every rank
        aborts that attempt and the next one waits 4x longer; True iff switched everywhere."""
        delay = SWITCH_DELAY_PASSES
        for attempt in range(1, SWITCH_ATTEMPTS + 1):
            latest = torch.tensor([self.passes], dtype=torch.int64)
            dist.all_reduce(latest, op=dist.ReduceOp.MAX, group=self.group)
            target = int(latest.item()) + delay
            self.versions += 1
            if self.agreement.propose(self.versions, target, staged):
                return True
            self.status["counters"]["switches_aborted"] += 1
            staged.record.setdefault("aborted_switch_passes", []).append(target)
            logger.warning("omniinfer: placement switch at pass %d aborted on rank %d: not every "
                           "rank was ready (attempt %d of %d)", target, self.rank, attempt,
                           SWITCH_ATTEMPTS)
            delay *= 4
        return False

    def _failed(self, record: dict[str, Any], cause: str | None, old_map: np.ndarray) -> None:
        """A staging failed somewhere: gather every rank's cause, count and report it, and
        remember the layout so that rank 0 does not propose it again."""
        gathered: list[str | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, cause, group=self.group)
        causes = {str(rank): c for rank, c in enumerate(gathered) if c is not None}
        layout = record["layout"]
        record.update(state="failed; old layout kept", causes=causes)
        self.status["counters"]["migrations_failed"] += 1
        self.status["last_failure"] = {"layout": layout, "decided_at_pass": record["decided_at_pass"],
                                       "causes": causes, "unix": time.time()}
        self.failed_layouts[layout] = causes
        while len(self.failed_layouts) > FAILED_LAYOUTS_LIMIT:
            del self.failed_layouts[next(iter(self.failed_layouts))]
        self._reset_planner(old_map)
        if self.rank == 0:
            logger.warning("omniinfer: placement migration decided at pass %d failed (%s); old "
                           "layout kept, layout %s will not be proposed again",
                           record["decided_at_pass"], _causes_text(causes), layout)

    def _reset_planner(self, current: np.ndarray) -> None:
        """Rank 0: the planner plans from the layout that serves, not from one never adopted."""
        if self.planner is not None:
            slots = current[self.moe_layers].reshape(len(self.moe_layers), self.num_ranks, self.per_rank)
            self.planner.placement = Placement(slots.copy(), self.num_experts)

    # -------------------------------------------------------------------- status

    def _remember(self, key: str, item: dict[str, Any]) -> None:
        history = self.status[key]
        history.append(item)
        del history[:-HISTORY_LIMIT]

    def _write_status(self) -> None:
        directory = os.environ.get(STATE_DIR_ENV)
        if self.rank != 0 or not directory:
            return
        path = Path(directory) / STATUS_FILE
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(self.status, default=str))
        partial.replace(path)


def routed_expert_weights(model: Any) -> Any:
    """{MoE layer id: its routed experts' weight tensors}, the descriptor SGLang's EPLB reads.
    Models that publish it (``routed_experts_weights_of_layer``: qwen3_moe, deepseek_v2, ...)
    give theirs; for one that does not (qwen2_moe) it is built the same way from each layer's
    ``mlp.get_moe_weights()``. A model with neither cannot migrate experts: a clear error."""
    published = getattr(model, "routed_experts_weights_of_layer", None)
    if published is not None:
        return published
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise RuntimeError(f"{type(model).__name__}: no routed expert weights to migrate")
    start = getattr(inner, "start_layer", 0)
    end = getattr(inner, "end_layer", len(layers))
    found = {i: layers[i].mlp.get_moe_weights() for i in range(start, end)
             if hasattr(getattr(layers[i], "mlp", None), "get_moe_weights")}
    if not found:
        raise RuntimeError(f"{type(model).__name__}: no MoE layer exposes get_moe_weights()")
    return found


def _weights_platform(weights: Any) -> Platform:
    """The platform of the expert weights (CPU when there are none)."""
    for tensors in weights.values():
        for tensor in tensors:
            return for_tensor(tensor)
    return CPU


def layout_signature(physical_to_logical: np.ndarray) -> str:
    """A short stable name of a whole physical-to-logical map (the same on every rank)."""
    data = np.ascontiguousarray(physical_to_logical, dtype=np.int64).tobytes()
    return hashlib.sha1(data).hexdigest()[:16]


def _causes_text(causes: dict[str, str]) -> str:
    return "; ".join(f"rank {rank}: {cause}" for rank, cause in causes.items()) or "no cause"
