"""``kvserve bench sinks``: what StreamingLLM's attention sinks buy, as perplexity on
held-out text several times longer than the model's training context.

Each held-out text (the embedded model's held-out split by default) is cut to
``--context-factor`` times the training length and scored token by token (prompt
logprobs) three ways: with a sliding window as long as the training context
(``window``); with ``--sinks`` first tokens kept beside a window shorter by as many, the
same KV either way (``sinks``); and, for reference, in independent pieces of the
training length, each inside what the model saw in training (``pieces``). Reported:
perplexity over every scored token and over those past the first training length,
where the window has started to drop tokens.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvserve.bench.experiments.spec import heldout_texts


def _token_logprobs(llm: Any, texts: list[list[int]]) -> list[list[float]]:
    from kvserve import SamplingParams

    outs = llm.generate([{"prompt_token_ids": t} for t in texts], SamplingParams(
        temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=True)
    return [[e[t].logprob for e, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
            for o in outs]


def _perplexity(logprobs: list[list[float]], start: int) -> float:
    """exp of the mean negative logprob of the tokens at positions >= ``start``."""
    scored = [lp for text in logprobs for lp in text[max(0, start - 1):]]
    return math.exp(-sum(scored) / len(scored))


def run_sinks_bench(model_dir: str | None, texts: list[list[int]], trained: int, sinks: int,
                    engine_args: dict[str, Any]) -> dict[str, Any]:
    from kvserve import LLM

    length = len(texts[0])
    runs: dict[str, list[list[float]]] = {}
    for name, window, kept in (("window", trained, 0), ("sinks", trained - sinks, sinks)):
        llm = LLM(model_dir, attention_window=window, attention_sinks=kept,
                  max_model_len=length + 1, **engine_args)
        runs[name] = _token_logprobs(llm, texts)
        llm.engine.close()
    llm = LLM(model_dir, **engine_args)
    pieces = [t[i:i + trained] for t in texts for i in range(0, length, trained)]
    runs["pieces"] = _token_logprobs(llm, pieces)  # each piece's tokens after its first
    llm.engine.close()
    return {"texts": len(texts), "tokens_per_text": length, "training_context": trained,
            "sinks": sinks, "windows": {"window": trained, "sinks": trained - sinks},
            "perplexity": {name: _perplexity(lps, 0) for name, lps in runs.items()},
            # the pieces' positions restart, all within training: not past it
            "perplexity_past_training_context": {
                name: _perplexity(runs[name], trained) for name in ("window", "sinks")}}


def _training_context(model_dir: Path) -> int:
    info = model_dir / "training_info.json"
    if info.is_file():
        return int(json.loads(info.read_text())["training"]["seq_len"])
    return int(json.loads((model_dir / "config.json").read_text())["max_position_embeddings"])


def cmd_sinks(args) -> int:
    """``kvserve bench sinks``: perplexity past the training context with and without
    attention sinks."""
    from kvserve.bench.bench_args import engine_args_from, resolve_model_dir
    from kvserve.bench.bench_setup import _header
    from kvserve.bench.reports import report
    from kvserve.model.tokenizer import Tokenizer

    model_dir = resolve_model_dir(args.model)
    engine_args = engine_args_from(args)
    trained = args.training_context or _training_context(model_dir)
    length = args.context_factor * trained
    tok = Tokenizer(model_dir)
    texts = [ids[:length] for ids in (tok.encode(t, add_special_tokens=False) for t in
                                      heldout_texts(model_dir, 10 * args.num_texts))
             if len(ids) >= length][:args.num_texts]
    if not texts:
        raise SystemExit(f"no held-out text has {length} tokens")
    info = _header("kvserve sinks", {"model": model_dir.name, "texts": len(texts),
                                     "tokens_per_text": length, "training_context": trained,
                                     "sinks": args.sinks, "engine_args": engine_args})
    res = run_sinks_bench(str(model_dir), texts, trained, args.sinks, engine_args)
    ppl, past = res["perplexity"], res["perplexity_past_training_context"]
    print(f"perplexity over {len(texts)} texts of {length} tokens: window {ppl['window']:.2f}, "
          f"{args.sinks} sinks + window {ppl['sinks']:.2f}, {trained}-token pieces "
          f"{ppl['pieces']:.2f}; past the first {trained} tokens: window "
          f"{past['window']:.2f}, sinks {past['sinks']:.2f}")
    if args.json:
        name = "the embedded model" if args.model is None else model_dir.name
        out = {"machine": info, "model": name, "engine_args": engine_args, "result": res}
        print(f"wrote {report.write_json(args.json, out)}")
    return 0
