"""Extractive question answering over a long context, with and without each shipped pattern,
through real patterned SGLang servers: task accuracy in the spirit of the paper's Table 3.

Questions (made here with a fixed seed from the held-out halves of shipped texts the searches
did not read): a window of ``context`` tokens of running text, then::

    Question: In the text above, how does the sentence that begins "<first words>" continue?
    Answer: "<first words>

and the answer is the sentence's next ``--answer-tokens`` tokens, which only the context holds
(the opening is unique in the window, whitespace taken as single spaces; the sentence ends at
least the patterns' recent window + 64 tokens before the question, so a compressed layer has
evicted it). A question is right when the
server's greedy tokens equal them. Every condition answers the same questions: a plain server
("none") and one server per pattern file at that context, started one after another.

Prints accuracy per condition and context with the difference to "none" in points; writes
``results/qa_accuracy.json``.

    .venv/bin/python benchmark/attn/qa_accuracy.py                      # 2K: three servers
    .venv/bin/python benchmark/attn/qa_accuracy.py --contexts 4096 --questions 20
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

from tqdm import tqdm

from omniinfer.attn import evaluator, text
from omniinfer.bench.records import recorded_args, write_results

HERE = Path(__file__).resolve().parent
PATTERNS = HERE.parents[1] / "python" / "omniinfer" / "attn" / "patterns"
BY_CONTEXT = {2048: ("smollm2-135m.json", "smollm2-135m-2k-25.json"),
              4096: ("smollm2-135m-4k.json", "smollm2-135m-4k-30.json"),
              8192: ("smollm2-135m-8k.json",)}
TEXTS = ("alice", "lcet10", "kjv_exodus", "python_datamodel", "asyoulik", "licences")
QUESTION = '\n\nQuestion: In the text above, how does the sentence that begins "{lead}" continue?\nAnswer: "{lead}'
LEAD_WORDS = 8


def make_questions(tokenizer: Any, context: int, count: int, answer_tokens: int, seed: int,
                   recent: int) -> list[dict[str, Any]]:
    """``count`` questions of exactly ``context`` prompt tokens, spread over ``TEXTS``, each
    answer at least ``recent`` + 64 tokens before the end of the prompt (outside the recent
    window of every pattern it is asked under)."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    tokens = {name: tokenizer(text.part(text.read(name), "heldout"),
                              add_special_tokens=False)["input_ids"] for name in TEXTS}
    names = [name for name in TEXTS if len(tokens[name]) >= context + 64]
    latest = 1.0 - (recent + 64) / context  # the deepest a sentence may start
    if not names or latest <= 0.1:
        raise SystemExit(f"no text long enough for {context}-token questions past the window")
    attempts = 0
    while len(out) < count:
        attempts += 1
        if attempts > 200 * count:
            raise SystemExit(f"could not make {count} questions at {context} tokens")
        name = names[len(out) % len(names)]
        ids = tokens[name]
        start = rng.randrange(0, len(ids) - context - 64)
        window = tokenizer.decode(ids[start:start + context])
        flat = re.sub(r"\s+", " ", window)  # line breaks inside sentences become spaces
        depth_goal = rng.uniform(0.05, latest - 0.05)
        sentences = [m for m in re.finditer(r"(?<=[.!?] )([A-Z][^.!?]{40,300}[.!?])", flat)
                     if abs(m.start() / len(flat) - depth_goal) < 0.05
                     and m.end() / len(flat) <= latest]
        if not sentences:
            continue
        match = sentences[0]
        words = match.group(1).split()
        if len(words) < LEAD_WORDS + 4:
            continue
        lead = " ".join(words[:LEAD_WORDS])
        if flat.count(lead) != 1:
            continue
        answer = tokenizer(" " + " ".join(words[LEAD_WORDS:]), add_special_tokens=False)[
            "input_ids"][:answer_tokens]
        question = tokenizer(QUESTION.format(lead=lead), add_special_tokens=False)["input_ids"]
        keep = context - len(question)
        body = tokenizer(window, add_special_tokens=False)["input_ids"][:keep]
        if len(answer) < answer_tokens or len(body) < keep:
            continue
        if match.group(1) not in re.sub(r"\s+", " ", tokenizer.decode(body)):
            continue  # the answer must be in the prompt
        out.append({"text": name, "depth": match.start() / len(flat), "lead": lead,
                    "prompt": body + question, "answer": answer})
    return out


def ask(base_url: str, questions: list[dict[str, Any]], label: str) -> list[bool]:
    right = []
    for q in tqdm(questions, desc=label, unit="q"):
        body = {"input_ids": q["prompt"], "sampling_params": {
            "max_new_tokens": len(q["answer"]), "temperature": 0.0, "ignore_eos": True}}
        request = urllib.request.Request(f"{base_url}/generate", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=1800) as reply:
            out = json.loads(reply.read())
        right.append(list(out["output_ids"]) == q["answer"])
    return right


def serve(args: argparse.Namespace, pattern: Path | None, context: int,
          questions: list[dict[str, Any]], label: str) -> list[bool]:
    from omniinfer.child_process import free_port
    from omniinfer.cpu.server_env import cpu_env
    from omniinfer.testbed.servers import SGLangServer, cpu_server_command

    port = free_port()
    extra = ["--chunked-prefill-size", "512", "--disable-radix-cache"]
    if pattern is not None:
        extra += ["--omni-attn-pattern", str(pattern)]
    command = cpu_server_command(args.model, port, 2 * context + 512, extra_args=extra)
    log = args.out.parent / "logs" / f"qa-{label}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with SGLangServer(command, cpu_env(), log, port, ready_timeout_s=900) as server:
        return ask(server.base_url, questions, label)



def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=evaluator.DEFAULT_MODEL)
    p.add_argument("--contexts", default="2048")
    p.add_argument("--questions", type=int, default=40)
    p.add_argument("--answer-tokens", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=HERE / "results" / "qa_accuracy.json")
    args = p.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    results: dict[str, Any] = {"args": recorded_args(args, HERE.parents[1]), "contexts": {}}
    began = time.perf_counter()
    for context in [int(c) for c in args.contexts.split(",")]:
        recent = max((json.loads((PATTERNS / n).read_text())["recent"]
                      for n in BY_CONTEXT.get(context, ())), default=0)
        questions = make_questions(tokenizer, context, args.questions, args.answer_tokens,
                                   args.seed, recent)
        rows: dict[str, Any] = {}
        for name in ("none", *BY_CONTEXT.get(context, ())):
            pattern = None if name == "none" else PATTERNS / name
            right = serve(args, pattern, context, questions, f"{context}-{Path(name).stem}")
            rows[name] = {"accuracy": sum(right) / len(right), "right": right}
        base = rows["none"]["accuracy"]
        for name, row in rows.items():
            row["points_vs_none"] = 100.0 * (row["accuracy"] - base)
            print(f"{context:>6} {name:<28} {100 * row['accuracy']:5.1f} % "
                  f"({row['points_vs_none']:+.1f} points)", flush=True)
        results["contexts"][str(context)] = {
            "questions": [{k: q[k] for k in ("text", "depth", "lead")} for q in questions],
            "rows": rows}
    results["seconds"] = time.perf_counter() - began
    write_results(args.out, results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
