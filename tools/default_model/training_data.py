"""The embedded model's training data: the standard library's ``.py`` sources, a seeded
split by file, a byte-level BPE tokenizer trained on the train split, and the packed
train token stream (cached in the work dir): the train files and the instruction pairs
built from them (:mod:`tools.default_model.instructions`), in a seeded order. See :mod:`tools.default_model.train_default`."""
from __future__ import annotations

import hashlib
import json
import os
import random
import time
from pathlib import Path

from kvserve.default_model import training_corpus_dir
from tools.default_model.instructions import corpus_pairs, training_texts

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"

MAX_FILE_BYTES = 512 * 1024
HELD_OUT_FRACTION = 0.04
CHAT_COPIES = 2  # each instruction pair is packed this many times an epoch, its request phrased anew


def fmt_int(n: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


# ----------------------------------------------------------------------------- corpus

def collect_corpus(root: Path) -> dict[str, str]:
    """relative path -> text for every usable stdlib .py file."""
    docs: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            try:
                if path.stat().st_size > MAX_FILE_BYTES:
                    continue
                text = path.read_bytes().decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if not text.strip():
                continue
            docs[path.relative_to(root).as_posix()] = text
    return docs


def file_list_hash(paths: list[str]) -> str:
    return hashlib.sha256("\n".join(sorted(paths)).encode("utf-8")).hexdigest()


def split_files(paths: list[str], seed: int, fraction: float = HELD_OUT_FRACTION) -> tuple[list[str], list[str]]:
    ordered = sorted(paths)
    shuffled = ordered[:]
    random.Random(seed).shuffle(shuffled)
    n_held = max(1, round(fraction * len(ordered)))
    return sorted(shuffled[n_held:]), sorted(shuffled[:n_held])


# ----------------------------------------------------------------------------- tokenizer

def train_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def prepare_data(args, work: Path, log):
    """Corpus, split, tokenizer and tokenized train stream (cached in the work dir)."""
    import numpy as np
    from tokenizers import Tokenizer

    root = training_corpus_dir()
    docs = collect_corpus(root)
    paths = sorted(docs)
    flh = file_list_hash(paths)
    train_files, held_files = split_files(paths, args.seed)
    log(f"corpus: {len(paths)} files, {fmt_int(sum(len(t.encode()) for t in docs.values()))}B from {root}; "
        f"train {len(train_files)} / held-out {len(held_files)} files; file-list sha256 {flh[:16]}")

    meta_path = work / "data_meta.json"
    tok_path = work / "tokenizer.json"
    stream_path = work / "train_tokens.npy"
    tokenizer_from = getattr(args, "tokenizer", None)
    pairs = corpus_pairs(docs, train_files)
    chat_copies = getattr(args, "chat_copies", CHAT_COPIES)
    meta = {"file_list_sha256": flh, "seed": args.seed, "vocab_size": args.vocab_size,
            "n_files": len(paths), "held_out_fraction": HELD_OUT_FRACTION,
            "tokenizer_from": tokenizer_from, "instruction_pairs": len(pairs),
            "chat_copies": chat_copies}
    cached = (meta_path.exists() and tok_path.exists() and stream_path.exists()
              and json.loads(meta_path.read_text()) == meta)
    if cached:
        tok = Tokenizer.from_file(str(tok_path))
        stream = np.load(stream_path)
        log(f"loaded cached tokenizer and {fmt_int(len(stream))} train tokens")
    else:
        if args.resume:
            log("warning: cached data missing or from another corpus; re-tokenizing")
        t0 = time.time()
        if tokenizer_from:  # a sibling model (a draft) must share its target's tokens
            tok = Tokenizer.from_file(str(Path(tokenizer_from) / "tokenizer.json"))
            log(f"tokenizer of {tokenizer_from}, vocab {tok.get_vocab_size()}")
        else:
            tok = train_tokenizer((docs[p] for p in train_files), args.vocab_size)
            log(f"tokenizer trained in {time.time() - t0:.0f}s, vocab {tok.get_vocab_size()}")
        t0 = time.time()
        bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
        texts = [docs[p] for p in train_files]
        for copy in range(chat_copies):
            texts += training_texts(pairs, args.seed + copy)
        random.Random(args.seed).shuffle(texts)
        log(f"{len(pairs)} instruction pairs from the train files, {chat_copies} copies each")
        encs = tok.encode_batch(texts, add_special_tokens=False)
        parts = []
        for e in encs:
            parts.append(np.asarray([bos] + e.ids + [eos], dtype=np.uint16))
        stream = np.concatenate(parts)
        log(f"tokenized train split in {time.time() - t0:.0f}s: {fmt_int(len(stream))} tokens")
        work.mkdir(parents=True, exist_ok=True)
        tok.save(str(tok_path))
        np.save(stream_path, stream)
        meta_path.write_text(json.dumps(meta, indent=1))
    ids = {"bos": tok.token_to_id(BOS), "eos": tok.token_to_id(EOS), "pad": tok.token_to_id(PAD)}
    return {"docs": docs, "paths": paths, "hash": flh, "train_files": train_files, "held_files": held_files,
            "tok": tok, "stream": stream, "ids": ids, "pairs": len(pairs), "chat_copies": chat_copies}
