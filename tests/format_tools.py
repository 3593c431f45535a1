"""The formats' own tools, run by the tests to make the files kvserve loads: llama.cpp's
converter and quantizer (from llama-cpp-python's sdist) for GGUF files, llmcompressor
(in a venv of its own) for compressed-tensors checkpoints, GPTQModel (in another) for
GPTQ and AWQ checkpoints and for transformers' own reading of them."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"  # the bench peer's version; its sdist vendors llama.cpp


def llama_cpp_source(cache: Path) -> Path:
    """llama.cpp's source tree, as llama-cpp-python's sdist vendors it (fetched by pip
    once into ``cache``)."""
    import subprocess
    import sys
    import tarfile
    tree = cache / "llama.cpp"
    if (tree / "convert_hf_to_gguf.py").is_file():
        return tree
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", LLAMA_CPP_PYTHON, "--no-binary",
                    ":all:", "--no-deps", "-d", str(cache)], check=True, capture_output=True)
    sdist = next(cache.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        tar.extractall(cache / "sdist", filter="data")
    vendored = next((cache / "sdist").glob("llama_cpp_python-*/vendor/llama.cpp"))
    vendored.rename(tree)
    return tree


def llama_cpp_tool(tree: Path, name: str) -> Path:
    """A llama.cpp program (``llama-quantize``, ...) built from ``tree`` with its own
    CMake build (once, beside the tree; cmake and a C++ compiler are required)."""
    import shutil
    import subprocess
    build = tree.parent / "build"
    binary = build / "bin" / name
    if binary.is_file():
        return binary
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise RuntimeError(f"building llama.cpp's {name} needs {' and '.join(missing)}")
    # the vendored tree has no git history: its programs name the release it came with
    vendored_from = LLAMA_CPP_PYTHON.replace("==", "-")
    subprocess.run(["cmake", "-S", str(tree), "-B", str(build), "-DGGML_NATIVE=ON",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DCMAKE_BUILD_TYPE=Release",
                    f"-DLLAMA_BUILD_COMMIT={vendored_from}"],
                   check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2),
                    "--target", name], check=True, capture_output=True)
    return binary


def quantize_gguf(tree: Path, source: Path, kind: str, out: Path) -> Path:
    """``source`` (a GGUF file) quantized to ``kind`` (``Q4_K_M``, ...) by llama.cpp's
    own llama-quantize."""
    from kvserve.bench.workloads.gguf_models import quantize_gguf as quantize
    return quantize(llama_cpp_tool(tree, "llama-quantize"), source, out, kind)


# llama.cpp's converter names a BPE tokenizer's pre-tokenizer by hashing how it splits a
# text, known only for published tokenizers; the test tokenizer splits as GPT-2's does
_CONVERT = """
import sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/gguf-py"]
import convert_hf_to_gguf
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
convert_hf_to_gguf.main()
"""


def convert_to_gguf(source: Path, model_dir: str, outtype: str, out: Path) -> Path:
    """``model_dir`` converted by llama.cpp's own converter to a GGUF file of ``outtype``
    (f32, f16, bf16, q8_0)."""
    import subprocess
    import sys
    subprocess.run([sys.executable, "-c", _CONVERT, str(source), model_dir, "--outtype",
                    outtype, "--outfile", str(out)], check=True, capture_output=True)
    return out


# the compressed-tensors checkpoints' tool, in a venv of its own (it pins an older
# transformers than the one kvserve is tested against)
LLMCOMPRESSOR = ("torch==2.13.0", "llmcompressor==0.14.0.1")


def tool_python(cache: Path, requirements: tuple[str, ...]) -> Path:
    """The python of a venv with ``requirements`` (made once under ``cache``; torch first,
    pinned: the CPU wheel, and kept at that version by a constraint)."""
    import subprocess
    import sys
    python = cache / "venv" / "bin" / "python"
    done = cache / "venv" / "installed.txt"
    if done.is_file() and done.read_text() == " ".join(requirements):
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(cache / "venv")], check=True)
    pins = cache / "venv" / "constraints.txt"
    pins.write_text(requirements[0] + "\n")
    for requirement in requirements:
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", str(pins), requirement],
                       check=True, capture_output=True)
    done.write_text(" ".join(requirements))
    return python


def llmcompressor_python(cache: Path) -> Path:
    """The python of a venv with llmcompressor (made once under ``cache``)."""
    return tool_python(cache, LLMCOMPRESSOR)


_COMPRESS = """
import sys
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier
source, scheme, out = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
g = torch.Generator().manual_seed(0)
rows = [torch.randint(4, model.config.vocab_size, (64,), generator=g).tolist() for _ in range(16)]
data = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * 64] * 16})
oneshot(model=model, dataset=data, num_calibration_samples=16, max_seq_length=64,
        recipe=GPTQModifier(targets="Linear", scheme=scheme, ignore=["lm_head"]))
model.save_pretrained(out, save_compressed=True)
"""


def compress_checkpoint(python: Path, model_dir: str, scheme: str, out: Path) -> str:
    """``model_dir`` quantized by llmcompressor's GPTQ to ``scheme`` (``W8A8``, ``W4A16``,
    ``W4A16_ASYM``), calibrated on random tokens, saved compressed with its tokenizer."""
    import subprocess
    subprocess.run([str(python), "-c", _COMPRESS, model_dir, scheme, str(out)], check=True,
                   capture_output=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(model_dir) / name, out / name)
    return str(out)


# GPTQ and AWQ checkpoints' tool (GPTQModel quantizes both on the CPU), with the
# transformers it brings, which reads them through GPTQModel's torch kernels (and optimum,
# for GPTQ): the reference kvserve's greedy tokens are checked against
GPTQMODEL = ("torch==2.13.0", "gptqmodel==7.6.0", "optimum==2.3.0")

_GPTQ_QUANTIZE = """
import os, sys, json
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # its loader pool asks for two
import torch
from gptqmodel import AWQConfig, BACKEND, GPTQConfig, GPTQModel
source, out, method, group, sym, desc_act, fmt = sys.argv[1:8]
if method == "gptq":
    config = GPTQConfig(bits=4, group_size=int(group), sym=sym == "1", desc_act=desc_act == "1",
                        format=fmt)
else:
    config = AWQConfig(bits=4, group_size=int(group), sym=sym == "1", format="gemm")
vocab = json.load(open(os.path.join(source, "config.json")))["vocab_size"]
g = torch.Generator().manual_seed(0)
calibration = [{"input_ids": torch.randint(4, vocab, (1, 64), generator=g),
                "attention_mask": torch.ones(1, 64, dtype=torch.long)} for _ in range(32)]
model = GPTQModel.load(source, config, device="cpu", dtype=torch.float16)
if method == "gptq":
    model.quantize(calibration, batch_size=1)
else:
    model.quantize(calibration, batch_size=1, backend=BACKEND.AWQ_TORCH)
model.save(out)
"""


def gptqmodel_python(cache: Path) -> Path:
    """The python of a venv with GPTQModel (made once under ``cache``)."""
    return tool_python(cache, GPTQMODEL)


def gptq_checkpoint(python: Path, model_dir: str, out: Path, method: str, group: int,
                    symmetric: bool, desc_act: bool = False, fmt: str = "gptq") -> str:
    """``model_dir`` quantized by GPTQModel to 4 bits (``method`` "gptq", in checkpoint
    format ``fmt``, or "awq"), calibrated on random tokens, saved with its tokenizer."""
    import subprocess
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(python), "-c", _GPTQ_QUANTIZE, model_dir, str(out / "model"), method,
                    str(group), str(int(symmetric)), str(int(desc_act)), fmt], check=True,
                   capture_output=True, cwd=out)  # (it writes a logs folder where it runs)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(model_dir) / name, out / "model" / name)
    return str(out / "model")


_TRANSFORMERS_GREEDY = """
import json, sys
import torch
from transformers import AutoModelForCausalLM
model_dir, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(model_dir, device_map="cpu", dtype=torch.float32)
# each quantized layer as GPTQModel dequantizes it, with its scales in float32 (its CPU
# kernel would multiply in bfloat16): dequantize-then-multiply, in float32
for name, layer in list(model.named_modules()):
    if not hasattr(layer, "qweight"):
        continue
    layer.scales = layer.scales.float()
    weight = (layer.awq_weight_dequantize("cpu", torch.float32)
              if hasattr(layer, "awq_weight_dequantize") else layer.dequantize_weight())
    dense = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    dense.weight.data = weight.t().float().contiguous()
    if layer.bias is not None:
        dense.bias.data = layer.bias.float()
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, dense)
outs = []
with torch.inference_mode():
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             min_new_tokens=max_tokens)
        outs.append(ids[0, len(prompt):].tolist())
print(json.dumps(outs))
"""


def transformers_greedy_in(python: Path, model_dir: str, prompts: list[list[int]],
                           max_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens for ``prompts``, the quantized checkpoint read in
    ``python``'s venv (GPTQModel's), each quantized layer dequantized by GPTQModel."""
    import json
    import subprocess
    done = subprocess.run([str(python), "-c", _TRANSFORMERS_GREEDY, model_dir,
                           json.dumps(prompts), str(max_tokens)], check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])
