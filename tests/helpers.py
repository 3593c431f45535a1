"""Test helpers: build tiny models with transformers, and greedy decoding with HF as oracle."""
from __future__ import annotations

import inspect
import json
import shutil
import sysconfig
from pathlib import Path

import torch

VOCAB = 512
# the kernels' builds besides the native one: AVX2 on an AVX-512 machine, plain C
KERNEL_BUILD_FLAGS = {"avx2": ("-mno-avx512f",),
                      "plain-c": ("-mno-avx512f", "-mno-avx2", "-mno-fma")}
SPECIALS = ["<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def build_tokenizer(out: Path) -> str:
    """A small byte-level BPE trained on a few stdlib files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text() for name in ("textwrap.py", "string.py", "bisect.py")]
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", tok.token_to_id("<|bos|>"))])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>",
        "eos_token": "<|eos|>", "model_max_length": 512, "chat_template": CHAT_TEMPLATE}))
    return str(out)


def _config(arch: str):
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=0, eos_token_id=1)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "llama3-tied":
        return LlamaConfig(**{**common, "tie_word_embeddings": True, "rope_scaling": {
            "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}})
    if arch == "llama-256":  # rows of whole 256-value blocks: llama.cpp's K formats
        return LlamaConfig(**{**common, "hidden_size": 256, "intermediate_size": 512})
    if arch == "qwen3-moe-256":  # every expert's rows whole 256-value blocks
        from transformers import Qwen3MoeConfig
        return Qwen3MoeConfig(**{**common, "hidden_size": 256}, num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=256, head_dim=64,
                              norm_topk_prob=True)
    if arch == "llama-linear":
        return LlamaConfig(**{**common, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    if arch == "llama-dynamic":  # trained on 48 positions, serves 4 x 48
        return LlamaConfig(**{**common, "max_position_embeddings": 48,
                              "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen2-wide":  # room past the vocabulary for the <|endoftext|> Qwen2's
        return Qwen2Config(**{**common, "vocab_size": VOCAB + 8})  # tokenizer class adds
    if arch == "mistral":
        return MistralConfig(**{**common, "sliding_window": 24})
    if arch in NEW_ARCHS:
        return _new_arch_config(arch, common)
    if arch == "gpt2":
        return GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                          bos_token_id=0, eos_token_id=1)
    raise ValueError(arch)


# the architectures beyond the first four, each a tiny config of its own family
NEW_ARCHS = ["qwen3", "qwen3-yarn", "olmo2", "phi3", "phi3-longrope", "mixtral", "qwen2-moe",
             "qwen3-moe", "gemma2", "gemma3"]


def _new_arch_config(arch: str, common: dict):
    import transformers as tf
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=16)
    if arch == "qwen3-yarn":
        return tf.Qwen3Config(**common, head_dim=16, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})
    if arch == "olmo2":
        return tf.Olmo2Config(**common, pad_token_id=None)
    if arch == "phi3":
        return tf.Phi3Config(**common, pad_token_id=None)
    if arch == "phi3-longrope":  # partial rotary; every test sequence within 128 positions
        half = int(16 * 0.5) // 2
        return tf.Phi3Config(**common, pad_token_id=None, partial_rotary_factor=0.5,
                             original_max_position_embeddings=128, rope_scaling={
                                 "rope_type": "longrope", "short_factor": [1.0 + i / 10 for i in range(half)],
                                 "long_factor": [2.0 + i for i in range(half)]})
    if arch == "gemma2":  # windows short enough that the test prompts pass them
        return tf.Gemma2Config(**common, head_dim=16, sliding_window=12, pad_token_id=None,
                               query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                               final_logit_softcapping=3.0)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(**{**common, "num_hidden_layers": 3}, head_dim=16,
                                   sliding_window=12, pad_token_id=None,
                                   sliding_window_pattern=3, rope_local_base_freq=100.0)
    if arch == "mixtral":
        return tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    if arch == "qwen2-moe":  # a shared expert; the second layer dense
        return tf.Qwen2MoeConfig(**common, **moe, shared_expert_intermediate_size=48,
                                 mlp_only_layers=[1])
    if arch == "qwen3-moe":
        return tf.Qwen3MoeConfig(**common, **moe, head_dim=16, norm_topk_prob=True)
    raise ValueError(arch)


def build_tiny_model(arch: str, out: Path, tokenizer_dir: str) -> str:
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(arch))
    with torch.no_grad():  # wider weights than HF's init: peaked logits, fewer near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.25)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_dir) / name, out / name)
    return str(out)


def prompts_of_lengths(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int,
              transform=None) -> list[list[int]]:
    """The oracle: transformers' own forward with its KV cache, argmax each step.
    ``transform(model)``, when given, changes the loaded model first (e.g. quantizes it)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if transform is not None:
        transform(model)
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        past, new = None, []
        for _ in range(max_new_tokens):
            out = model(input_ids=ids, use_cache=True, **{cache_arg: past})
            past = getattr(out, cache_arg, None) or out.past_key_values
            token = int(out.logits[0, -1].argmax())
            new.append(token)
            ids = torch.tensor([[token]])
        outs.append(new)
    return outs


def greedy_oracle(model_dirs, lengths: list[int], max_new_tokens: int):
    """arch -> transformers' greedy tokens for ``prompts_of_lengths(lengths)``, each
    computed once."""
    cache: dict[str, list[list[int]]] = {}

    def get(arch: str) -> list[list[int]]:
        if arch not in cache:
            cache[arch] = hf_greedy(model_dirs(arch), prompts_of_lengths(lengths),
                                    max_new_tokens)
        return cache[arch]
    return get


@torch.inference_mode()
def hf_logprobs(model_dir: str, prompt: list[int], continuation: list[int],
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """log-softmax of the next-token distribution at each continuation position."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    ids = torch.tensor([prompt + continuation])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:len(prompt) + len(continuation) - 1]
    return logits.float().log_softmax(-1)


# nats, on a W8A8 checkpoint's greedy continuations: the median and the worst difference
# from compressed-tensors' logprobs (wide random weights put logits in the tens, so one
# activation code rounded the other way moves a logprob by a tenth of a nat)
W8A8_TOLERANCE = {"median": 0.01, "worst": 0.25}


@torch.inference_mode()
def w8a8_logprob_differences(reference, llm, prompts: list[list[int]], max_new_tokens: int
                             ) -> torch.Tensor:
    """|kvserve's logprob - ``reference``'s| of each token of ``reference``'s greedy
    continuations of ``prompts``, teacher-forced: both round each token's activations to
    int8 alike; kvserve sums the int8 products exactly, compressed-tensors multiplies the
    dequantized values in float, so they differ by float rounding only (a value on a
    rounding boundary may round the other way, and a near-tie may break the other way)."""
    from kvserve import SamplingParams
    diffs = []
    for prompt in prompts:
        seq = reference.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False)[0]
        theirs = reference(seq[None]).logits[0, :-1].float().log_softmax(-1)
        out = llm.generate([{"prompt_token_ids": seq.tolist()}],
                           SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
        for i in range(len(prompt), len(seq)):
            ours = out.prompt_logprobs[i][int(seq[i])].logprob
            diffs.append(abs(ours - float(theirs[i - 1, seq[i]])))
    return torch.tensor(diffs)


def int8_reference_transform(model) -> None:
    """Give a transformers model kvserve's int8 arithmetic in every linear layer but the
    LM head (``--quantization int8``'s oracle)."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    from kvserve.model.quantization import int8_reference_linear
    for name, module in model.named_modules():
        if name.endswith("lm_head"):
            continue
        if isinstance(module, nn.Linear):
            module.forward = lambda x, m=module: int8_reference_linear(x, m.weight, m.bias)
        elif isinstance(module, Conv1D):  # GPT-2 stores [in, out]
            module.forward = lambda x, m=module: int8_reference_linear(x, m.weight.t(), m.bias)


def round_kv_cache(monkeypatch, dtype: torch.dtype) -> None:
    """Make transformers' DynamicCache round each new key/value to ``dtype`` before it is
    cached and attended to (``--kv-cache-dtype``'s oracle); undone with ``monkeypatch``."""
    from transformers.cache_utils import DynamicCache
    original = DynamicCache.update

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        rounded = [x.to(dtype).to(x.dtype) for x in (key_states, value_states)]
        return original(self, *rounded, layer_idx, *args, **kwargs)

    monkeypatch.setattr(DynamicCache, "update", update)


async def engine_settled(engine, timeout: float = 10.0) -> bool:
    """Wait until an AsyncLLMEngine has nothing running or waiting and no KV in use."""
    import asyncio
    for _ in range(int(timeout / 0.02)):
        s = engine.snapshot
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_usage == 0:
            return True
        await asyncio.sleep(0.02)
    return False


def flat_step_cost(monkeypatch) -> None:
    """Steps as dear at any row count (as a tiny model's are, up to noise), so the drafts
    a test makes do not depend on how busy the machine was at start. A step is priced
    far above what proposing a draft costs (timed live, tens of microseconds on a fast
    machine and more on a slow one): only the rows decide whether a draft pays."""
    from kvserve.worker.cpu_worker import CPUWorker
    monkeypatch.setattr(CPUWorker, "time_step_rows",
                        lambda self, rows: {r: 0.1 * (1 + r / 1000) for r in rows})


LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_lora_adapter(model_dir: str, out: Path, seed: int, rank: int = 8,
                       alpha: int = 16, modules: list[str] | None = None,
                       use_rslora: bool = False, **config) -> str:
    """A PEFT LoRA adapter of ``model_dir``, saved by peft, with B non-zero (as after
    training) so that it changes the model's tokens."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, use_rslora=use_rslora,
                                            target_modules=modules or LORA_MODULES,
                                            init_lora_weights=False, **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(out)
    return str(out)


@torch.inference_mode()
def peft_greedy(model_dir: str, adapter_dir: str | None, prompts: list[list[int]],
                max_new_tokens: int) -> list[list[int]]:
    """The LoRA oracle: peft's adapter applied in transformers, greedy (None: the base)."""
    if adapter_dir is None:
        return hf_greedy(model_dir, prompts, max_new_tokens)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        new = []
        past = None
        for _ in range(max_new_tokens):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = int(out.logits[0, -1].argmax())
            new.append(token)
            ids = torch.tensor([[token]])
        outs.append(new)
    return outs


def assert_layer_computes(layer, dense: torch.Tensor, rows: int, native: bool) -> None:
    """``layer``, configured with the native kernels or without, computes ``rows`` rows
    as F.linear on ``dense`` (its float weight) and its bias does, to float32 rounding."""
    import pytest
    import torch.nn.functional as F

    from kvserve.kernels import load_kernels
    from kvserve.model.execution import ExecutionMode
    kernels = load_kernels()
    if native and not kernels.available:
        pytest.fail(f"the native kernels did not build: {kernels.reason}")
    layer.configure(ExecutionMode(kernels=kernels if native else None))
    x = torch.randn(rows, dense.shape[1], generator=torch.Generator().manual_seed(rows))
    want = F.linear(x.double(), dense.double(),
                    None if layer.bias is None else layer.bias.double())
    got = layer(x)
    assert got.shape == (rows, dense.shape[0]) and got.dtype == torch.float32
    assert ((got.double() - want).abs().max() / want.abs().max()) < 2e-6
