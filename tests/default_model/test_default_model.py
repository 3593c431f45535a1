"""The embedded default model (kvserve/default_model/checkpoint): present, loadable offline, and
better than gzip -9 at predicting Python source it never saw."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import gzip
import json
import math
import sysconfig
from pathlib import Path

import pytest

from kvserve.default_model import default_model_dir

MODEL_DIR = Path(default_model_dir())
REQUIRED = {
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "training_info.json",
    "loss_curve.png",
}
ALLOWED = REQUIRED | {"special_tokens_map.json", "chat_template.jinja", "README.md"}


@pytest.fixture(scope="module")
def info():
    return json.loads((MODEL_DIR / "training_info.json").read_text())


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    import torch

    tok = transformers.AutoTokenizer.from_pretrained(str(MODEL_DIR), local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(MODEL_DIR), local_files_only=True, dtype=torch.float32
    )
    model.eval()
    return tok, model


def test_default_model_dir_is_absolute_and_inside_package():
    assert MODEL_DIR.is_absolute()
    assert MODEL_DIR.name == "checkpoint" and MODEL_DIR.parent.name == "default_model"
    assert (MODEL_DIR.parent / "__init__.py").is_file()


def test_shipped_files():
    names = {p.name for p in MODEL_DIR.iterdir()}
    assert REQUIRED <= names, f"missing: {REQUIRED - names}"
    assert names <= ALLOWED, f"stray files in the model dir: {names - ALLOWED}"
    size = (MODEL_DIR / "model.safetensors").stat().st_size
    assert 1_000_000 < size <= 30_000_000
    assert (MODEL_DIR / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_safetensors_float32_and_config_consistent():
    from safetensors import safe_open

    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    gen = json.loads((MODEL_DIR / "generation_config.json").read_text())
    tcfg = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert head_dim >= 32
    assert cfg["max_position_embeddings"] >= 1024
    with safe_open(str(MODEL_DIR / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        assert keys
        for k in keys:
            assert str(f.get_slice(k).get_dtype()) in ("F32",), k
        emb = f.get_slice("model.embed_tokens.weight").get_shape()
    assert emb == [cfg["vocab_size"], cfg["hidden_size"]]

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    assert tok.get_vocab_size() == cfg["vocab_size"]
    bos, eos = tok.token_to_id(tcfg["bos_token"]), tok.token_to_id(tcfg["eos_token"])
    assert bos is not None and eos is not None
    assert cfg["bos_token_id"] == gen["bos_token_id"] == bos
    assert cfg["eos_token_id"] == gen["eos_token_id"] == eos
    assert tcfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tcfg["model_max_length"] == cfg["max_position_embeddings"]
    assert "chat_template" in tcfg or (MODEL_DIR / "chat_template.jinja").exists()


def test_tokenizer_json_roundtrips_bytes():
    """The engine reads tokenizer.json with `tokenizers` directly: byte-level, lossless."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    tcfg = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    bos = tok.token_to_id(tcfg["bos_token"])
    text = "def f(x):\n\tif x:  # naïve → 日本語 🐍\r\n        return {'a': [1, 2.5e-3]}\n\n"
    enc = tok.encode(text)
    assert enc.ids[0] == bos  # a plain prompt gets bos, as in training
    assert tok.decode(enc.ids) == text
    assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text


def test_training_info_consistent(info):
    fin, tr, corpus = info["final"], info["training"], info["corpus"]
    assert fin["heldout_bits_per_byte"] < fin["gzip9_bits_per_byte"]
    assert 0 < fin["heldout_loss"] < 6 and 0 < fin["train_loss"] < 6
    # bits/byte and loss/token agree through the recorded bytes and tokens
    bpb = fin["heldout_loss"] * fin["heldout_eval_tokens"] / math.log(2) / fin["heldout_eval_bytes"]
    assert bpb == pytest.approx(fin["heldout_bits_per_byte"], rel=1e-6)
    assert tr["steps"] > 0 and tr["tokens_seen"] == tr["steps"] * tr["tokens_per_step"]
    assert tr["wall_time_s"] >= tr["train_time_s"] * 0.99 > 0
    assert len(corpus["file_list_sha256"]) == 64
    assert corpus["n_heldout_files"] == len(corpus["heldout_files"]) > 0
    assert corpus["n_train_files"] + corpus["n_heldout_files"] == corpus["n_files"]
    assert info["model"]["params"] > 1_000_000


def test_loads_offline_with_transformers(hf):
    tok, model = hf
    assert model.config.eos_token_id == tok.eos_token_id
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Write a function."}], add_generation_prompt=True, tokenize=False
    )
    assert ids.startswith(tok.bos_token) and ids.endswith("<|assistant|>\n")
    assert "<|user|>\nWrite a function.\n" in ids


def _heldout_sample(info, target_bytes=32_000, per_file=6_000):
    """Prefixes (cut at a line end) of held-out files, read from this interpreter's stdlib."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for rel in info["corpus"]["heldout_files"]:
        p = root / rel
        try:
            text = p.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) > per_file:
            text = text[: text.rfind("\n", 0, per_file) + 1]
        if not text.strip():
            continue
        texts.append(text)
        total += len(text.encode("utf-8"))
        if total >= target_bytes:
            break
    return texts


def _bits_per_byte(model, tok, texts: list[str], ctx: int) -> float:
    """Held-out bits per byte: every token after bos predicted once, windows of ``ctx``.
    The forward runs through transformers' cache, as generation does (and as the
    KV-dtype oracle needs)."""
    import torch
    import torch.nn.functional as F

    nll, n_bytes = 0.0, sum(len(t.encode("utf-8")) for t in texts)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    with torch.inference_mode():
        for text in texts:
            seq = [tok.bos_token_id] + tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]
            for s in range(0, len(seq) - 1, ctx):
                w = torch.tensor([seq[s : s + ctx + 1]])
                logits = model(input_ids=w[:, :-1], use_cache=True).logits.float()
                nll += float(F.cross_entropy(logits[0], w[0, 1:], reduction="sum"))
    return nll / math.log(2) / n_bytes


def test_heldout_bits_per_byte_beats_gzip(info, hf):
    """Regression guard: recompute bits/byte on unseen stdlib files; must beat gzip -9."""
    tok, model = hf
    texts = _heldout_sample(info)
    data = b"".join(t.encode("utf-8") for t in texts)
    if len(data) < 8_000:
        pytest.skip("held-out files not found in this interpreter's stdlib")
    model_bpb = _bits_per_byte(model, tok, texts, info["final"].get("heldout_eval_context", 512))
    gzip_bpb = 8 * len(gzip.compress(data, 9)) / len(data)
    print(f"held-out sample: {len(texts)} files, {len(data)} bytes: "
          f"model {model_bpb:.3f} bits/byte, gzip -9 {gzip_bpb:.3f}")
    assert model_bpb < gzip_bpb
    # and not wildly off what training recorded on the full held-out set
    assert model_bpb < info["final"]["heldout_bits_per_byte"] + 0.6


def test_int8_and_half_kv_cache_cost_little_on_heldout(info, monkeypatch):
    """What ``--quantization int8`` and ``--kv-cache-dtype`` cost in prediction quality, on
    the embedded (trained) model: bits/byte of the same held-out sample through the
    arithmetic each setting is tested to reproduce token for token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.helpers import int8_reference_transform, round_kv_cache

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    texts = _heldout_sample(info, target_bytes=16_000)
    if sum(len(t) for t in texts) < 8_000:
        pytest.skip("held-out files not found in this interpreter's stdlib")
    ctx = info["final"].get("heldout_eval_context", 512)

    def bpb(transform=None, kv_dtype=None) -> float:
        model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
        if transform:
            transform(model)
        with monkeypatch.context() as m:
            if kv_dtype is not None:
                round_kv_cache(m, kv_dtype)
            return _bits_per_byte(model, tok, texts, ctx)

    base = bpb()
    costs = {"int8": bpb(int8_reference_transform) - base,
             "float16 KV": bpb(kv_dtype=torch.float16) - base,
             "bfloat16 KV": bpb(kv_dtype=torch.bfloat16) - base}
    print(f"held-out bits/byte {base:.4f}; added: " +
          ", ".join(f"{k} {v:+.5f}" for k, v in costs.items()))
    assert all(v != 0 for v in costs.values())  # each setting really changed the arithmetic
    # measured: int8 +0.00017, half-precision KV within 0.00001 of float32 (either sign)
    assert costs["int8"] < 0.01 and abs(costs["bfloat16 KV"]) < 0.002
    assert abs(costs["float16 KV"]) < 0.001


def test_greedy_completion_is_python_like(hf):
    import torch

    tok, model = hf
    enc = tok("def fibonacci(n):", return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=24, do_sample=False)
    text = tok.decode(out[0, enc.input_ids.shape[1]:], skip_special_tokens=True)
    assert text.strip(), "empty completion"
    assert "\n" in text  # continues with a function body on new lines


def test_the_readmes_sample_chat_answer_is_the_models():
    """README's sample chat request is answered as the README shows."""
    import re

    from kvserve import LLM

    readme = (MODEL_DIR.parents[2] / "README.md").read_text()
    request = re.search(r'"content": "(Write a Python function: [^"]+)"', readme).group(1)
    shown = re.search(r"a function in shape, not in\nmeaning\.\n\n```python\n(.*?)```",
                      readme, re.S).group(1)
    llm = LLM(num_kv_blocks=64)
    params = llm.get_default_sampling_params()
    params.temperature, params.max_tokens = 0.0, 64
    answer = llm.chat([{"role": "user", "content": request}], params, use_tqdm=False)[0]
    llm.engine.close()
    assert answer.outputs[0].text == shown
