"""The native decode kernel agrees with the torch path (gather + SDPA)."""
from __future__ import annotations

import pytest
import torch

from kvserve.core.scheduler_output import ScheduledRequest
from kvserve.kernels import Kernels, load_kernels
from kvserve.model.attention import KVCache, paged_attention
from kvserve.worker.input_batch import build_inputs

kernels = load_kernels()
pytestmark = pytest.mark.skipif(not kernels.available, reason=f"no C compiler: {kernels.reason}")


@pytest.fixture(scope="module", params=["native", "avx2"])
def build(request):
    """The kernels as built for this machine, and built without AVX-512: on a machine
    with it, the AVX2 paths (what an AVX2-only machine runs) are checked too."""
    if request.param == "native":
        return kernels
    built = Kernels(("-mno-avx512f",))
    assert built.available, built.reason
    return built


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("heads, kv_heads, dim, window, bs", [
    (4, 2, 16, None, 4), (12, 4, 64, None, 4), (4, 4, 32, 5, 4), (6, 1, 24, None, 4),
    # the AVX2 path: head_dim 64 or 128 and blocks of 16 (tiles of 16 keys) or 8 (of 8);
    # 1-4 query heads per kv head share key loads, a group of 5 takes tiles of 4 and 1
    (12, 4, 64, None, 16), (8, 2, 128, None, 16), (6, 3, 64, 11, 16), (8, 8, 64, None, 16),
    (10, 2, 64, 21, 8), (16, 2, 128, None, 8),
    # blocks of two 16-key chunks: AVX-512 scores chunks of several blocks at once
    (12, 4, 64, 37, 32), (12, 4, 64, None, 32),
    # head_dim 32 (a draft model's): the vectorised one-row path, prompt rows one by one
    (4, 2, 32, None, 16), (8, 2, 32, 11, 8)])
def test_kernel_matches_torch(heads, kv_heads, dim, window, bs, kv_dtype, build):
    """Decodes, a fresh prompt and chunks after cached keys, in one flat batch, with a
    float32 pool or a half-precision one (float32 math on the stored values); the table
    mixes blocks in order with jumps."""
    torch.manual_seed(0)
    num_blocks = 96
    cache = KVCache(num_blocks, bs, kv_heads, dim, kv_dtype)
    cache.k.normal_()
    cache.v.normal_()
    perm = list(range(48)) + torch.randperm(48).add(48).tolist()
    # (tokens already cached, tokens computed this step); decodes first, as the scheduler
    steps = [(1, 1), (3, 1), (4, 1), (5, 1), (17, 1), (30, 1), (47, 1),
             (0, 13), (8, 9), (21, 6)]
    if bs > 4:  # the same shapes in tokens, so that the contexts span several blocks
        steps = [(s * 4, 1) if q == 1 else (s * 4, q * 4) for s, q in steps]
    scheduled, used = [], 0
    for i, (start, q_len) in enumerate(steps):
        blocks = perm[used:used + (start + q_len - 1) // bs + 1]
        used += len(blocks)
        assert len(blocks) == (start + q_len - 1) // bs + 1
        scheduled.append(ScheduledRequest(f"r{i}", [7] * q_len, start, blocks, None))
    t = sum(q for _, q in steps)
    q = torch.randn(t, heads, dim)
    k = torch.randn(t, kv_heads, dim)
    v = torch.randn(t, kv_heads, dim)
    outs = []
    for native in (None, build):
        c = KVCache(num_blocks, bs, kv_heads, dim, kv_dtype)
        c.k.copy_(cache.k)
        c.v.copy_(cache.v)
        meta = build_inputs(scheduled, bs, window, native).meta
        assert (meta.native is None) == (native is None)
        outs.append(paged_attention(q, k, v, c, meta, dim ** -0.5))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def _attend(build, q, cache, tables, lens, window):
    out = torch.empty(q.shape)
    build.paged_attention_rows(q, cache.k, cache.v, tables, lens, out, 0.125, window)
    return out


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("heads, kv_heads, dim, window, bs", [
    (12, 4, 64, 0, 16), (8, 8, 64, 0, 16), (8, 4, 128, 0, 8), (12, 3, 64, 0, 16),
    (10, 2, 64, 0, 16), (16, 2, 64, 0, 16), (12, 4, 64, 40, 16), (4, 4, 32, 0, 4),
    (4, 2, 32, 0, 16)])
def test_prompt_rows_together_give_each_row_alone_bits(heads, kv_heads, dim, window, bs,
                                                       kv_dtype, build):
    """The rows of a prompt chunk are attended several at a time (sharing each key and
    value load); every row must come out bit for bit as when it is the only row, and as
    when the queries are read in place from fused qkv rows. The
    batch also holds a row that shares its first blocks and its length + 1 with the
    chunk before it but not its last block (prefix caching): it must not join."""
    torch.manual_seed(0)
    cache = KVCache(64, bs, kv_heads, dim, kv_dtype)
    cache.k.normal_()
    cache.v.normal_()
    perm = torch.randperm(64)
    table_a = perm[:80 // bs + 1]
    table_b = table_a.clone()
    table_b[67 // bs] = perm[-1]  # the same first blocks, another block for token 67 on
    rows = [(table_a, n) for n in range(3, 68)] + [(table_b, 68), (table_b, 69)]
    rows += [(table_a, 9), (table_a, 17)]  # decodes after the chunks
    tables = torch.stack([t for t, _ in rows])
    lens = torch.tensor([n for _, n in rows])
    q = torch.randn(len(rows), heads, dim)
    together = _attend(build, q, cache, tables, lens, window)
    alone = torch.cat([_attend(build, q[i:i + 1], cache, tables[i:i + 1], lens[i:i + 1],
                               window) for i in range(len(rows))])
    assert torch.equal(together, alone)
    # queries read in place from fused qkv rows (strided): the same bits
    qkv = torch.cat([q.flatten(1), torch.randn(len(rows), 2 * kv_heads * dim)], dim=1)
    in_place = _attend(build, qkv[:, :heads * dim].view(len(rows), heads, dim), cache, tables,
                       lens, window)
    assert torch.equal(in_place, together)
    # and the last rows read table_b's last block, not table_a's
    wrong = _attend(build, q[-4:-2], cache, table_a.repeat(2, 1), lens[-4:-2], window)
    assert not torch.equal(wrong, together[-4:-2])


@pytest.mark.parametrize("rows", [8, 20, 300])  # the writer splits 16 rows and more
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["f32", "f16", "bf16"])
def test_native_write_matches_torch_write(kv_dtype, rows):
    """Rows of a fused qkv (strided) land in the same slots, keys transposed, either way
    (also when the threads' rows share blocks)."""
    torch.manual_seed(0)
    caches = [KVCache(32, 16, 2, 64, kv_dtype) for _ in range(2)]
    qkv = torch.randn(rows, 3 * 128)
    k, v = (qkv[:, i * 128:(i + 1) * 128].view(rows, 2, 64) for i in (1, 2))
    slots = torch.randperm(32 * 16)[:rows]
    caches[0].write(slots, k, v)
    caches[1].write(slots, k, v, kernels)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    read_k, read_v = caches[1].read(slots)
    assert torch.equal(read_k, k.to(kv_dtype)) and torch.equal(read_v, v.to(kv_dtype))
    block, offset = int(slots[0]) // 16, int(slots[0]) % 16
    assert torch.equal(caches[1].k[block, 1, :, offset], k[0, 1].to(kv_dtype))


def test_engine_uses_kernel_and_torch_backend_agrees(llama_dir):
    from kvserve import LLM, SamplingParams
    from tests.helpers import prompts_of_lengths
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in prompts_of_lengths([5, 40, 90])]
    native = LLM(llama_dir)
    torch_path = LLM(llama_dir, attention_backend="torch")
    assert native.engine.worker.kernels is not None and torch_path.engine.worker.kernels is None
    assert native.engine.worker.runner.native_attention is not None
    assert torch_path.engine.worker.runner.native_attention is None
    a = [o.outputs[0].token_ids for o in native.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in torch_path.generate(prompts, params, use_tqdm=False)]
    assert a == b
