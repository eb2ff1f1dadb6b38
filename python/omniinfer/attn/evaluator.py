"""Score a layer pattern on a real Hugging Face causal LM in one forward pass per window.

Compressed layers get the sink+recent mask of :mod:`omniinfer.attn.masks`, which is what a
decoder that evicted the other tokens' KV sees (``test/attn`` proves it against real eviction),
so one pass over a long window scores every position at once. The uncompressed model's
per-token losses and next-token choices are computed once and cached; each pattern then costs
one forward pass per window. Only positions t >= sink + recent are scored: before that no
token has been evicted and every pattern equals the full model. With ``reference_dir`` the
uncompressed pass is also kept on disk, keyed by the model, the window tokens and the first
scored position, so a later run on the same windows skips it (at 8K it costs a pattern's time).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from omniinfer.attn import masks
from omniinfer.attn.pattern import kv_saved_fraction

DEFAULT_MODEL = Path(__file__).resolve().parents[3] / ".cache" / "models" / "SmolLM2-135M-Instruct"
LOGIT_CHUNK = 512  # rows of the LM head computed at once (a 2K x vocab block is large)
NOISE_BLOCK = 64  # tokens per block for the standard error (neighbouring tokens correlate)


# Model types whose attention transformers routes through ``AttentionInterface`` with one
# layer index per decoder layer: the families the per-layer masks are tested on or share code with.
MASKABLE = ("llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
DEVICES = ("cpu", "cuda", "npu")


def check_family(config: Any) -> None:
    """Raise ValueError (one line) unless every layer of ``config``'s model can be masked."""
    kind = getattr(config, "model_type", None)
    if kind not in MASKABLE:
        raise ValueError(f"model type {kind!r} is not one the search can mask "
                         f"(supported: {', '.join(MASKABLE)})")
    layer_types = getattr(config, "layer_types", None) or ()
    sliding = [i for i, t in enumerate(layer_types) if t != "full_attention"]
    if kind == "mistral" and getattr(config, "sliding_window", None):
        sliding = list(range(int(config.num_hidden_layers)))
    if sliding:
        raise ValueError(f"layers {sliding[:4]}{'...' if len(sliding) > 4 else ''} use "
                         "sliding-window attention, which a sink+recent window cannot replace")


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda`` or ``npu`` (Ascend, through torch_npu); ValueError when unavailable."""
    if name not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible")
    if name == "npu":
        try:
            import torch_npu  # noqa: F401  (registers the npu device with torch)
        except ImportError:
            raise ValueError("--device npu needs torch_npu installed") from None
    return torch.device(name)


def load_model(model_dir: str | Path, device: str = "cpu") -> tuple[Any, Any]:
    """Model in float32 with the per-layer attention on ``device``, and its tokenizer.
    ValueError when the model's family cannot be masked or the device is missing."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    check_family(AutoConfig.from_pretrained(model_dir))
    where = resolve_device(device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    masks.use(model)
    return model.to(where), tokenizer


@dataclass(frozen=True)
class WindowScores:
    """Per scored position of one window: loss of the true next token, the argmax token."""

    nll: torch.Tensor
    choice: torch.Tensor


@dataclass(frozen=True)
class Metrics:
    ppl_full: float
    ppl_pattern: float
    drop: float  # relative perplexity increase: ppl_pattern / ppl_full - 1
    drop_stderr: float  # standard error of ``drop`` from the spread of 64-token blocks
    agreement: float  # share of scored positions where the argmax equals the full model's
    tokens: int
    seconds: float

    def to_json(self) -> dict[str, float | int]:
        return asdict(self)


def score_windows(
    model: Any,
    windows: Sequence[Sequence[int]],
    start: int,
    omni_windows: masks.Windows | None,
) -> list[WindowScores]:
    """Loss and argmax at positions t >= ``start`` (predicting token t + 1) of each window."""
    backbone, head = model.get_decoder(), model.get_output_embeddings()
    results = []
    with torch.inference_mode():
        for ids in windows:
            tokens = torch.tensor([list(ids)], device=model.device)
            hidden = backbone(input_ids=tokens, omni_windows=omni_windows).last_hidden_state
            hidden, targets = hidden[0, start:-1], tokens[0, start + 1 :]
            nll, choice = [], []
            for i in range(0, hidden.shape[0], LOGIT_CHUNK):
                logits = head(hidden[i : i + LOGIT_CHUNK]).float()
                logp = torch.log_softmax(logits, dim=-1)
                nll.append(-logp.gather(1, targets[i : i + LOGIT_CHUNK, None])[:, 0])
                choice.append(logits.argmax(dim=-1))
            results.append(WindowScores(torch.cat(nll).cpu(), torch.cat(choice).cpu()))
    return results


def compare(reference: list[WindowScores], scored: list[WindowScores]) -> dict[str, float]:
    """Perplexities, relative increase with its standard error, and argmax agreement."""
    full = torch.cat([r.nll for r in reference]).double()
    pattern = torch.cat([s.nll for s in scored]).double()
    diff = pattern - full
    blocks = [d.mean() for d in torch.split(diff, NOISE_BLOCK) if d.numel() == NOISE_BLOCK]
    spread = torch.stack(blocks).std().item() / math.sqrt(len(blocks)) if len(blocks) > 1 else 0.0
    agree = torch.cat([r.choice == s.choice for r, s in zip(reference, scored, strict=True)])
    ratio = math.exp(diff.mean().item())
    return {
        "ppl_full": math.exp(full.mean().item()),
        "ppl_pattern": math.exp(pattern.mean().item()),
        "drop": ratio - 1.0,
        "drop_stderr": ratio * spread,
        "agreement": agree.double().mean().item(),
        "tokens": int(full.numel()),
    }


def cached_reference(
    model: Any, windows: Sequence[Sequence[int]], start: int, reference_dir: Path | None
) -> list[WindowScores]:
    """The uncompressed model's scores on ``windows`` from ``start``, read from or written to
    ``reference_dir`` when given (a file per model, windows and start; nothing else in it)."""
    if reference_dir is None:
        return score_windows(model, windows, start, None)
    key = hashlib.sha1(f"{model.config.name_or_path}|{start}|".encode())
    for ids in windows:
        key.update((",".join(map(str, ids)) + "|").encode())
    path = Path(reference_dir) / f"reference-{key.hexdigest()[:16]}.pt"
    if path.exists():
        saved = torch.load(path)
        return [WindowScores(nll, choice) for nll, choice in saved]
    reference = score_windows(model, windows, start, None)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    torch.save([(r.nll, r.choice) for r in reference], partial)
    partial.replace(path)
    return reference


class Evaluator:
    """Scores patterns (per-layer compressed flags) on fixed windows against the full model."""

    def __init__(
        self,
        model: Any,
        windows: Sequence[Sequence[int]],
        sink: int,
        recent: int,
        reference_dir: Path | None = None,
    ) -> None:
        lengths = {len(w) for w in windows}
        if not windows or len(lengths) != 1 or lengths.pop() <= sink + recent + 1:
            raise ValueError("windows must be non-empty, equally long and longer than sink+recent")
        self.model = model
        self.windows = [list(w) for w in windows]
        self.sink, self.recent = sink, recent
        self.num_layers = int(model.config.num_hidden_layers)
        self.context = len(self.windows[0])
        self.reference = cached_reference(model, self.windows, sink + recent, reference_dir)

    def evaluate(self, compressed: Sequence[bool]) -> Metrics:
        if len(compressed) != self.num_layers:
            raise ValueError(f"pattern has {len(compressed)} layers, model {self.num_layers}")
        began = time.perf_counter()
        windows = masks.windows_for(tuple(compressed), self.sink, self.recent)
        scored = score_windows(self.model, self.windows, self.sink + self.recent, windows)
        figures = compare(self.reference, scored)
        return Metrics(**figures, seconds=time.perf_counter() - began)

    def kv_saved_fraction(self, compressed: Sequence[bool], context: int | None = None) -> float:
        return kv_saved_fraction(
            sum(map(bool, compressed)), self.num_layers, self.sink, self.recent,
            context or self.context,
        )


class TextSetEvaluator:
    """Scores a pattern on several texts at once and judges it by the worst of them.

    A pattern that holds on one text can fail on another kind (code, a report), so the search
    objective is the largest per-text drop: meeting a bound then means meeting it on every text
    of the set. Per-text figures travel along for reports.
    """

    def __init__(
        self, model: Any, windows: dict[str, Sequence[Sequence[int]]], sink: int, recent: int,
        reference_dir: Path | None = None,
    ) -> None:
        if not windows:
            raise ValueError("no texts to score on")
        self.texts = {name: Evaluator(model, w, sink, recent, reference_dir)
                      for name, w in windows.items()}
        first = next(iter(self.texts.values()))
        self.num_layers, self.context = first.num_layers, first.context
        self.kv_saved_fraction = first.kv_saved_fraction

    def evaluate(self, compressed: Sequence[bool]) -> dict[str, Any]:
        began = time.perf_counter()
        per_text = {name: ev.evaluate(compressed) for name, ev in self.texts.items()}
        worst = max(per_text, key=lambda name: per_text[name].drop)
        return {
            "drop": per_text[worst].drop,
            "drop_stderr": per_text[worst].drop_stderr,
            "worst_text": worst,
            "drop_mean": sum(m.drop for m in per_text.values()) / len(per_text),
            "agreement": min(m.agreement for m in per_text.values()),
            "tokens": sum(m.tokens for m in per_text.values()),
            "seconds": time.perf_counter() - began,
            "texts": {name: m.to_json() for name, m in per_text.items()},
        }
