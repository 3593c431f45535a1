"""int8 linear layers: quantization arithmetic, native passes, and the engine's greedy
tokens against transformers with the same int8 arithmetic in its linear layers."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from kvserve import LLM, SamplingParams
from kvserve.kernels import load_kernels
from kvserve.model.execution import ExecutionMode
from kvserve.model.layers import Linear
from kvserve.model.linear_method import FloatLinearMethod
from kvserve.model.quantization import Int8LinearMethod, int8_reference_linear, \
    quantize_model, quantize_rows
from tests.helpers import hf_greedy, int8_reference_transform, prompts_of_lengths

LENGTHS = [1, 4, 17, 40, 100, 9]
MAX_NEW = 12


def test_quantize_rows_bounds_and_reconstruction():
    torch.manual_seed(0)
    x = torch.randn(9, 70) * torch.logspace(-3, 2, 9)[:, None]
    x[4] = 0.0
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert scale[4] == 1.0 and q[4].abs().sum() == 0
    # each row uses its full range, and rounding loses at most half a step
    assert (q.abs().amax(1)[torch.arange(9) != 4] == 127).all()
    assert ((q.float() * scale[:, None] - x).abs() <= scale[:, None] / 2 * (1 + 1e-6)).all()


def _native():
    kernels = load_kernels()
    if not kernels.available:
        pytest.skip(f"native kernels unavailable: {kernels.reason}")
    return kernels


@pytest.mark.parametrize("divisor", [127.0, 127.5])
def test_native_passes_match_torch(divisor):
    kernels = _native()
    torch.manual_seed(1)
    x = torch.randn(37, 300) * 3
    x[5] = 0.0
    x[6, 7] = 2.5 * (x[6].abs().max() / divisor)  # an exact .5 step: rounds half to even
    x[8, 3] = -x[8].abs().max() * 2  # -max: -127.5 steps with 127.5, rounded to -128
    q_ref, s_ref = quantize_rows(x, divisor)
    q, s = kernels.quantize_rows(x, divisor)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    assert (q.min() == -128) == (divisor == 127.5)
    acc = torch.randint(-10**6, 10**6, (37, 50), dtype=torch.int32)
    cols, bias = torch.rand(50), torch.randn(50)
    expected = acc.float() * s_ref[:, None] * cols[None, :]
    torch.testing.assert_close(kernels.rescale_int32(acc, s_ref, cols, None), expected,
                               rtol=1e-6, atol=0)
    torch.testing.assert_close(kernels.rescale_int32(acc, s_ref, cols, bias), expected + bias,
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_matches_reference_and_ignores_batch(native, bias):
    torch.manual_seed(2)
    dense = Linear(96, 136, bias=bias)
    layer = _int8(dense)
    layer.configure(ExecutionMode(kernels=_native() if native else None))
    x = torch.randn(23, 96)
    got = layer(x)
    torch.testing.assert_close(got, int8_reference_linear(x, dense.weight, dense.bias),
                               rtol=1e-5, atol=1e-5)
    # int32 sums are exact and scales are per token: a row's result never depends on
    # the other rows of the batch
    for r in (0, 11, 22):
        assert torch.equal(layer(x[r:r + 1].clone()), got[r:r + 1])
    # and it is a close approximation of the float layer
    rel = (got - dense(x)).norm() / dense(x).norm()
    assert rel < 0.02


def _int8(dense: Linear) -> Linear:
    layer = copy.deepcopy(dense)
    Int8LinearMethod.install(layer)
    return layer


def test_quantize_model_keeps_head_and_releases_float_weights():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = Linear(16, 32)
            self.block = nn.Sequential(Linear(32, 32, bias=False))
            self.lm_head = Linear(32, 50, bias=False)

    model = Tiny()
    assert quantize_model(model, "int8") == 2
    assert isinstance(model.proj.method, Int8LinearMethod)
    assert isinstance(model.block[0].method, Int8LinearMethod)
    assert isinstance(model.lm_head.method, FloatLinearMethod)
    assert model.proj.weight is None and model.proj.qweight.dtype == torch.int8
    assert not any(p.dtype == torch.float32 and p.shape == (32, 16) for p in model.parameters())
    with pytest.raises(ValueError, match="supported: int8"):
        quantize_model(model, "int4")


@pytest.fixture(scope="module")
def int8_oracle(model_dirs):
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = hf_greedy(model_dirs(arch), prompts_of_lengths(LENGTHS), MAX_NEW,
                                    transform=int8_reference_transform)
        return cache[arch]
    return get


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("engine_args", [{}, {"attention_backend": "torch"},
                                         {"max_num_batched_tokens": 16, "block_size": 4}],
                         ids=["native", "torch", "chunked"])
def test_int8_engine_matches_int8_transformers(arch, engine_args, model_dirs, int8_oracle):
    llm = LLM(model_dirs(arch), quantization="int8", **engine_args)
    methods = [m.method for m in llm.engine.worker.runner.model.modules()
               if isinstance(getattr(m, "method", None), Int8LinearMethod)]
    assert methods and all((m.native is None) == (engine_args.get("attention_backend") == "torch")
                           for m in methods)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts_of_lengths(LENGTHS)], params,
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == int8_oracle(arch)
    assert llm.engine.kv.stats().num_used_blocks == 0


def test_int8_reference_differs_from_float(model_dirs):
    """The oracle above is not the float model in disguise: int8 changes some tokens."""
    prompts = prompts_of_lengths(LENGTHS)
    d = model_dirs("llama")
    assert hf_greedy(d, prompts, MAX_NEW, transform=int8_reference_transform) != \
        hf_greedy(d, prompts, MAX_NEW)


def test_int8_matmul_probe(monkeypatch):
    from kvserve.model import quantization
    assert quantization.int8_matmul_is_exact()  # the int8 tests above rely on it here
    monkeypatch.setattr(quantization, "int8_matmul_is_exact", lambda: False)
    with pytest.raises(ValueError, match="needs an int8 matmul that sums exactly"):
        quantize_model(nn.Sequential(Linear(8, 8)), "int8")


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_int8_linear_takes_any_leading_shape(native):
    torch.manual_seed(3)
    layer = _int8(Linear(16, 24))
    layer.configure(ExecutionMode(kernels=_native() if native else None))
    x = torch.randn(2, 5, 16)
    got = layer(x)
    assert got.shape == (2, 5, 24)
    assert torch.equal(got.reshape(10, 24), layer(x.reshape(10, 16)))
    assert torch.equal(layer(x.transpose(0, 1).contiguous().transpose(0, 1)), got)


def test_quantization_setting_is_validated():
    from kvserve.engine.engine_args import EngineArgs
    with pytest.raises(ValueError, match=r"quantization must be one of \['int8'\]"):
        EngineArgs(quantization="fp4")


@pytest.mark.parametrize("vnni", [False, True])
def test_without_runs_the_int32_sums_come_from_torch_only_for_many_rows_with_vnni(
        vnni, monkeypatch):
    """Where the kernels keep no runs of rows: decode rows (up to NATIVE_INT8_ROWS) take
    the native kernel; more take torch._int_mm where the CPU has VNNI, never without it."""
    from kvserve.model import quantization
    monkeypatch.setattr(quantization, "cpu_has_vnni", lambda: vnni)
    kernels = _native()
    monkeypatch.setattr(kernels, "int8_pack_runs", lambda w: None)
    torch.manual_seed(3)
    dense = Linear(96, 40, bias=True)
    layer = _int8(dense)
    layer.configure(ExecutionMode(kernels=kernels))
    assert layer.method.sums is not None and not hasattr(layer, "qweight_runs")
    calls = []
    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(a.shape) or real(a, b))
    for rows in (5, quantization.NATIVE_INT8_ROWS + 1):
        calls.clear()
        x = torch.randn(rows, 96)
        got = layer(x)
        # without VNNI torch's int8 GEMM is never called
        assert bool(calls) == (vnni and rows > quantization.NATIVE_INT8_ROWS), rows
        torch.testing.assert_close(got, int8_reference_linear(x, dense.weight, dense.bias),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_runs_serve_every_row_count_and_give_the_weight_back(dtype, monkeypatch):
    """With runs of rows (an AVX-512 VNNI build) every row count is summed on them, the
    plain int8 weight is let go, and configuring without kernels brings it back."""
    kernels = _native()
    torch.manual_seed(4)
    dense = Linear(96, 44, bias=True).to(dtype)
    layer = _int8(dense)
    plain = layer.qweight.clone()
    layer.configure(ExecutionMode(kernels=kernels))
    if kernels.int8_pack_runs(plain) is None:
        assert not hasattr(layer, "qweight_runs") and torch.equal(layer.qweight, plain)
        pytest.skip("this CPU has no AVX-512 VNNI: no runs")
    assert layer.qweight.is_meta and layer.qweight_runs.shape == (48, 96)
    monkeypatch.setattr(torch, "_int_mm", None)  # never called
    for rows in (1, 7, 40):
        x = torch.randn(rows, 96).to(dtype)
        want = int8_reference_linear(x.float(), dense.weight.float(), dense.bias.float())
        torch.testing.assert_close(layer(x).float(), want.to(dtype).float(),
                                   rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
    layer.configure(ExecutionMode(kernels=None))
    assert torch.equal(layer.qweight, plain) and not hasattr(layer, "qweight_runs")
