"""``kvserve bench spec``: speculative decoding against speculation off, in one run.

Workloads on real code (the embedded model and its tokenizer):

- ``heldout``: the start of each held-out Python file of the embedded model's corpus
  (files it never trained on), continued greedily;
- ``repeat``: a held-out file's start, then a comment and the same code again, cut
  after a few lines; the continuation re-emits the code (with whatever edits the model
  makes), where prompt lookup has the most to find;

and any ``kvserve bench`` workload (e.g. ``mixed`` on bench-100m) for throughput.
Each mode runs in alternating rounds with speculation off on the same machine; a mode
runs the requests one at a time (single stream) or all at once (batched). Reported:
output tok/s, the ratio to speculation off (the median of the rounds' ratios,
kvserve.bench.instruments.paired), draft acceptance rate and mean acceptance length; and the step
cost the engine measured at start for 1..9 rows.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from kvserve.bench.instruments.paired import paired_ratio
from kvserve.bench.workloads.definitions import BenchRequest
from kvserve.default_model import training_corpus_dir

SPEC_WORKLOADS = ("heldout", "repeat")


def heldout_texts(model_dir: str | Path, num: int) -> list[str]:
    """Texts of up to ``num`` held-out files, read from this interpreter's stdlib (the
    list is in the embedded model's training_info.json)."""
    info = json.loads((Path(model_dir) / "training_info.json").read_text())
    root = training_corpus_dir()
    texts = []
    for rel in info["corpus"]["heldout_files"]:
        path = root / rel
        if path.is_file():
            text = path.read_text(errors="replace")
            if len(text) > 2000:
                texts.append(text)
        if len(texts) == num:
            break
    if not texts:
        raise FileNotFoundError(f"none of the held-out files is under {root}")
    return texts


def _cut(tokenizer, text: str, max_tokens: int) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)[:max_tokens]


def spec_workload(name: str, model_dir: str | Path, tokenizer, num: int, prompt_tokens: int,
                  max_tokens: int) -> list[BenchRequest]:
    texts = heldout_texts(model_dir, num)
    if name == "heldout":
        return [BenchRequest(_cut(tokenizer, t, prompt_tokens), max_tokens) for t in texts]
    if name == "repeat":
        reqs = []
        for text in texts:
            code = _cut(tokenizer, text, prompt_tokens)
            again = tokenizer.encode("\n\n# The same code again, edited:\n",
                                     add_special_tokens=False)
            head = code[:max(8, len(code) // 8)]
            reqs.append(BenchRequest(code + again + head, max_tokens))
        return reqs
    raise ValueError(f"spec workload must be one of {list(SPEC_WORKLOADS)}, got {name!r}")


@dataclass
class SpecRun:
    output_tokens: int
    seconds: float
    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafts: int = 0

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds


def _run(llm: Any, requests: Sequence[BenchRequest], single_stream: bool) -> SpecRun:
    from kvserve import SamplingParams

    spec = llm.engine.speculator
    before = asdict(spec.stats) if spec is not None else None
    llm.reset_prefix_cache()  # every run computes its prompts
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
              for r in requests]
    start = time.perf_counter()
    if single_stream:
        outs = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    run = SpecRun(sum(len(o.outputs[0].token_ids) for o in outs), seconds)
    if spec is not None:
        now = asdict(spec.stats)
        run.draft_tokens = now["num_draft_tokens"] - before["num_draft_tokens"]
        run.accepted_tokens = now["num_accepted_tokens"] - before["num_accepted_tokens"]
        run.drafts = now["num_drafts"] - before["num_drafts"]
    if llm.engine.kv.stats().num_used_blocks:
        raise RuntimeError("KV blocks still held after a run")
    return run


def run_spec_bench(model_dir: str | Path | None, requests: Sequence[BenchRequest],
                   speculative_config: dict, engine_args: dict[str, Any], rounds: int,
                   single_stream: bool, log: Callable[[str], None] = print
                   ) -> dict[str, Any]:
    """Speculation off and on over ``requests`` in alternating rounds: each side's
    median tok/s and on over off paired by round."""
    from kvserve import LLM

    off = LLM(None if model_dir is None else str(model_dir), **engine_args)
    on = LLM(None if model_dir is None else str(model_dir), speculative_config=speculative_config,
             **engine_args)
    off.engine.settle()
    on.engine.settle()
    _run(off, requests[:1], single_stream)  # warm both before timing
    _run(on, requests[:1], single_stream)
    runs: dict[str, list[SpecRun]] = {"off": [], "on": []}
    for i in range(rounds):
        for name, llm in (("off", off), ("on", on)) if i % 2 == 0 else (("on", on),
                                                                        ("off", off)):
            runs[name].append(_run(llm, requests, single_stream))
        ratio = runs["on"][-1].tok_s / runs["off"][-1].tok_s
        log(f"  round {i + 1} of {rounds}: off {runs['off'][-1].tok_s:.1f} tok/s, "
            f"on {runs['on'][-1].tok_s:.1f} tok/s ({ratio:.2f}x)")
    drafted = sum(r.draft_tokens for r in runs["on"])
    accepted = sum(r.accepted_tokens for r in runs["on"])
    drafts = sum(r.drafts for r in runs["on"])
    cost = on.engine.speculator.cost
    step_ms = {int(r): 1000 * float(t) for r, t in zip(cost.rows, cost.seconds)}
    return {
        "single_stream": single_stream, "requests": len(requests),
        "output_tokens": runs["off"][0].output_tokens,
        "off_tok_s": statistics.median(r.tok_s for r in runs["off"]),
        "on_tok_s": statistics.median(r.tok_s for r in runs["on"]),
        "speedup": paired_ratio([r.tok_s for r in runs["on"]], [r.tok_s for r in runs["off"]]),
        "draft_tokens": drafted, "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "step_ms_by_rows": step_ms,
        "verify_cost_vs_one_row": {k: cost(k + 1) / cost(1) for k in range(1, 9)},
    }
