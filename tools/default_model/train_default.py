"""Train kvserve's embedded default model on the Python standard library's sources.

    python -m tools.default_model.train_default --out kvserve/default_model/checkpoint \
        --work-dir runs/default-model --minutes 55 [--resume]

What it does:

1. Corpus: every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` of the running
   interpreter (recursively; ``site-packages``/``dist-packages`` skipped; test
   directories kept; files that are not UTF-8, empty, or over 512 KB skipped). The
   sorted list of relative paths is hashed (sha256 of the newline-joined list) and
   split by file, with a fixed seed, into train and held-out (4 %).
2. Tokenizer: byte-level BPE (``tokenizers``), vocab 8192, trained on the train files,
   with special tokens ``<|bos|> <|eos|> <|pad|> <|system|> <|user|> <|assistant|>``.
   A post-processor prepends ``<|bos|>`` to a plain prompt (like Llama 3).
3. Model: ``LlamaForCausalLM`` (GQA, tied embeddings), fp32, AdamW, linear warmup then
   cosine decay over the *time* budget (``--minutes``), documents packed as
   ``bos + text + eos`` into fixed-length sequences, one epoch = one pass over a fresh
   permutation of the packed sequences.
4. Checkpoints (model + optimizer + data position + RNG states) every few minutes to
   ``--work-dir/ckpt.pt``; ``--resume`` continues from there. ``--minutes`` is the total
   training time including what earlier runs already spent.
5. At the end: held-out bits per byte over the held-out files vs ``gzip -9`` on the same
   bytes, ``training_info.json``, ``loss_curve.png``, and the model in HF layout
   (``save_pretrained(safe_serialization=True)``) with tokenizer files in ``--out``.

6. A draft model for speculative decoding (``kvserve.default_draft_model_dir()``) is
   a smaller sibling trained by the same script: ``--size tiny --tokenizer DIR``
   reuses the default model's tokenizer, and ``--teacher DIR`` trains on the default
   model's next-token distribution (KL divergence from it, DistillSpec's recipe) instead
   of the corpus's next token, so that its greedy guesses agree with the target's.

``--probe`` measures training throughput of the size presets for a short while each.
The model, optimizer, losses and schedule are in :mod:`tools.default_model.training_model`,
the corpus and tokenizer in :mod:`tools.default_model.training_data`, the evaluation and
loss curve in :mod:`tools.default_model.training_eval`, the files written at the end in
:mod:`tools.default_model.training_report`. transformers and matplotlib are
dev/bench dependencies: imported only where they are used.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from tools.default_model.training_data import fmt_int, prepare_data
from tools.default_model.training_eval import (gzip_bits_per_byte, heldout_bits_per_byte,
                                             plot_loss_curve)
from tools.default_model.training_model import DEFAULT_PRESET, PRESETS, atomic_torch_save, \
    build_model, distill_loss_fn, loss_fn, lr_at, make_optimizer
from tools.default_model.training_report import model_card, training_info, write_model_files

# ----------------------------------------------------------------------------- main

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="kvserve/default_model/checkpoint", help="where the HF-layout model is written")
    ap.add_argument("--work-dir", default="runs/default-model", help="checkpoints, tokenized corpus, logs")
    ap.add_argument("--minutes", type=float, default=55.0, help="total training wall time (incl. resumed runs)")
    ap.add_argument("--resume", action="store_true", help="continue from --work-dir/ckpt.pt")
    ap.add_argument("--size", default=DEFAULT_PRESET, choices=sorted(PRESETS))
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--max-position-embeddings", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                    help="torch.compile the model for training (faster than eager)")
    ap.add_argument("--ckpt-minutes", type=float, default=4.0, help="checkpoint interval")
    ap.add_argument("--eval-minutes", type=float, default=3.0, help="held-out loss interval (loss curve)")
    ap.add_argument("--eval-windows", type=int, default=32, help="held-out windows for the periodic loss")
    ap.add_argument("--heldout-max-bytes", type=int, default=2_000_000, help="cap on the final bpb eval text")
    ap.add_argument("--tokenizer", default=None,
                    help="model directory whose tokenizer.json to use instead of training one")
    ap.add_argument("--teacher", default=None,
                    help="model directory to distil from (a draft model for it)")
    ap.add_argument("--repetition-penalty", type=float, default=None,
                    help="generation_config.json's default (chosen with "
                         "tools.default_model.evaluate_default --tune on train-file headers)")
    ap.add_argument("--probe", default=None, help="comma-separated presets: measure throughput and exit")
    ap.add_argument("--probe-seconds", type=float, default=45.0)
    return ap.parse_args(argv)


def probe(args, data, log):
    import torch

    stream = torch.from_numpy(data["stream"][: 200_000].astype("int64"))
    for name in args.probe.split(","):
        torch.manual_seed(0)
        model = build_model(PRESETS[name], data["tok"].get_vocab_size(), data["ids"], args.max_position_embeddings)
        n_params = sum(p.numel() for p in model.parameters())
        opt = make_optimizer(model, args.lr, args.weight_decay)
        step_model = torch.compile(model) if args.compile else model
        T, B = args.seq_len, args.batch_size
        n_seq = (len(stream) - 1) // T
        t_start = time.time()
        tokens, step, t_first = 0, 0, None
        while time.time() - t_start < args.probe_seconds:
            i = step % (n_seq - B)
            chunk = stream[i * T : (i + B) * T + 1]
            x = torch.stack([chunk[j * T : (j + 1) * T] for j in range(B)])
            y = torch.stack([chunk[j * T + 1 : (j + 1) * T + 1] for j in range(B)])
            loss = loss_fn(step_model, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step == 2:
                t_first, tokens = time.time(), 0
            elif step > 2:
                tokens += B * T
        dt = time.time() - (t_first or t_start)
        log(f"probe {name}: {fmt_int(n_params)} params, {step} steps, {tokens / max(dt, 1e-9):.0f} tok/s "
            f"(after 2 warm-up steps; first 2 took {(t_first or time.time()) - t_start:.1f}s), loss {loss.detach().item():.3f}")


def final_evaluation(args, data, model, T: int, log):
    """Held-out bits per byte (files up to --heldout-max-bytes) against gzip -9 on the same
    bytes, and the train loss measured the same way on a same-size slice of train files."""
    tok, ids = data["tok"], data["ids"]
    t0 = time.time()
    eval_files, nbytes = [], 0
    for p in data["held_files"]:
        if nbytes >= args.heldout_max_bytes:
            break
        eval_files.append(p)
        nbytes += len(data["docs"][p].encode("utf-8"))
    eval_texts = [data["docs"][p] for p in eval_files]
    res = heldout_bits_per_byte(model, tok, eval_texts, ids, ctx=T)
    raw = b"".join(t.encode("utf-8") for t in eval_texts)
    gz = gzip_bits_per_byte(raw)
    log(f"held-out: {len(eval_files)} files, {fmt_int(res['bytes'])}B, {fmt_int(res['tokens'])} tokens: "
        f"loss {res['loss']:.4f}, {res['bits_per_byte']:.4f} bits/byte vs gzip -9 {gz:.4f} "
        f"({time.time() - t0:.0f}s)")
    # train loss measured the same way on a same-size slice of train files (no dropout: comparable)
    train_eval_files, nb = [], 0
    for p in data["train_files"][:: max(1, len(data["train_files"]) // 200)]:
        if nb >= min(nbytes, 300_000):
            break
        train_eval_files.append(p)
        nb += len(data["docs"][p].encode("utf-8"))
    tres = heldout_bits_per_byte(model, tok, [data["docs"][p] for p in train_eval_files], ids, ctx=T)
    return res, tres, gz, eval_files


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import numpy as np
    import torch
    from tqdm import tqdm

    torch.set_num_threads(args.threads)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    log_file = open(work / "train_log.txt", "a")

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        tqdm.write(line)
        log_file.write(line + "\n")
        log_file.flush()

    log(f"args: {vars(args)}")
    data = prepare_data(args, work, log)
    if args.probe:
        probe(args, data, log)
        return 0

    tok, ids = data["tok"], data["ids"]
    T, B = args.seq_len, args.batch_size
    stream = torch.from_numpy(data["stream"].astype(np.int64))
    n_seq = (len(stream) - 1) // T
    held_texts = [data["docs"][p] for p in data["held_files"]]
    # periodic held-out loss: a fixed set of packed held-out windows
    held_stream = []
    for t in held_texts:
        held_stream += [ids["bos"]] + tok.encode(t, add_special_tokens=False).ids + [ids["eos"]]
    held_stream = torch.tensor(held_stream, dtype=torch.long)
    n_eval = min(args.eval_windows, (len(held_stream) - 1) // T)
    eval_x = torch.stack([held_stream[i * T : (i + 1) * T] for i in range(n_eval)])
    eval_y = torch.stack([held_stream[i * T + 1 : (i + 1) * T + 1] for i in range(n_eval)])

    def eval_loss(m) -> float:
        m.eval()
        with torch.inference_mode():
            tot = 0.0
            for i in range(0, n_eval, 8):
                tot += float(loss_fn(m, eval_x[i : i + 8], eval_y[i : i + 8])) * len(eval_x[i : i + 8])
        m.train()
        return tot / n_eval

    ckpt_path = work / "ckpt.pt"
    if args.resume and ckpt_path.exists():
        ck = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        preset = ck["preset"]
        model = build_model(preset, tok.get_vocab_size(), ids, ck["max_position_embeddings"])
        model.load_state_dict(ck["model"])
        opt = make_optimizer(model, args.lr, args.weight_decay)
        opt.load_state_dict(ck["optimizer"])
        st = ck["state"]
        torch.set_rng_state(ck["torch_rng"])
        log(f"resumed from step {st['step']} ({fmt_int(st['tokens'])} tokens, {st['train_time'] / 60:.1f} min)")
        if ck["seq_len"] != T or ck["batch_size"] != B:
            log("warning: seq-len/batch-size differ from the checkpoint; using the checkpoint's")
            T, B = ck["seq_len"], ck["batch_size"]
            n_seq = (len(stream) - 1) // T
    else:
        if args.resume:
            log("no checkpoint found: starting fresh")
        torch.manual_seed(args.seed)
        preset = dict(PRESETS[args.size])
        model = build_model(preset, tok.get_vocab_size(), ids, args.max_position_embeddings)
        opt = make_optimizer(model, args.lr, args.weight_decay)
        st = {"step": 0, "tokens": 0, "train_time": 0.0, "epoch": 0, "pos": 0, "history": [],
              "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "wall_time_total": 0.0}

    n_params = sum(p.numel() for p in model.parameters())
    n_nonemb = n_params - model.get_input_embeddings().weight.numel()
    log(f"model: {preset}, {n_params:,} params ({n_nonemb:,} non-embedding), seq {T} x batch {B}, "
        f"{n_seq} sequences/epoch")
    step_model = torch.compile(model) if args.compile else model
    train_loss = loss_fn
    if args.teacher:
        from transformers import AutoModelForCausalLM

        teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.float32).eval()
        if teacher.config.vocab_size != tok.get_vocab_size():
            raise SystemExit(f"--teacher {args.teacher} has vocab {teacher.config.vocab_size}, "
                             f"the tokenizer {tok.get_vocab_size()}: pass --tokenizer {args.teacher}")
        train_loss = distill_loss_fn(torch.compile(teacher) if args.compile else teacher)
        log(f"distilling from {args.teacher}")
    budget = args.minutes * 60.0

    def perm_for(epoch: int):
        g = torch.Generator().manual_seed(args.seed * 1000 + epoch)
        return torch.randperm(n_seq, generator=g)

    perm = perm_for(st["epoch"])

    def save_ckpt():
        atomic_torch_save({"model": model.state_dict(), "optimizer": opt.state_dict(), "state": st,
                           "torch_rng": torch.get_rng_state(), "preset": preset, "seq_len": T, "batch_size": B,
                           "max_position_embeddings": model.config.max_position_embeddings}, ckpt_path)

    model.train()
    run_start = time.time()
    wall_at_start = st["wall_time_total"]
    last_ckpt = last_eval = time.time()
    ema = st.get("ema")
    bar = tqdm(total=int(budget), initial=int(min(st["train_time"], budget)), unit="s",
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}s [{elapsed}<{remaining}{postfix}]",
               mininterval=2.0, file=sys.stderr)
    if not st["history"] or st["history"][-1].get("heldout_loss") is None:
        st["history"].append({"step": st["step"], "tokens": st["tokens"], "train_loss": None,
                              "heldout_loss": eval_loss(model)})
    tok_window_t, tok_window_n = 0.0, 0
    rate = 0.0
    while st["train_time"] < budget:
        t0 = time.time()
        if st["pos"] + B > n_seq:
            st["epoch"] += 1
            st["pos"] = 0
            perm = perm_for(st["epoch"])
            log(f"epoch {st['epoch']} begins")
        idx = perm[st["pos"] : st["pos"] + B]
        starts = idx * T
        offs = torch.arange(T + 1)
        batch = stream[starts[:, None] + offs[None, :]]
        x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        lr = lr_at(st["train_time"] / budget, st["step"], args.lr, args.warmup_steps)
        for g in opt.param_groups:
            g["lr"] = lr
        loss = train_loss(step_model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        lv = loss.detach().item()
        if not math.isfinite(lv):
            log("non-finite loss: stopping (resume from the last checkpoint with a lower --lr)")
            return 1
        ema = lv if ema is None else 0.98 * ema + 0.02 * lv
        st["ema"] = ema
        st["step"] += 1
        st["pos"] += B
        st["tokens"] += B * T
        dt = time.time() - t0
        st["train_time"] += dt
        tok_window_n += B * T
        tok_window_t += dt
        now = time.time()
        if tok_window_t > 10:
            rate = tok_window_n / tok_window_t
            tok_window_t, tok_window_n = 0.0, 0
        bar.n = int(min(st["train_time"], budget))
        bar.set_postfix_str(f"step {st['step']} loss {ema:.3f} lr {lr:.2e} {rate:.0f} tok/s "
                            f"{fmt_int(st['tokens'])} tok", refresh=False)
        bar.update(0)
        if st["step"] % 20 == 0:
            st["history"].append({"step": st["step"], "tokens": st["tokens"], "train_loss": ema})
        if now - last_eval > args.eval_minutes * 60:
            hl = eval_loss(model)
            st["history"].append({"step": st["step"], "tokens": st["tokens"], "train_loss": ema, "heldout_loss": hl})
            log(f"step {st['step']} tokens {fmt_int(st['tokens'])} train {ema:.4f} held-out {hl:.4f} "
                f"lr {lr:.2e} {rate:.0f} tok/s")
            last_eval = time.time()
        if now - last_ckpt > args.ckpt_minutes * 60:
            st["wall_time_total"] = wall_at_start + (time.time() - run_start)
            save_ckpt()
            last_ckpt = time.time()
    bar.close()
    hl = eval_loss(model)
    st["history"].append({"step": st["step"], "tokens": st["tokens"], "train_loss": ema, "heldout_loss": hl})
    st["wall_time_total"] = wall_at_start + (time.time() - run_start)
    save_ckpt()
    log(f"training done: step {st['step']}, {fmt_int(st['tokens'])} tokens, train loss {ema:.4f}, "
        f"held-out loss {hl:.4f}, {st['train_time'] / 60:.1f} min of training")

    # ---- final evaluation on the held-out files, then the model directory
    res, tres, gz, eval_files = final_evaluation(args, data, model, T, log)
    write_model_files(out, model, tok, ids, args.repetition_penalty)
    if args.tokenizer:  # a sibling: the very tokenizer files (and chat template) of its model
        import shutil
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (Path(args.tokenizer) / name).is_file():
                shutil.copy(Path(args.tokenizer) / name, out / name)

    info = training_info(args, data, model, tok, preset, st, T, B, len(stream), ema,
                         (res, tres, gz, eval_files))
    (out / "training_info.json").write_text(json.dumps(info, indent=1) + "\n")
    (out / "README.md").write_text(model_card(info, model.generation_config.to_dict()))
    plot_loss_curve(st["history"], out / "loss_curve.png", gz_loss=None, title=
                    f"{fmt_int(n_params)}-param Llama on the Python stdlib: held-out "
                    f"{res['bits_per_byte']:.3f} bits/byte (gzip -9: {gz:.3f})")
    size = (out / "model.safetensors").stat().st_size
    log(f"wrote {out}: model.safetensors {size / 1e6:.1f} MB; files: {sorted(c.name for c in out.iterdir())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
