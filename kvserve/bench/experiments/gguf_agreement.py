"""``kvserve bench gguf-agreement``: kvserve and llama.cpp teacher-forced on the same
quantized GGUF files.

The model (the embedded one by default) is converted to an f16 GGUF by llama.cpp's own
converter (``--llamacpp-source``, as ``bench compare`` does) and quantized by
``llama-quantize`` to each of ``--quants``. For each file, llama.cpp's
``llama-perplexity`` scores held-out text (the model's held-out files, joined) in chunks
of ``--ctx`` tokens, each with BOS first and its second half scored, and saves every
scored position's log-probabilities (``--kl-divergence-base``). kvserve scores the very
tokens that file lists, chunk by chunk, with prompt logprobs. Reported per file:

- top-1 agreement: the share of scored positions where both put the same token first
  (llama.cpp's from its saved log-probabilities, stored to 16 bits over the top 16 nats);
- bits per byte of each over the same scored tokens (their decoded UTF-8 bytes), each
  from its own log-probabilities of the actual tokens (llama.cpp's as saved, to 16 bits),
  and their ratio;
- each one's top-1 agreement with exact arithmetic: transformers loading the same file
  (``gguf_file=``, which dequantizes every tensor) and computing in float64, so that a
  disagreement between the two is laid at the door of the one that strays from the file's
  own numbers (both round activations to 8 bits against quantized blocks, kvserve unless
  run with ``gguf_activations=float``; llama.cpp's flash attention keeps f16 values);
- llama.cpp's agreement with itself: the same file scored again with flash attention off
  (``-fa off``, its other attention path), and kvserve's agreement with that run. Rounding
  activations to 8 bits turns the last bit of any float difference into a different
  rounding somewhere downstream, so two correct implementations agree no better than
  llama.cpp's own two paths do: that is the scale a top-1 agreement is read on.
"""
from __future__ import annotations

import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"_logits_"


def read_logits_file(path: Path) -> dict[str, Any]:
    """llama-perplexity's ``--kl-divergence-base`` file: n_ctx, n_vocab, the chunks'
    tokens [n_chunk, n_ctx], and each scored position's top token [n_chunk, rows]."""
    data = path.read_bytes()
    if data[:8] != MAGIC:
        raise ValueError(f"{path} is not a llama-perplexity log-probability file")
    n_ctx, n_vocab, n_chunk = struct.unpack_from("<iii", data, 8)
    at = 20
    tokens = np.frombuffer(data, dtype=np.int32, count=n_chunk * n_ctx, offset=at)
    at += 4 * n_chunk * n_ctx
    row = 2 * ((n_vocab + 1) // 2) + 4  # uint16s a row: scale and minimum (2 floats), values
    rows = n_ctx - 1 - n_ctx // 2
    table = np.frombuffer(data, dtype=np.uint16, count=n_chunk * rows * row, offset=at)
    table = table.reshape(n_chunk, rows, row)
    tokens = tokens.reshape(n_chunk, n_ctx)
    scale_min = np.ascontiguousarray(table[:, :, :4]).view(np.float32)  # [n_chunk, rows, 2]
    targets = tokens[:, n_ctx - rows:]  # row r predicts the token after position first + r
    codes = np.take_along_axis(table[:, :, 4:4 + n_vocab], targets[:, :, None], -1)[:, :, 0]
    logprobs = codes * scale_min[:, :, 0] + scale_min[:, :, 1]
    return {"n_ctx": n_ctx, "n_vocab": n_vocab, "tokens": tokens,
            "top": table[:, :, 4:4 + n_vocab].argmax(-1), "nll": -float(logprobs.sum())}


def llama_perplexity(binary: str, gguf: Path, text: Path, ctx: int, chunks: int,
                     threads: int, logits: Path, extra: tuple[str, ...] = ()
                     ) -> dict[str, Any]:
    from kvserve.bench.peers.llamacpp import tool_version

    cmd = [binary, "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-b", str(ctx),
           "-t", str(threads), "--chunks", str(chunks), "--kl-divergence-base", str(logits),
           *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0 or not logits.is_file():
        raise RuntimeError(f"llama-perplexity failed (exit {proc.returncode}): {log[-2000:]}")
    return {"build": tool_version(binary)}


def kvserve_scores(gguf: Path, chunks: np.ndarray, engine_args: dict[str, Any]
                   ) -> dict[str, Any]:
    """kvserve's top token and the actual token's logprob at each position llama-perplexity
    scores, the chunk's first token being BOS (as llama.cpp evaluates it)."""
    from kvserve import LLM, SamplingParams

    llm = LLM(str(gguf), **engine_args)
    tok = llm.get_tokenizer()
    n_ctx = chunks.shape[1]
    first = n_ctx // 2
    prompts = [{"prompt_token_ids": [tok.bos_token_id] + c[1:].tolist()} for c in chunks]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1),
                        use_tqdm=True)
    top, logprobs, text = [], [], []
    for chunk, out in zip(chunks, outs):
        scored = out.prompt_logprobs[first + 1:]
        top.append([next(t for t, lp in entry.items() if lp.rank == 1) for entry in scored])
        logprobs += [entry[int(t)].logprob for entry, t in zip(scored, chunk[first + 1:])]
        text.append(tok.decode(chunk[first + 1:].tolist()))
    llm.engine.close()
    return {"top": np.array(top), "bos": tok.bos_token_id, "nll": -float(np.sum(logprobs)),
            "tokens": len(logprobs), "bytes": sum(len(t.encode("utf-8")) for t in text)}


def exact_tops(gguf: Path, chunks: np.ndarray, bos: int) -> np.ndarray:
    """The top token at each position llama-perplexity scores, from transformers with the
    file's weights dequantized and every product in float64."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32).double().eval()
    first = chunks.shape[1] // 2
    tops = []
    with torch.inference_mode():
        for chunk in chunks:
            ids = torch.tensor([[bos] + chunk[1:].tolist()])
            tops.append(model(ids).logits[0, first:-1].argmax(-1).numpy())
    return np.array(tops)


def _agreement(tops: np.ndarray, others: np.ndarray) -> float:
    return float((tops == others).mean())


def run_gguf_agreement(model_dir: Path, source: Path, quantize: str, perplexity: str,
                       quants: list[str], text: str, ctx: int, chunks: int, threads: int,
                       engine_args: dict[str, Any], log=print) -> dict[str, Any]:
    from kvserve.bench.peers.llamacpp import convert_to_gguf

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvserve-agreement-") as tmp:
        work = Path(tmp)
        (work / "heldout.txt").write_text(text)
        log("converting the model to an f16 GGUF ...")
        f16 = convert_to_gguf(sys.executable, source, model_dir, work / "model-f16.gguf", "f16")
        for quant in quants:
            gguf = work / f"model-{quant}.gguf"
            subprocess.run([quantize, str(f16), str(gguf), quant], check=True,
                           capture_output=True)
            log(f"{quant}: llama-perplexity ...")
            theirs = llama_perplexity(perplexity, gguf, work / "heldout.txt", ctx, chunks,
                                      threads, work / "logits.bin")
            base = read_logits_file(work / "logits.bin")
            log(f"{quant}: llama-perplexity -fa off ...")
            llama_perplexity(perplexity, gguf, work / "heldout.txt", ctx, chunks, threads,
                             work / "logits-fa-off.bin", ("-fa", "off"))
            fa_off = read_logits_file(work / "logits-fa-off.bin")
            log(f"{quant}: kvserve ...")
            ours = kvserve_scores(gguf, base["tokens"], engine_args)
            log(f"{quant}: transformers, float64 ...")
            exact = exact_tops(gguf, base["tokens"], ours["bos"])
            ln2 = np.log(2.0)
            ours_bpb = ours["nll"] / ln2 / ours["bytes"]
            theirs_bpb = base["nll"] / ln2 / ours["bytes"]
            results[quant] = {
                "file_bytes": gguf.stat().st_size, "chunks": int(base["tokens"].shape[0]),
                "scored_tokens": ours["tokens"], "scored_bytes": ours["bytes"],
                "top1_agreement": _agreement(ours["top"], base["top"]),
                "kvserve_top1_agreement_with_exact": _agreement(ours["top"], exact),
                "llamacpp_top1_agreement_with_exact": _agreement(base["top"], exact),
                "llamacpp_top1_agreement_with_fa_off": _agreement(base["top"], fa_off["top"]),
                "kvserve_top1_agreement_with_llamacpp_fa_off": _agreement(ours["top"],
                                                                          fa_off["top"]),
                "kvserve_bits_per_byte": ours_bpb, "llamacpp_bits_per_byte": theirs_bpb,
                "kvserve_over_llamacpp_bits_per_byte": ours_bpb / theirs_bpb,
                "llamacpp_perplexity": float(np.exp(base["nll"] / ours["tokens"])),
                "kvserve_perplexity": float(np.exp(ours["nll"] / ours["tokens"])),
                "llamacpp_build": theirs["build"]}
            r = results[quant]
            log(f"{quant}: top-1 agreement {100 * r['top1_agreement']:.2f} %, bits per byte "
                f"kvserve {ours_bpb:.4f} / llama.cpp {theirs_bpb:.4f} "
                f"({100 * (r['kvserve_over_llamacpp_bits_per_byte'] - 1):+.2f} %); with "
                f"exact float64 top-1: kvserve "
                f"{100 * r['kvserve_top1_agreement_with_exact']:.2f} %, llama.cpp "
                f"{100 * r['llamacpp_top1_agreement_with_exact']:.2f} %; llama.cpp with "
                f"itself -fa off {100 * r['llamacpp_top1_agreement_with_fa_off']:.2f} %, "
                f"kvserve with that "
                f"{100 * r['kvserve_top1_agreement_with_llamacpp_fa_off']:.2f} %")
    return {"ctx": ctx, "threads": threads, "engine_args": engine_args, "quants": results}


def cmd_gguf_agreement(args) -> int:
    """``kvserve bench gguf-agreement``."""
    from kvserve.bench.bench_args import engine_args_from, resolve_model_dir
    from kvserve.bench.bench_setup import _header
    from kvserve.bench.experiments.spec import heldout_texts
    from kvserve.bench.reports import report

    model_dir = resolve_model_dir(args.model)
    engine_args = engine_args_from(args)
    text = "\n\n".join(heldout_texts(model_dir, 1000))[:args.max_bytes]
    info = _header("kvserve gguf-agreement", {"model": model_dir.name, "quants": args.quants,
                                              "ctx": args.ctx, "chunks": args.chunks,
                                              "engine_args": engine_args})
    res = run_gguf_agreement(model_dir, Path(args.llamacpp_source), args.llama_quantize,
                             args.llama_perplexity, args.quants.split(","), text, args.ctx,
                             args.chunks, args.threads, engine_args)
    if args.json:
        name = "the embedded model" if args.model is None else model_dir.name
        out = {"machine": info, "model": name, "engine_args": engine_args, "result": res}
        print(f"wrote {report.write_json(args.json, out)}")
    return 0


def add_gguf_agreement_parser(sub) -> None:
    from kvserve.bench.bench_args import add_engine_args, add_output_args

    p = sub.add_parser("gguf-agreement", help="kvserve and llama.cpp teacher-forced on the "
                                              "same quantized GGUF files",
                       description="Convert the model with llama.cpp's converter, quantize it "
                                   "with llama-quantize, score held-out text with "
                                   "llama-perplexity and with kvserve on each file; report "
                                   "top-1 agreement and both bits per byte.")
    p.add_argument("--model", default=None, help="model dir (default: the embedded model)")
    p.add_argument("--llamacpp-source", required=True, help="llama.cpp source tree")
    p.add_argument("--llama-quantize", required=True, help="llama-quantize binary")
    p.add_argument("--llama-perplexity", required=True, help="llama-perplexity binary")
    p.add_argument("--quants", default="Q8_0,Q4_K_M", help="llama-quantize types")
    p.add_argument("--ctx", type=int, default=512, help="tokens a chunk (default 512)")
    p.add_argument("--chunks", type=int, default=64, help="chunks at most (default 64)")
    p.add_argument("--max-bytes", type=int, default=1_000_000, help="held-out text bytes")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default 2)")
    add_engine_args(p)
    add_output_args(p, plot=False)
    p.set_defaults(func=cmd_gguf_agreement)
