"""Shared fixtures: tiny random Hugging Face models saved to temp dirs, and the oracle."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from tests.helpers import build_lora_adapter, build_tiny_model, peft_greedy, \
    prompts_of_lengths  # noqa: E402
from tests.lora import adapters as lora  # noqa: E402

ARCHS = ["llama", "llama3-tied", "qwen2", "mistral", "gpt2"]


@pytest.fixture(autouse=True)
def captured_steps_whenever_possible(monkeypatch):
    """Engines run every step of 1-8 rows captured, instead of where start-up timing
    finds it faster: the suite then covers the captured step in every mode it runs, the
    same way on every machine (tests/worker/test_captured_step.py covers the choice)."""
    from kvserve.worker import captured_step
    from kvserve.worker.tuning import tuner

    def everywhere(runner, captured, rounds=3):
        captured.max_rows = captured_step.MAX_ROWS
        return {}
    monkeypatch.setattr(tuner, "choose_captured_rows", everywhere)


@pytest.fixture(autouse=True)
def panel_gemm_whenever_possible(monkeypatch):
    """Engines run every GEMM of 9 rows or more that the native panel GEMM can take on
    it, instead of where start-up timing of decode steps finds it faster: the suite then
    covers it in every mode it runs, the same way on every machine, without timing steps
    at every engine start (tests/worker/test_panel_gemm.py covers the choice, and an
    engine on oneDNN's path)."""
    from kvserve.worker.tuning import panel_gemm

    monkeypatch.setattr(panel_gemm, "measure_panel_rows",
                        lambda linears, time_steps, **kw: {n: (1.0, 0.5)
                                                           for n in panel_gemm.ROW_LADDER})
    monkeypatch.setattr(panel_gemm, "time_prompt_gemms", lambda linears, rows: (1.0, 0.5))


@pytest.fixture(autouse=True)
def gemv_on_panels_unless_asked(monkeypatch):
    """Engines' few-row GEMV reads the panels, instead of the copy start-up timing finds
    faster: the same path on every machine (tests/worker/test_gemv_weights.py covers
    the choice, and engines on the dense weights)."""
    from kvserve.worker.tuning import gemv_weights

    monkeypatch.setattr(gemv_weights, "measure_gemv_weights",
                        lambda linears, kernels, **kw: {n: (1.0, 0.5)
                                                        for n in gemv_weights.ROWS})


@pytest.fixture(autouse=True)
def short_gemm_warm_up(monkeypatch):
    """Engines warm their GEMM kernels for at most 8 rows instead of max_num_seqs: the
    warm-up only saves later steps the kernels' generation, never changes a result, and
    the suite builds hundreds of engines (tests/worker/test_gemm_warmup.py covers the
    setting and the full warm-up)."""
    from kvserve.worker.tuning import tuner

    warm = tuner.warm_gemm_kernels
    monkeypatch.setattr(tuner, "warm_gemm_kernels",
                        lambda model, max_rows: warm(model, min(max_rows, 8)))


@pytest.fixture(autouse=True)
def tuning_plans_of_this_test_only(monkeypatch, tmp_path_factory):
    """Engines cache their tuning plans in a folder of the test's own: a plan an earlier
    test (or run) measured never decides what this one measures (tests/worker/tuning/
    test_plan.py covers reuse)."""
    from kvserve.worker.tuning import plan

    folder = tmp_path_factory.mktemp("tuning-plans")
    monkeypatch.setattr(plan, "plan_cache_dir", lambda: folder)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    from tests.helpers import build_tokenizer
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tokenizer_dir):
    """arch name -> directory of a tiny random model in HF layout."""
    cache: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in cache:
            cache[arch] = build_tiny_model(arch, tmp_path_factory.mktemp(arch), tokenizer_dir)
        return cache[arch]
    return get


@pytest.fixture(scope="session")
def llama_dir(model_dirs):
    return model_dirs("llama")


@pytest.fixture(scope="session")
def lora_adapters(model_dirs, tmp_path_factory):
    """arch -> the four adapters' directories (peft's save_pretrained)."""
    cache: dict[str, list[str]] = {}

    def get(arch: str) -> list[str]:
        if arch not in cache:
            root = tmp_path_factory.mktemp(f"lora-{arch}")
            cache[arch] = [build_lora_adapter(model_dirs(arch), root / f"a{i}", seed=10 + i,
                                              rank=rank, use_rslora=rs,
                                              modules=lora.modules_of(arch, modules), **config)
                           for i, (rank, rs, modules, config) in enumerate(lora.ADAPTERS)]
        return cache[arch]
    return get


@pytest.fixture(scope="session")
def peft_tokens(model_dirs, lora_adapters):
    """arch -> [base, adapter 0..3] -> greedy tokens of prompts_of_lengths(lora.LENGTHS)."""
    cache: dict[str, list[list[list[int]]]] = {}

    def get(arch: str) -> list[list[list[int]]]:
        if arch not in cache:
            prompts = prompts_of_lengths(lora.LENGTHS)
            cache[arch] = [peft_greedy(model_dirs(arch), a, prompts, lora.MAX_TOKENS)
                           for a in [None, *lora_adapters(arch)]]
        return cache[arch]
    return get
