"""The emulator's /metrics against SGLang's own definitions (read from the installed package's
source, not imported: its collectors need a running server) and the exposition format."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from omniinfer.emulator.engine import EmulatedEngine
from omniinfer.emulator.metrics import SCHEDULER_LABELS, TOKENIZER_LABELS, WorkerMetrics
from omniinfer.emulator.profile import load_profile
from omniinfer.emulator.request import EmuRequest
from omniinfer.emulator.status import WorkerInfo

KINDS = {"Gauge": "gauge", "Counter": "counter", "Histogram": "histogram"}


def _sglang_definitions() -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """``name -> (type, help, label names)`` of every metric SGLang 0.5.23 declares."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    folder = Path(spec.submodule_search_locations[0]) / "srt" / "observability"
    labels = {"SchedulerMetricsCollector": dict.fromkeys(SCHEDULER_LABELS, ""),
              "TokenizerMetricsCollector": dict.fromkeys(TOKENIZER_LABELS, ""),
              "_HttpRequestMetrics": {}}
    out: dict[str, tuple[str, str, tuple[str, ...]]] = {}
    for file in ("metrics_collector.py", "http_request_metrics.py"):
        for cls in ast.walk(ast.parse((folder / file).read_text())):
            if not isinstance(cls, ast.ClassDef) or cls.name not in labels:
                continue
            for call in ast.walk(cls):
                if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
                    continue
                kw = {k.arg: k.value for k in call.keywords}
                if call.func.id not in KINDS or not isinstance(kw.get("name"), ast.Constant):
                    continue
                try:  # the plain declarations; computed ones (f-strings, loops) are not ours
                    help_text = ast.literal_eval(kw["documentation"])
                    names = eval(compile(ast.Expression(kw["labelnames"]), file, "eval"),  # noqa: S307
                                 {"labels": labels[cls.name], "list": list}) if "labelnames" in kw else ()
                except (ValueError, NameError, TypeError):
                    continue
                out[kw["name"].value] = (KINDS[call.func.id], help_text, tuple(names))
    return out


def _render(model_name: str = "SmolLM2-135M-Instruct") -> str:
    profile = load_profile("cpu-smollm2")
    profile = dataclasses.replace(profile, model=dataclasses.replace(profile.model,
                                                                     served_model_name=model_name))

    async def run() -> str:
        engine = EmulatedEngine(profile, time_scale=0)
        engine.start()
        for stream in (False, True):
            request = engine.submit(EmuRequest([5, 6, 7], 3, stream=stream))
            while not request.finished:
                await request.wait_progress()
        await engine.stop()
        info = WorkerInfo(profile, "null", "127.0.0.1", 1, 2, 0.0)
        metrics = WorkerMetrics(info, engine)
        metrics.http.started("/generate", "POST")
        metrics.http.finished("/generate", "POST", 200)
        return metrics.render().decode()

    return asyncio.run(run())


def test_every_series_is_declared_by_sglang_with_the_same_type_help_and_labels() -> None:
    sglang = _sglang_definitions()
    assert len(sglang) > 50  # the parse found SGLang's collectors
    families = list(text_string_to_metric_families(_render()))
    assert len(families) >= 25
    for family in families:
        name = family.name + ("_total" if family.type == "counter" else "")
        assert name in sglang, name
        kind, help_text, labels = sglang[name]
        assert (family.type, family.documentation) == (kind, help_text), name
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == set(labels), (name, sample.labels)


def test_counters_and_histograms_follow_the_engine() -> None:
    samples = {(s.name, s.labels.get("is_streaming"), s.labels.get("le")): s.value
               for f in text_string_to_metric_families(_render()) for s in f.samples}
    for stream in ("false", "true"):
        assert samples[("sglang:num_requests_total", stream, None)] == 1
        assert samples[("sglang:generation_tokens_total", stream, None)] == 3
        assert samples[("sglang:prompt_tokens_total", stream, None)] == 3
        assert samples[("sglang:time_to_first_token_seconds_count", stream, None)] == 1
        assert samples[("sglang:e2e_request_latency_seconds_bucket", stream, "+Inf")] == 1
    assert samples[("sglang:inter_token_latency_seconds_count", None, None)] == 4  # 2 per request
    assert samples[("sglang:http_responses_total", None, None)] == 1


def test_label_values_are_escaped() -> None:
    odd = 'model "quoted" \\ back\nslash'
    families = list(text_string_to_metric_families(_render(odd)))
    values: set[Any] = {s.labels["model_name"] for f in families for s in f.samples
                        if "model_name" in s.labels}
    assert values == {odd}
