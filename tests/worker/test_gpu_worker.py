"""The GPU worker (``--device cuda``) without a GPU: run on the CPU device, its attention
through Triton's interpreter, greedy tokens equal transformers'; the settings that choose
it; and, where torch sees a CUDA device, the same on the GPU."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before triton compiles anything: the CPU runs it
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

import kvserve.worker as workers  # noqa: E402
from kvserve import LLM, EngineArgs, SamplingParams  # noqa: E402
from kvserve.model.loader import resolve_dtype  # noqa: E402
from kvserve.model.registry import read_arch_config  # noqa: E402
from kvserve.worker.gpu_worker import CUDAWorker  # noqa: E402
from tests.helpers import greedy_oracle, prompts_of_lengths  # noqa: E402

LENGTHS = [5, 17, 30, 9, 23, 3]
MAX_TOKENS = 8
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Triton's interpreter runs each program in Python: short sequences, a small warm-up step
SMALL = dict(max_model_len=64, max_num_batched_tokens=64, dtype="float32")


@pytest.fixture(scope="module")
def oracle(model_dirs):
    return greedy_oracle(model_dirs, LENGTHS, MAX_TOKENS)


@pytest.fixture
def gpu_worker_on_cpu(monkeypatch):
    """Engines made in the test get the GPU worker, on the CPU device (on the GPU where
    torch sees one)."""
    made = []

    def create(config, model):
        made.append(CUDAWorker(config, model, device=DEVICE))
        return made[-1]
    monkeypatch.setattr(workers, "_create", create)
    return made


# the interpreter takes tens of seconds an engine: one model in `make test`, more in slow
@pytest.mark.parametrize("arch, backend", [
    ("llama", "auto"), ("llama", "torch"),
    pytest.param("qwen3", "auto", marks=pytest.mark.slow),
    pytest.param("mistral", "auto", marks=pytest.mark.slow)])
def test_greedy_tokens_equal_transformers(arch, backend, model_dirs, oracle,
                                          gpu_worker_on_cpu):
    llm = LLM(model_dirs(arch), num_kv_blocks=64, block_size=8, attention_backend=backend,
              **SMALL)
    worker = gpu_worker_on_cpu[0]
    assert (worker.attention is not None) == (backend == "auto")
    outs = llm.generate(prompts_of_lengths(LENGTHS), GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == oracle(arch)


@pytest.mark.slow
def test_preemption_and_prefix_hits_on_the_gpu_worker(model_dirs, oracle, gpu_worker_on_cpu):
    llm = LLM(model_dirs("llama"), num_kv_blocks=9, block_size=8, **SMALL)
    prompts = prompts_of_lengths(LENGTHS)
    outs = llm.generate(prompts + prompts[:2], GREEDY, use_tqdm=False)
    want = oracle("llama")
    assert [list(o.outputs[0].token_ids) for o in outs] == want + want[:2]
    assert llm.engine.scheduler.num_preemptions > 0


def test_the_gpu_worker_refuses_what_runs_on_the_cpu_only(model_dirs, gpu_worker_on_cpu):
    with pytest.raises(ValueError, match="quantization runs on the CPU worker only"):
        LLM(model_dirs("llama"), num_kv_blocks=16, quantization="int8", **SMALL)


def test_device_cuda_without_one_says_why():
    if torch.cuda.is_available():
        pytest.skip("torch sees a CUDA device here")
    with pytest.raises(ValueError, match="device 'cuda': .*use --device cpu or auto"):
        EngineArgs(device="cuda")
    assert EngineArgs(device="auto").create_worker_config().device == "cpu"
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        EngineArgs(gpu_memory_utilization=1.5)


def test_dtype_auto_is_bfloat16_on_a_gpu(model_dirs):
    arch = read_arch_config(__import__("pathlib").Path(model_dirs("llama")))
    assert resolve_dtype("auto", arch, "cuda") == torch.bfloat16
    assert resolve_dtype("float32", arch, "cuda") == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_the_gpu(dtype, model_dirs, oracle):
    """On a GPU (tools/gpu_check.sh): the real worker, Triton compiled."""
    llm = LLM(model_dirs("llama"), device="cuda", dtype=dtype, num_kv_blocks=64,
              block_size=8)
    outs = llm.generate(prompts_of_lengths(LENGTHS), GREEDY, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    if dtype == "float32":
        assert got == oracle("llama")
    else:
        assert sum(g == w for g, w in zip(got, oracle("llama"))) >= len(got) // 2
