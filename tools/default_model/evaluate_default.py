"""Judge the embedded model as a user meets it, on what it never trained on.

    python -m tools.default_model.evaluate_default [--model DIR] [--draft DIR] \
        [--baseline DIR] [--out docs/results/default-model-<machine>.json]

Measured, for the model (and for ``--baseline``, another model directory, in the same
run on the same machine):

- **bits per byte** on the first held-out files (the split in its training_info.json)
  up to ``--bpb-bytes``, the training script's method, against ``gzip -9`` on the same
  bytes (the training script's training_info.json has all of them);
- **repetition**: each held-out function header (its ``def`` line(s), dedented)
  continued for 64 tokens by kvserve with the model's ``generation_config.json``
  defaults; the share whose continuation repeats some 8-token sequence, beside the same
  share of the 64 tokens that follow each header in its file; and again with each header
  ending at its colon, as a user types it;
- **chat**: each held-out instruction pair's request ("Write a Python function:
  <docstring summary>") through the chat template; the share of answers that parse as
  Python and define a function, and of those whose docstring holds a doctest, how many
  pass it against the generated function (run in a subprocess, in its module's
  namespace, with a time limit);
- **speed**: the time ``LLM()`` takes to be ready in a fresh process, as a user's script
  meets it (the median of three; the import of kvserve, torch's mostly, beside it), and
  single-stream decode ms per token;
- with ``--draft``: speculative decoding's acceptance on held-out code (each held-out
  file's first 128 tokens continued greedily for 64, one request at a time).

The results JSON carries the machine and commit (kvserve.bench.reports.report.machine_info).
"""
from __future__ import annotations

import argparse
import ast
import json
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from tools.default_model.instructions import EVAL_REQUEST_FORM, Pair, corpus_pairs
from tools.default_model.speed import speed
from tools.default_model.training_data import BOS, EOS, collect_corpus

REPEAT_NGRAM = 8
CONTINUATION_TOKENS = 64
CHAT_MAX_TOKENS = 320
DOCTEST_SECONDS = 10.0


def heldout_split(model_dir: Path) -> tuple[dict[str, str], list[str]]:
    from kvserve.default_model import training_corpus_dir

    info = json.loads((model_dir / "training_info.json").read_text())
    docs = collect_corpus(training_corpus_dir())
    held = [p for p in info["corpus"]["heldout_files"] if p in docs]
    return docs, held


def function_headers(text: str) -> list[str]:
    """Each function's ``def`` line(s) up to the colon, dedented, with a newline."""
    return [header for header, _ in headers_and_code(text)]


def headers_and_code(text: str) -> list[tuple[str, str]]:
    """Each function's header (as :func:`function_headers`) and the file's text after it,
    dedented by the header's indentation: what the file itself continues it with."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first_body = node.body[0].lineno
            if first_body <= node.lineno:  # a one-line def
                continue
            header = textwrap.dedent("".join(lines[node.lineno - 1:first_body - 1])).rstrip()
            if header.endswith(":"):
                margin = " " * node.col_offset
                after = "".join(line.removeprefix(margin) for line in lines[first_body - 1:])
                found.append((header + "\n", after))
    return found


def repeats_ngram(ids: list[int], n: int = REPEAT_NGRAM) -> bool:
    seen = set()
    for i in range(len(ids) - n + 1):
        gram = tuple(ids[i:i + n])
        if gram in seen:
            return True
        seen.add(gram)
    return False


def defines_function(code: str) -> bool:
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in tree.body)


_DOCTEST_RUNNER = r"""
import doctest, importlib, json, sys
job = json.loads(sys.stdin.read())
namespace = {}
try:
    namespace.update(vars(importlib.import_module(job["module"])))
except Exception:
    pass
namespace.pop(job["name"], None)  # the module's own function must not answer for it
exec(compile(job["code"], "<answer>", "exec"), namespace)
test = doctest.DocTestParser().get_doctest(job["doc"], namespace, job["name"], "<doc>", 0)
runner = doctest.DocTestRunner(verbose=False, optionflags=doctest.ELLIPSIS)
result = runner.run(test, out=lambda s: None)
sys.exit(0 if result.failed == 0 and result.attempted > 0 else 1)
"""


def passes_doctest(pair: Pair, code: str) -> bool:
    module = pair.path[:-3].replace("/", ".").removesuffix(".__init__")
    job = json.dumps({"module": module, "code": code, "doc": pair.doctest, "name": pair.name})
    try:
        done = subprocess.run([sys.executable, "-c", _DOCTEST_RUNNER], input=job, text=True,
                              capture_output=True, timeout=DOCTEST_SECONDS)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def bits_per_byte(model_dir: Path, texts: list[str]) -> dict[str, float]:
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from tools.default_model.training_eval import gzip_bits_per_byte, heldout_bits_per_byte

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = {"bos": tok.token_to_id(BOS), "eos": tok.token_to_id(EOS)}
    ctx = json.loads((model_dir / "training_info.json").read_text())["training"]["seq_len"]
    res = heldout_bits_per_byte(model, tok, texts, ids, ctx=ctx)
    raw = b"".join(t.encode("utf-8") for t in texts)
    return {"bits_per_byte": res["bits_per_byte"], "gzip9_bits_per_byte": gzip_bits_per_byte(raw),
            "bytes": res["bytes"], "tokens": res["tokens"], "context": ctx}


def repetition(llm: Any, headers: list[str]) -> dict[str, Any]:
    params = greedy_defaults(llm)
    params.max_tokens, params.ignore_eos = CONTINUATION_TOKENS, True
    outs = llm.generate(headers, params, use_tqdm=True)
    flags = [repeats_ngram(list(o.outputs[0].token_ids)) for o in outs]
    return {"headers": len(headers), "continuation_tokens": CONTINUATION_TOKENS,
            "ngram": REPEAT_NGRAM, "repeating": sum(flags), "repeating_share": sum(flags) / len(flags),
            "sampling": _sampling_fields(params),
            "examples": [{"header": h, "continuation": o.outputs[0].text}
                         for h, o in list(zip(headers, outs))[:3]]}


def code_repetition(tokenizer: Any, continuations: list[str]) -> dict[str, Any]:
    """The held-out files' own text after the same headers, as many tokens: how often real
    code repeats an 8-token run there (what the model's share is to be read against)."""
    flags = [repeats_ngram(tokenizer.encode(text[:8 * CONTINUATION_TOKENS],
                                            add_special_tokens=False).ids[:CONTINUATION_TOKENS])
             for text in continuations]
    return {"headers": len(continuations), "continuation_tokens": CONTINUATION_TOKENS,
            "ngram": REPEAT_NGRAM, "repeating": sum(flags),
            "repeating_share": sum(flags) / len(flags)}


def greedy_defaults(llm: Any) -> Any:
    """The model's generation_config.json defaults (repetition_penalty, ...), greedy."""
    params = llm.get_default_sampling_params()
    params.temperature = 0.0
    return params


def _sampling_fields(params: Any) -> dict[str, Any]:
    return {name: getattr(params, name) for name in
            ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}


def chat(llm: Any, pairs: list[Pair]) -> dict[str, Any]:
    params = greedy_defaults(llm)
    params.max_tokens = CHAT_MAX_TOKENS
    conversations = [[{"role": "user", "content": p.request(EVAL_REQUEST_FORM)}] for p in pairs]
    outs = llm.chat(conversations, params, use_tqdm=True)
    answers = [o.outputs[0].text for o in outs]
    parsed = [defines_function(a) for a in answers]
    with_doctest = [(p, a) for p, a, ok in zip(pairs, answers, parsed) if p.doctest]
    passed = [passes_doctest(p, a) for p, a in with_doctest]
    finished = sum(o.outputs[0].finish_reason == "stop" for o in outs)
    return {"requests": len(pairs), "request_form": EVAL_REQUEST_FORM, "max_tokens": CHAT_MAX_TOKENS,
            "define_a_function": sum(parsed), "define_a_function_share": sum(parsed) / len(pairs),
            "stopped_before_max_tokens": finished,
            "with_doctest": len(with_doctest), "doctest_passed": sum(passed),
            "sampling": _sampling_fields(params),
            "examples": [{"request": c[0]["content"], "answer": a}
                         for c, a in list(zip(conversations, answers))[:4]]}


def acceptance(model_dir: Path, draft_dir: Path, texts: list[str]) -> dict[str, Any]:
    from kvserve import LLM, SamplingParams

    llm = LLM(str(model_dir), speculative_config={"method": "draft_model", "model": str(draft_dir),
                                                   "num_speculative_tokens": 4})
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode(t, add_special_tokens=False)[:128]} for t in texts]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outputs = [llm.generate([prompt], params, use_tqdm=False)[0]  # one at a time: a
               for prompt in prompts]                                # single stream
    stats = llm.engine.speculator.stats
    llm.engine.close()
    agree = draft_agreement(draft_dir, [(p["prompt_token_ids"], list(o.outputs[0].token_ids))
                                        for p, o in zip(prompts, outputs)])
    return {"prompts": len(prompts), "prompt_tokens": 128, "max_tokens": 64,
            "num_speculative_tokens": 4, "draft_tokens": stats.num_draft_tokens,
            "accepted_tokens": stats.num_accepted_tokens,
            "acceptance_rate": stats.num_accepted_tokens / max(stats.num_draft_tokens, 1),
            "mean_acceptance_length": 1 + stats.num_accepted_tokens / max(stats.num_drafts, 1),
            "greedy_agreement": agree}


def draft_agreement(draft_dir: Path, runs: list[tuple[list[int], list[int]]]) -> dict[str, Any]:
    """How often the draft's greedy pick is the target's greedy token, each position given
    the target's own text before it: a greedy draft's acceptance rate whenever it drafts
    (the engine drafts only where it pays, so its own count can be small)."""
    import torch
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    same = total = 0
    with torch.inference_mode():
        for prompt, continued in runs:
            ids = torch.tensor([prompt + continued])
            picks = draft(input_ids=ids).logits[0, len(prompt) - 1:-1].argmax(-1)
            same += int((picks == torch.tensor(continued)).sum())
            total += len(continued)
    return {"tokens": total, "agreeing": same, "share": same / max(total, 1)}


def evaluate(model_dir: Path, headers: list[str], pairs: list[Pair], texts: list[str],
             log) -> dict[str, Any]:
    from kvserve import LLM

    log(f"{model_dir}: bits per byte")
    result: dict[str, Any] = {"bits_per_byte": bits_per_byte(model_dir, texts)}
    llm = LLM(str(model_dir))
    log(f"{model_dir}: repetition over {len(headers)} headers")
    result["repetition"] = repetition(llm, headers)
    # the headers as a user types them, ending at the colon: the byte-level BPE keeps a
    # newline and the next line's indent in one token, which a prompt ending in "\n" splits
    result["repetition_at_the_colon"] = repetition(llm, [h.rstrip("\n") for h in headers])
    log(f"{model_dir}: chat over {len(pairs)} requests")
    result["chat"] = chat(llm, pairs)
    llm.engine.close()
    result["speed"] = speed(model_dir)
    return result


def tune_repetition_penalty(model_dir: Path, docs: dict[str, str], train_files: list[str],
                            penalties: list[float], count: int, seed: int, log) -> dict:
    """Repetition and chat answers at each penalty on the *train* files' headers and pairs
    (the held-out ones stay unseen), to choose generation_config.json's default."""
    from kvserve import LLM

    rng = random.Random(seed)
    files = rng.sample(train_files, min(200, len(train_files)))
    headers = [h for p in files for h in function_headers(docs[p])]
    headers = rng.sample(headers, min(count, len(headers)))
    pairs = rng.sample(corpus_pairs(docs, files), count)
    table = {}
    llm = LLM(str(model_dir), generation_config="vllm")
    for penalty in penalties:
        llm.engine.config.model.sampling_defaults.update(
            {"temperature": 0.0, "repetition_penalty": penalty})
        rep = repetition(llm, headers)["repeating_share"]
        answers = chat(llm, pairs)
        table[penalty] = {"repeating_share": rep,
                          "define_a_function_share": answers["define_a_function_share"]}
        log(f"repetition_penalty {penalty}: {table[penalty]}")
    llm.engine.close()
    return table


def main(argv: list[str] | None = None) -> int:
    from kvserve.bench.reports.report import machine_info
    from kvserve.default_model import default_draft_model_dir, default_model_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=default_model_dir())
    ap.add_argument("--draft", default=default_draft_model_dir())
    ap.add_argument("--baseline", default=None, help="another model directory measured alike")
    ap.add_argument("--headers", type=int, default=100, help="held-out headers to continue")
    ap.add_argument("--chat-requests", type=int, default=200, help="held-out requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bpb-bytes", type=int, default=300_000,
                    help="held-out bytes scored for bits per byte (files in split order)")
    ap.add_argument("--out", default=None, help="results JSON (default: print)")
    ap.add_argument("--tune", default=None, metavar="P1,P2,...",
                    help="only measure these repetition penalties on train-file headers")
    ap.add_argument("--tune-count", type=int, default=200,
                    help="train-file headers and requests --tune measures at each penalty")
    args = ap.parse_args(argv)
    log = lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    model_dir = Path(args.model)
    docs, held = heldout_split(model_dir)
    if args.tune:
        train = sorted(set(docs) - set(held))
        table = tune_repetition_penalty(model_dir, docs, train,
                                        [float(p) for p in args.tune.split(",")], args.tune_count,
                                        args.seed, log)
        print(json.dumps(table, indent=1))
        return 0
    rng = random.Random(args.seed)
    found = [hc for p in held for hc in headers_and_code(docs[p])]
    found = sorted(rng.sample(found, min(args.headers, len(found))))
    headers = [header for header, _ in found]
    pairs = corpus_pairs(docs, held)
    pairs = rng.sample(pairs, min(args.chat_requests, len(pairs)))
    texts, size = [], 0
    for p in held:  # the first files up to --bpb-bytes (the training script reports all)
        if size >= args.bpb_bytes:
            break
        texts.append(docs[p])
        size += len(docs[p].encode("utf-8"))
    doc: dict[str, Any] = {"machine": machine_info(), "model": str(model_dir.name),
                           "heldout_files": len(held), "result": {}}
    doc["result"]["model"] = evaluate(model_dir, headers, pairs, texts, log)
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    doc["result"]["heldout_code"] = {"repetition": code_repetition(tokenizer,
                                                                   [code for _, code in found])}
    if args.draft:
        log("speculative acceptance")
        doc["result"]["speculative"] = acceptance(model_dir, Path(args.draft),
                                                  [docs[p] for p in held][:32])
    if args.baseline:
        doc["result"]["baseline"] = evaluate(Path(args.baseline), headers, pairs, texts, log)
    text = json.dumps(doc, indent=1) + "\n"
    if args.out:
        Path(args.out).write_text(text)
        log(f"wrote {args.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
