"""The native few-row linear kernel (gemv.c): torch's answer on both vector paths, and
the engine's greedy tokens unchanged when every layer takes the few-row GEMV, over
the dense weights and over the panels (gemm.c)."""
from __future__ import annotations

import pytest
import torch

from kvserve.kernels import Kernels, load_kernels

kernels = load_kernels()
pytestmark = pytest.mark.skipif(not kernels.available, reason=f"no C compiler: {kernels.reason}")


@pytest.fixture(scope="module", params=["native", "avx2"])
def build(request):
    if request.param == "native":
        return kernels
    built = Kernels(("-mno-avx512f",))
    assert built.available, built.reason
    return built


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12])  # 9, 12: two groups of rows
@pytest.mark.parametrize("n, k", [(1, 7), (5, 64), (17, 100), (64, 768), (9, 33)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_torch(build, m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    torch.testing.assert_close(build.gemv_rows(x, w, b), torch.nn.functional.linear(x, w, b),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("layout", ["panels", "dense"])
def test_every_layer_on_the_kernel_keeps_transformers_tokens(llama_dir, layout):
    from kvserve import LLM, SamplingParams
    from kvserve.worker.tuning.row_padding import packed_linears
    from kvserve.worker.tuning.panel_gemm import pack_panel_weights
    from kvserve.worker.tuning.small_gemm import _use
    from tests.helpers import hf_greedy, prompts_of_lengths

    llm = LLM(llama_dir, num_threads=1, enforce_eager=True)  # every step layer by layer
    model = llm.engine.worker.runner.model
    pack_panel_weights(model, kernels, huge_pages=False)  # where start-up let them go
    layers = packed_linears(model)
    assert layers and all(m.method.panel_weight is not None for m in layers)
    for m in layers:
        _use(m, "native", 4, kernels)
        if layout == "dense":  # no panels: no panel GEMM either
            m.method.restore_dense_weight(m)  # start-up let it go
            m.method.panel_weight, m.method.panel_max_rows = None, 0
    prompts = prompts_of_lengths([1, 7, 17, 40])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(llama_dir, prompts, 12)
