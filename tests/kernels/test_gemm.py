"""The native kernels over panels (gemm.c): torch's answer from the panel GEMM on its
native, AVX2 and plain-C builds (the AVX-512 GEMM and GEMV bitwise their AVX2 builds), at
row counts that fill and leave partial tiles and row groups, at column counts that fill
and leave AVX-512's four-panel tiles, and at a k that takes two slices; the same from the few-row GEMV over
panels at 1-8 rows and odd k; the engine's greedy tokens unchanged when every layer
takes the panel GEMM."""
from __future__ import annotations

import pytest
import torch

from kvserve.kernels import Kernels, load_kernels
from tests.helpers import KERNEL_BUILD_FLAGS as BUILD_FLAGS

kernels = load_kernels()
pytestmark = pytest.mark.skipif(not kernels.available, reason=f"no C compiler: {kernels.reason}")




# 6: one whole tile; 7, 13: a partial one; 97, 200: more than one group of 96 rows
@pytest.mark.parametrize("m", [1, 5, 6, 7, 13, 97, 200])
# 64, 128: whole tiles of four panels (AVX-512); 80, 144: and a panel left over;
# 1100: two k slices
@pytest.mark.parametrize("n, k", [(16, 7), (48, 100), (64, 768), (32, 1100), (80, 1100),
                                  (144, 300)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_panels_matches_torch(build, m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = build.gemm_panels(x, build.pack_panels(w), b)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)


# 1-3: two sets of sums; 4-6: one; 7, 8: a second tile of rows over each panel
@pytest.mark.parametrize("m", range(1, 9))
@pytest.mark.parametrize("n, k", [(16, 7), (48, 100), (64, 768), (32, 2048)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_panels_matches_torch(build, m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k + 1)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = build.gemv_panels(x, build.pack_panels(w), b)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif("avx512f" not in open("/proc/cpuinfo").read(),
                    reason="the CPU has no AVX-512: the native build is the AVX2 one")
@pytest.mark.parametrize("m", range(1, 9))
def test_gemv_panels_on_avx512_is_bitwise_the_avx2_build(m):
    avx2 = Kernels(BUILD_FLAGS["avx2"])
    g = torch.Generator().manual_seed(m)
    x, w, b = torch.randn(m, 333, generator=g), torch.randn(64, 333, generator=g), \
        torch.randn(64, generator=g)
    panels = kernels.pack_panels(w)
    assert torch.equal(kernels.gemv_panels(x, panels, b), avx2.gemv_panels(x, panels, b))


@pytest.mark.skipif("avx512f" not in open("/proc/cpuinfo").read(),
                    reason="the CPU has no AVX-512: the native build is the AVX2 one")
@pytest.mark.parametrize("m", [1, 6, 7, 100])
@pytest.mark.parametrize("n, k", [(64, 768), (80, 1100), (144, 300)])
def test_gemm_panels_on_avx512_is_bitwise_the_avx2_build(m, n, k):
    avx2 = Kernels(BUILD_FLAGS["avx2"])
    g = torch.Generator().manual_seed(m + n + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), \
        torch.randn(n, generator=g)
    panels = kernels.pack_panels(w)
    for bias in (None, b):
        assert torch.equal(kernels.gemm_panels(x, panels, bias), avx2.gemm_panels(x, panels, bias))


def test_gemv_panels_refuses_a_mismatched_input():
    panels = kernels.pack_panels(torch.zeros(16, 8))
    with pytest.raises(ValueError, match=r"x \[M, 8\]"):
        kernels.gemv_panels(torch.zeros(1, 9), panels)


def test_gemm_panels_reads_non_contiguous_rows():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(20, 64, generator=g)[:, :32], torch.randn(32, 32, generator=g)
    torch.testing.assert_close(kernels.gemm_panels(x, kernels.pack_panels(w)), x @ w.T,
                               rtol=1e-5, atol=1e-4)


def test_pack_panels_lays_out_sixteen_columns_a_panel():
    w = torch.arange(32 * 3, dtype=torch.float32).reshape(32, 3)
    panels = kernels.pack_panels(w)
    assert panels.shape == (2, 3, 16)
    assert panels[1, 2, 5] == w[16 + 5, 2]
    out = torch.empty(2, 3, 16)
    assert kernels.pack_panels(w, out) is out and torch.equal(out, panels)


@pytest.mark.parametrize("weight, match", [
    (torch.zeros(20, 8), "multiple of 16"),
    (torch.zeros(16, 8, dtype=torch.float64), "float32"),
    (torch.zeros(16, 8, device="meta"), "CPU"),  # a dense weight let go
])
def test_pack_panels_refuses_what_it_cannot_lay_out(weight, match):
    with pytest.raises(ValueError, match=match):
        kernels.pack_panels(weight)


def test_gemm_panels_refuses_a_mismatched_input():
    panels = kernels.pack_panels(torch.zeros(16, 8))
    with pytest.raises(ValueError, match=r"x \[M, 8\]"):
        kernels.gemm_panels(torch.zeros(4, 9), panels)


def test_every_layer_on_the_panel_gemm_keeps_transformers_tokens(llama_dir):
    from kvserve import LLM, SamplingParams
    from kvserve.worker.tuning.panel_gemm import panel_linears
    from tests.helpers import hf_greedy, prompts_of_lengths

    llm = LLM(llama_dir, num_threads=1)
    layers = panel_linears(llm.engine.worker.runner.model)
    assert layers
    for m in layers:  # the panels packed at load
        m.method.panel_gemm = kernels.gemm_panels
        m.method.panel_min_rows, m.method.panel_max_rows = 1, 4096  # every GEMM the steps run
    calls = []
    gemm = kernels.gemm_panels
    for m in layers:
        m.method.panel_gemm = lambda *a, **kw: calls.append(1) or gemm(*a, **kw)
    prompts = prompts_of_lengths([1, 7, 17, 40])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(llama_dir, prompts, 12)
    assert calls
