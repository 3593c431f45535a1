"""What training the embedded default model writes: the model directory in Hugging Face
layout (weights, config, tokenizer, chat template) and its training_info.json (corpus,
tokenizer, model, training run, final evaluation), so the model documents itself."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from tools.default_model.instructions import MAX_ANSWER_CHARS, REQUEST_FORMS
from tools.default_model.training_data import BOS, EOS, HELD_OUT_FRACTION, PAD, SPECIAL_TOKENS

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|system|>\\nYou may call these tools. To call one, answer with <tool_call>{\"name\": <name>, \"arguments\": <arguments>}</tool_call>.\\n<tools>\\n' }}"
    "{% for tool in tools %}"
    "{{ tool | tojson }}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{{ '</tools>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% if message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}"
    "{{ '<tool_call>' }}"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "{{ '</tool_call>' }}"
    "{% endfor %}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ eos_token }}"
    "{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|assistant|>\\n' }}"
    "{% endif %}"
)


def training_info(args, data: dict, model, tok, preset: dict, st: dict, T: int, B: int,
                  stream_tokens: int, ema: float, evaluation: tuple) -> dict:
    """``evaluation``: (held-out result, train result, gzip bits per byte, files evaluated)
    as :func:`tools.default_model.train_default.final_evaluation` returns them."""
    import torch
    import transformers

    res, tres, gz, eval_files = evaluation
    n_params = sum(p.numel() for p in model.parameters())
    n_nonemb = n_params - model.get_input_embeddings().weight.numel()
    held_sha = hashlib.sha256("\n".join(data["held_files"]).encode()).hexdigest()
    info = {
        "description": ("kvserve embedded default model: a small Llama-architecture code model trained "
                        "from scratch on the Python standard library's .py sources and instruction "
                        "pairs built from their docstrings"
                        if not args.teacher else
                        f"kvserve draft model: a smaller sibling distilled from {Path(args.teacher).name} "
                        "on the same corpus, with its tokenizer, for speculative decoding"),
        "objective": ("KL(teacher || model) per next token" if args.teacher
                      else "cross-entropy of the next token"),
        "corpus": {
            "source": "Python standard library .py files (sysconfig stdlib path), test dirs included; "
                      "site-packages, non-UTF-8, empty and >512KB files skipped",
            "python_version": sys.version.split()[0],
            "python_implementation": sys.implementation.name,
            "n_files": len(data["paths"]),
            "n_train_files": len(data["train_files"]),
            "n_heldout_files": len(data["held_files"]),
            "file_list_sha256": data["hash"],
            "heldout_file_list_sha256": held_sha,
            "split_seed": args.seed,
            "heldout_fraction": HELD_OUT_FRACTION,
            "train_tokens_per_epoch": stream_tokens,
            "heldout_files": data["held_files"],
        },
        "instructions": {
            "source": "functions of the train files: docstring summary as the request, the function as the answer",
            "pairs": data["pairs"], "copies_per_epoch": data["chat_copies"],
            "max_answer_chars": MAX_ANSWER_CHARS, "request_forms": list(REQUEST_FORMS),
        },
        "tokenizer": {"type": "byte-level BPE (tokenizers)", "vocab_size": tok.get_vocab_size(),
                      "special_tokens": SPECIAL_TOKENS,
                      "heldout_bytes_per_token": None},
        "model": {"architecture": "LlamaForCausalLM", **preset,
                  "head_dim": model.config.head_dim,
                  "max_position_embeddings": model.config.max_position_embeddings,
                  "tie_word_embeddings": True, "params": n_params, "non_embedding_params": n_nonemb},
        "training": {
            "seq_len": T, "batch_size": B, "tokens_per_step": B * T, "lr": args.lr,
            "schedule": f"linear warmup {args.warmup_steps} steps, cosine over training time to 10%",
            "optimizer": "AdamW(0.9, 0.95), weight decay %.2f on matrices, grad clip 1.0" % args.weight_decay,
            "dtype": "float32", "threads": args.threads, "compiled": bool(args.compile),
            "steps": st["step"], "tokens_seen": st["tokens"], "epochs": st["tokens"] / stream_tokens,
            "train_time_s": round(st["train_time"], 1), "wall_time_s": round(st["wall_time_total"], 1),
            "tokens_per_s": round(st["tokens"] / max(st["train_time"], 1e-9), 1),
            "started": st["started"], "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "torch": torch.__version__, "transformers": transformers.__version__,
        },
        "final": {
            "train_loss_ema": ema,
            "train_loss": tres["loss"],
            "train_bits_per_byte": tres["bits_per_byte"],
            "heldout_loss": res["loss"],
            "heldout_bits_per_byte": res["bits_per_byte"],
            "gzip9_bits_per_byte": gz,
            "heldout_eval_files": len(eval_files),
            "heldout_eval_bytes": res["bytes"],
            "heldout_eval_tokens": res["tokens"],
            "heldout_eval_context": T,
            "bits_per_byte_method": "sum of token NLL (nats) / ln 2 / UTF-8 bytes; each file bos+text+eos, "
                                    f"windows of {T} tokens; gzip: 8*len(gzip.compress(concat, 9))/len(concat)",
        },
        "history": st["history"],
    }
    info["tokenizer"]["heldout_bytes_per_token"] = round(res["bytes"] / max(res["tokens"], 1), 3)
    return info


def write_model_files(out: Path, model, tok, ids: dict,
                      repetition_penalty: float | None = None) -> None:
    """The model in HF layout (safetensors, config, generation config) with its tokenizer
    files and chat template; ``out`` is emptied first (only our outputs live there)."""
    import torch
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    for child in out.iterdir():  # only our own outputs live here: start clean
        if child.is_dir():
            shutil.rmtree(child)
        else:
            child.unlink()
    model.config.bos_token_id = ids["bos"]
    model.config.eos_token_id = ids["eos"]
    model.config.pad_token_id = ids["pad"]
    model.generation_config = GenerationConfig(bos_token_id=ids["bos"], eos_token_id=ids["eos"],
                                               pad_token_id=ids["pad"], do_sample=False,
                                               **({} if repetition_penalty is None else
                                                  {"repetition_penalty": repetition_penalty}))
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    os.chmod(out / "model.safetensors", 0o644)  # package data: world-readable
    cfg_path = out / "config.json"
    cfg_json = json.loads(cfg_path.read_text())
    cfg_json.setdefault("rope_theta", 10000.0)  # also the transformers 4.x spelling
    cfg_path.write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "model_max_length": model.config.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": True,
        "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2) + "\n")


SOURCES = [
    ("The CPython standard library's `.py` files of the interpreter that trains the model",
     "Python Software Foundation License Version 2 (PSF-2.0)"),
    ("Instruction pairs made from those same files: each documented function's docstring "
     "summary as the request, the function as the answer", "PSF-2.0 (derived from the files above)"),
]


def model_card(info: dict, generation: dict | None = None) -> str:
    """The model directory's README.md: what the model is, what it was trained on and under
    which licences, and how, from its training_info.json."""
    m, t, c, f = info["model"], info["training"], info["corpus"], info["final"]
    pairs = info.get("instructions", {})
    rows = "\n".join(f"| {source} | {licence} |" for source, licence in SOURCES[:2 if pairs else 1])
    lines = [
        "# kvserve's embedded model",
        "",
        info["description"] + ".",
        "",
        "## Sources and licences",
        "",
        "| source | licence |",
        "|---|---|",
        rows,
        "",
        f"Python {c['python_version']} ({c['python_implementation']}): {c['n_files']} files, "
        f"{c['n_heldout_files']} held out by a seeded split (seed {c['split_seed']}; the list "
        "is in training_info.json)"
        + (f"; {pairs['pairs']} instruction pairs from the train files, each packed "
           f"{pairs['copies_per_epoch']} times an epoch." if pairs else "."),
        "",
        "## Model and training",
        "",
        f"`{m['architecture']}`: {m['params']:,} parameters, hidden size {m['hidden_size']}, "
        f"{m['num_hidden_layers']} layers, {m['num_attention_heads']} query / "
        f"{m['num_key_value_heads']} KV heads, tied embeddings, "
        f"{info['tokenizer']['vocab_size']}-token byte-level BPE.",
        f"Trained from scratch by `python -m tools.default_model.train_default` for "
        f"{t['train_time_s'] / 60:.0f} minutes ({t['threads']} CPU threads, {t['dtype']}): "
        f"{t['tokens_seen']:,} tokens, {t['steps']} steps of {t['tokens_per_step']} tokens.",
        "",
        f"Held-out bits per byte: {f['heldout_bits_per_byte']:.3f} (gzip -9 on the same bytes: "
        f"{f['gzip9_bits_per_byte']:.3f}).",
        "",
    ]
    penalty = (generation or {}).get("repetition_penalty")
    if penalty:
        lines += [f"generation_config.json recommends `repetition_penalty` {penalty} (chosen by "
                  "`python -m tools.default_model.evaluate_default --tune` on train-file "
                  "function headers and requests).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="write a trained model directory's model card")
    ap.add_argument("model_dir")
    args = ap.parse_args(argv)
    out = Path(args.model_dir)
    generation = out / "generation_config.json"
    (out / "README.md").write_text(model_card(
        json.loads((out / "training_info.json").read_text()),
        json.loads(generation.read_text()) if generation.is_file() else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
