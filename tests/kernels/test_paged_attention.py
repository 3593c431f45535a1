"""The native decode kernel agrees with the torch path (gather + SDPA)."""
from __future__ import annotations

import pytest
import torch

from kvserve.core.scheduler_output import ScheduledRequest
from kvserve.kernels import load_kernels
from kvserve.model.attention import KVCache, paged_attention
from kvserve.worker.input_batch import build_inputs

kernels = load_kernels()
pytestmark = pytest.mark.skipif(not kernels.available, reason=f"no C compiler: {kernels.reason}")


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("heads, kv_heads, dim, window", [
    (4, 2, 16, None), (12, 4, 64, None), (4, 4, 32, 5), (6, 1, 24, None),
    (8, 2, 128, None), (6, 3, 64, 11)])  # 64 and 128: the AVX2 path
def test_kernel_matches_torch(heads, kv_heads, dim, window, kv_dtype):
    """Decodes, a fresh prompt and chunks after cached keys, in one flat batch, with a
    float32 pool or a half-precision one (float32 math on the stored values)."""
    torch.manual_seed(0)
    bs, num_blocks = 4, 96
    cache = KVCache(num_blocks, bs, kv_heads, dim, kv_dtype)
    cache.k.normal_()
    cache.v.normal_()
    perm = torch.randperm(num_blocks).tolist()
    # (tokens already cached, tokens computed this step); decodes first, as the scheduler
    steps = [(1, 1), (3, 1), (4, 1), (5, 1), (17, 1), (30, 1), (47, 1),
             (0, 13), (8, 9), (21, 6)]
    scheduled, used = [], 0
    for i, (start, q_len) in enumerate(steps):
        blocks = perm[used:used + (start + q_len - 1) // bs + 1]
        used += len(blocks)
        scheduled.append(ScheduledRequest(f"r{i}", [7] * q_len, start, blocks, None))
    t = sum(q for _, q in steps)
    q = torch.randn(t, heads, dim)
    k = torch.randn(t, kv_heads, dim)
    v = torch.randn(t, kv_heads, dim)
    outs = []
    for native in (None, kernels):
        c = KVCache(num_blocks, bs, kv_heads, dim, kv_dtype)
        c.k.copy_(cache.k)
        c.v.copy_(cache.v)
        meta = build_inputs(scheduled, bs, window, native).meta
        assert (meta.native is None) == (native is None)
        outs.append(paged_attention(q, k, v, c, meta, dim ** -0.5))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_engine_uses_kernel_and_torch_backend_agrees(llama_dir):
    from kvserve import LLM, SamplingParams
    from tests.helpers import prompts_of_lengths
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in prompts_of_lengths([5, 40, 90])]
    native = LLM(llama_dir)
    torch_path = LLM(llama_dir, attention_backend="torch")
    assert native.engine.runner.native is not None and torch_path.engine.runner.native is None
    a = [o.outputs[0].token_ids for o in native.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in torch_path.generate(prompts, params, use_tqdm=False)]
    assert a == b
