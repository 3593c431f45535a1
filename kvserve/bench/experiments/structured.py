"""``kvserve bench structured``: JSON-schema-constrained decoding against the same requests
unconstrained, in alternating rounds on one engine.

Every request generates exactly ``max_tokens`` tokens (EOS ignored; once a constrained
answer is complete only EOS is allowed, so it keeps paying for its masks), so output
tokens per second compare like with like. Reported: tok/s both ways and their ratio
(the median of the rounds' ratios, kvserve.bench.instruments.paired), and the mask time per
constrained token and as a share of the constrained run.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

from kvserve.bench.instruments.paired import paired_ratio

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "count": {"type": "integer", "minimum": 0, "maximum": 1000},
    "tags": {"type": "array", "items": {"enum": ["io", "net", "db", "ui"]}, "maxItems": 4},
    "nested": {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                "ratio": {"type": "number"}},
               "required": ["ok"], "additionalProperties": False}},
    "required": ["name", "count", "tags", "nested"], "additionalProperties": False}

PROMPTS = ["def load_config(path):\n    # returns the settings as JSON\n    return ",
           "class Service:\n    defaults = ", "RESPONSE = ", "# a record\nrecord = "]


def run_structured_bench(model: str | None, num_requests: int, max_tokens: int, rounds: int,
                         log: Callable[[str], None] = print) -> dict[str, Any]:
    from kvserve import LLM, SamplingParams
    from kvserve.structured_output import StructuredOutputsParams

    llm = LLM(model)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(num_requests)]
    plain = SamplingParams(temperature=0.8, max_tokens=max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.8, max_tokens=max_tokens, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    manager, runner = llm.engine.structured, llm.engine.worker.runner
    llm.generate(prompts[:2], constrained, use_tqdm=False)  # compile the schema, warm up
    rates: dict[str, list[float]] = {"plain": [], "constrained": []}
    mask_s = rows = wait_s = 0.0
    wall = 0.0
    for i in range(rounds):
        order = (("plain", plain), ("constrained", constrained))
        for name, params in order if i % 2 == 0 else order[::-1]:
            before = (manager.mask_seconds, manager.masked_rows, runner.mask_wait_seconds)
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            rates[name].append(tokens / seconds)
            if name == "constrained":
                mask_s += manager.mask_seconds - before[0]
                rows += manager.masked_rows - before[1]
                wait_s += runner.mask_wait_seconds - before[2]
                wall += seconds
        log(f"  round {i + 1} of {rounds}: unconstrained {rates['plain'][-1]:.1f} tok/s, "
            f"json_schema {rates['constrained'][-1]:.1f} tok/s "
            f"({rates['constrained'][-1] / rates['plain'][-1]:.2f}x)")
    return {"requests": num_requests, "max_tokens": max_tokens, "rounds": rounds,
            "schema": SCHEMA, "plain_tok_s": statistics.median(rates["plain"]),
            "constrained_tok_s": statistics.median(rates["constrained"]),
            "ratio": paired_ratio(rates["constrained"], rates["plain"]),
            "mask_us_per_token": 1e6 * mask_s / rows if rows else None,
            "mask_share_of_run": mask_s / wall if wall else None,
            # the part of it the step waited for (the rest overlapped the model's forward)
            "mask_wait_share_of_run": wait_s / wall if wall else None}
