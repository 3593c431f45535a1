"""The GGUF block kernels (gguf_linear.c) on their native, AVX2 and plain-C builds: the
few-row products against the float32 product of the torch dequantization, every format,
every row count the kernel takes, output columns written into a wider matrix; the tile
dequantization bit for bit; Q4_K, Q5_K and Q6_K rearranged in runs of four rows, Q8_0 in
runs of eight, BF16 in runs of sixteen, giving back the file's bytes and the same
products; what it refuses."""
from __future__ import annotations

import pytest
import torch

from kvserve.kernels import Kernels, load_kernels
from kvserve.kernels.build import cpu_has_any
from kvserve.model.gguf.linear import FORMAT_CODES, FROM_RUNS, RUN_ROWS
from kvserve.model.gguf.quants import BLOCKS, dequantize
from kvserve.model.gguf.quants import random_blocks
from tests.helpers import KERNEL_BUILD_FLAGS

kernels = load_kernels()
FILE_KINDS = [kind for kind in FORMAT_CODES if kind not in FROM_RUNS]  # GGUF's own
pytestmark = pytest.mark.skipif(not kernels.available, reason=f"no C compiler: {kernels.reason}")


def weight(kind: str, n: int, k: int, seed: int) -> torch.Tensor:
    values = BLOCKS[kind][0] if kind in BLOCKS else 32  # BF16 and F16: 32 a "block"
    return torch.from_numpy(random_blocks(kind, n * k // values, seed)).reshape(n, -1)


@pytest.mark.parametrize("kind", FILE_KINDS)
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
def test_few_rows_equal_dequantize_then_multiply(build, kind, rows):
    n, k = 37, 768  # an odd column count: the threads' shares are uneven
    blocks = weight(kind, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = (x.double() @ dequantize(blocks, kind, (n, k)).double().t())
    wide = torch.full((rows, n + 11), 7.0)
    build.gguf_rows(x, blocks, FORMAT_CODES[kind], wide[:, 5:5 + n])
    got = wide[:, 5:5 + n]
    scale = want.abs().max()
    assert ((got.double() - want).abs().max() / scale) < 2e-6
    assert (wide[:, :5] == 7.0).all() and (wide[:, 5 + n:] == 7.0).all()


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_tile_dequantization_is_the_torch_one_bit_for_bit(build, kind):
    blocks = weight(kind, 9, 512, seed=3)
    assert torch.equal(build.gguf_dequantize(blocks, FORMAT_CODES[kind], 512),
                       dequantize(blocks, kind, (9, 512)))


def test_refused_shapes_are_named():
    blocks = weight("Q8_0", 4, 64, seed=0)
    with pytest.raises(ValueError, match="1-8 rows, whole blocks"):
        kernels.gguf_rows(torch.randn(9, 64), blocks, FORMAT_CODES["Q8_0"], torch.empty(9, 4))
    with pytest.raises(ValueError, match="contiguous float32 x"):
        kernels.gguf_rows(torch.randn(2, 64).double(), blocks, 0, torch.empty(2, 4))
    with pytest.raises(ValueError, match="not whole blocks"):
        kernels.gguf_dequantize(blocks, FORMAT_CODES["Q8_0"], 48)


def rounded_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the Q8_0 kernel sees it: each 32 values rounded to int8 with one scale."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127)).reshape(x.shape)


def rounded_rows_q8_k(x: torch.Tensor) -> torch.Tensor:
    """x as the K-format kernels see it (llama.cpp's Q8_K): each 256 values rounded with
    the scale -127 / (the value of largest magnitude), capped at 127."""
    blocks = x.reshape(x.shape[0], -1, 256)
    top = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
    iscale = torch.tensor(-127.0) / top
    q = torch.round(blocks * iscale).clamp(max=127)
    return (q * (1 / iscale)).reshape(x.shape)


@pytest.mark.parametrize("kind, rounded", [("Q8_0", rounded_rows), ("Q4_K", rounded_rows_q8_k),
                                           ("Q5_K", rounded_rows_q8_k),
                                           ("Q6_K", rounded_rows_q8_k)])
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_int8_activations_sum_the_rounded_rows_exactly(kind, rounded, rows):
    n, k = 29, 1024
    blocks = weight(kind, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = rounded(x).double() @ dequantize(blocks, kind, (n, k)).double().t()
    got = torch.empty(rows, n)
    kernels.gguf_rows(x, blocks, FORMAT_CODES[kind], got, int8_activations=True)
    assert ((got.double() - want).abs().max() / want.abs().max()) < 2e-6


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_int8_activations_stay_near_the_float_product(kind):
    n, k = 40, 2048
    blocks = weight(kind, n, k, seed=5)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(5))
    exact = x.double() @ dequantize(blocks, kind, (n, k)).double().t()
    got = torch.empty(3, n)
    kernels.gguf_rows(x, blocks, FORMAT_CODES[kind], got, int8_activations=True)
    error = ((got.double() - exact).abs().max() / exact.abs().max())
    assert 1e-5 < error < 2e-2  # rounded (not the float path), and only by the rounding


@pytest.mark.parametrize("rows", [1, 3])
def test_int8_activations_q8_0_with_an_odd_block_count(rows):
    """The one-row kernel takes blocks two at a time: an odd count leaves one over."""
    n, k = 17, 33 * 32
    blocks = weight("Q8_0", n, k, seed=11)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(11))
    want = rounded_rows(x).double() @ dequantize(blocks, "Q8_0", (n, k)).double().t()
    got = torch.empty(rows, n)
    kernels.gguf_rows(x, blocks, FORMAT_CODES["Q8_0"], got, int8_activations=True)
    assert ((got.double() - want).abs().max() / want.abs().max()) < 2e-6


ROUNDED = {"Q8_0": rounded_rows, "Q4_K": rounded_rows_q8_k, "Q5_K": rounded_rows_q8_k,
           "Q6_K": rounded_rows_q8_k, "BF16": lambda x: x.to(torch.bfloat16).float()}
BF16_RUNS = cpu_has_any("avx512_bf16")  # the native build multiplies BF16_X16


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_K_X4", "Q5_K_X4",
                                  "Q6_K_X4", "Q8_0_X8"])
@pytest.mark.parametrize("rows", [9, 38, 131])  # 131: past ROW_BLOCK (128); 1, 2 and 3 rows over
def test_a_prompt_chunk_of_int8_rows_sums_each_row_as_alone(build, request, kind, rows):
    """Many rows (a prompt chunk): the rounded rows' products; in runs of rows, each row's
    sums bit for bit what it gets on its own (a decode step), whichever rows share its
    pass (the file's layouts have one-row kernels of their own, summing in another
    order)."""
    plain = FROM_RUNS.get(kind, kind)
    n, k = 24, 512
    blocks = weight(plain, n, k, seed=rows)
    data = blocks if plain == kind else kernels.gguf_repack_runs(blocks, plain, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = ROUNDED[plain](x).double() @ dequantize(blocks, plain, (n, k)).double().t()
    wide = torch.full((rows, n + 6), 7.0)
    if request.node.callspec.params["build"] == "plain-c":  # no integer kernels: the caller's
        assert not build.gguf_rows_int8(x, data, FORMAT_CODES[kind], wide[:, 3:3 + n])
        return
    assert build.gguf_rows_int8(x, data, FORMAT_CODES[kind], wide[:, 3:3 + n])
    got = wide[:, 3:3 + n]
    assert ((got.double() - want).abs().max() / want.abs().max()) < 2e-6
    assert (wide[:, :3] == 7.0).all() and (wide[:, 3 + n:] == 7.0).all()
    for r in (0, rows // 2, rows - 1) if kind != plain else ():
        alone = torch.empty(1, n)
        build.gguf_rows(x[r:r + 1], data, FORMAT_CODES[kind], alone, int8_activations=True)
        assert torch.equal(alone[0], got[r])


@pytest.mark.parametrize("rows", [1, 3, 8, 37])
def test_bf16_weights_take_rows_rounded_to_bfloat16(build, rows):
    """Against BF16 weights the activations are rounded to bfloat16 (to nearest even), as
    llama.cpp multiplies a BF16 tensor, on every build (AVX512-BF16's vdpbf16ps where the
    build has it): the rounded rows' products, exact in float32, summed in float32."""
    n, k = 37, 1056  # an odd count of 32-value blocks: the kernels' remainders
    blocks = weight("BF16", n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    rounded = x.to(torch.bfloat16).float()
    assert not torch.equal(rounded, x)
    want = rounded.double() @ dequantize(blocks, "BF16", (n, k)).double().t()
    wide = torch.full((rows, n + 6), 7.0)
    assert build.gguf_rows_int8(x, blocks, FORMAT_CODES["BF16"], wide[:, 3:3 + n])
    got = wide[:, 3:3 + n]
    assert ((got.double() - want).abs().max() / want.abs().max()) < 2e-6
    assert (wide[:, :3] == 7.0).all() and (wide[:, 3 + n:] == 7.0).all()
    if rows <= 8:  # a decode step's rows: the same through gguf_rows
        again = torch.empty(rows, n)
        build.gguf_rows(x, blocks, FORMAT_CODES["BF16"], again, int8_activations=True)
        assert torch.equal(again, got)
        floats = torch.empty(rows, n)
        build.gguf_rows(x, blocks, FORMAT_CODES["BF16"], floats)
        assert not torch.equal(floats, got)  # float activations: the rows as they are


@pytest.mark.parametrize("kind", ["BF16", "BF16_X16"])
def test_bf16_prompt_rows_are_the_bits_each_row_gets_alone(kind):
    """With AVX512-BF16 every row and weight row is summed in one order, so a prompt
    chunk's rows are bit for bit what each gets as a decode step (elsewhere the widening
    kernels sum a few rows in other orders than one); in the file's layout and in runs of
    sixteen rows alike."""
    if not BF16_RUNS:
        pytest.skip("this CPU has no AVX512-BF16")
    n, k = 21 if kind == "BF16" else 48, 2080
    blocks = weight("BF16", n, k, seed=4)
    if kind == "BF16_X16":
        blocks = kernels.gguf_repack_runs(blocks, "BF16", k)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(4))
    chunk = torch.empty(70, n)
    assert kernels.gguf_rows_int8(x, blocks, FORMAT_CODES[kind], chunk)
    for r in (0, 1, 33, 64, 69):
        alone = torch.empty(1, n)
        kernels.gguf_rows(x[r:r + 1], blocks, FORMAT_CODES[kind], alone, int8_activations=True)
        assert torch.equal(alone[0], chunk[r]), r
    few = torch.empty(5, n)
    kernels.gguf_rows(x[:5], blocks, FORMAT_CODES[kind], few, int8_activations=True)
    assert torch.equal(few, chunk[:5])


def test_a_format_without_an_integer_kernel_is_left_to_the_caller():
    blocks = weight("Q4_0", 8, 256, seed=2)
    assert not kernels.gguf_rows_int8(torch.randn(12, 256), blocks, FORMAT_CODES["Q4_0"],
                                      torch.empty(12, 8))


# file format: its runs, and the runs' bytes a block of a row
RUNS = {"Q4_K": ("Q4_K_X4", 148), "Q5_K": ("Q5_K_X4", 180), "Q6_K": ("Q6_K_X4", 210),
        "Q8_0": ("Q8_0_X8", 34), "BF16": ("BF16_X16", 64)}


def native_runs(kind: str, blocks: torch.Tensor, k: int) -> torch.Tensor:
    """The native build's runs of ``blocks`` (skips BF16's where the CPU lacks
    AVX512-BF16; the other runs need AVX2, which this machine's build has)."""
    if kind == "BF16" and not BF16_RUNS:
        assert kernels.gguf_repack_runs(blocks, kind, k) is None  # the file's stays
        pytest.skip("this CPU has no AVX512-BF16 for BF16 runs")
    packed = kernels.gguf_repack_runs(blocks, kind, k)
    assert packed is not None
    return packed


@pytest.mark.parametrize("kind", list(RUNS))
def test_runs_of_rows_give_back_the_files_bytes_and_the_same_products(build, request, kind):
    n, k = 16, 1536
    runs, width = RUNS[kind]
    blocks = weight(kind, n, k, seed=7)
    packed = native_runs(kind, blocks, k)
    values = BLOCKS[kind][0] if kind in BLOCKS else 32
    assert packed.shape == (n, k // values * width)
    made = build.gguf_repack_runs(blocks, kind, k)
    if request.node.callspec.params["build"] == "plain-c" or (
            kind == "BF16" and request.node.callspec.params["build"] == "avx2"):
        assert made is None  # no kernel for the layout: the file's stays
    else:
        assert torch.equal(made, packed)
    assert torch.equal(build.gguf_repack_runs(packed, kind, k, unpack=True), blocks)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(7))
    want = x.double() @ dequantize(blocks, kind, (n, k)).double().t()
    got = torch.empty(3, n)
    build.gguf_rows(x, packed, FORMAT_CODES[runs], got)
    assert ((got.double() - want).abs().max() / want.abs().max()) < 2e-6
    for row in (0, 5, n - 1):  # a token embedding's lookup, through its run unpacked
        assert torch.equal(build.gguf_dequantize_row(packed, row, k, FORMAT_CODES[runs]),
                           dequantize(blocks[row:row + 1], kind, (1, k))[0])


@pytest.mark.parametrize("kind", list(RUNS))
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("int8_activations", [True, False])
def test_runs_of_rows_products_equal_the_files(kind, rows, int8_activations):
    runs = RUNS[kind][0]
    # seven runs: the threads' shares are uneven; Q8_0: an odd block count
    n, k = 7 * RUN_ROWS[runs], 1024 if kind != "Q8_0" else 33 * 32
    blocks = weight(kind, n, k, seed=rows)
    packed = native_runs(kind, blocks, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    rounded = ROUNDED[kind](x) if int8_activations else x
    want = rounded.double() @ dequantize(blocks, kind, (n, k)).double().t()
    wide = torch.full((rows, n + 6), 7.0)
    kernels.gguf_rows(x, packed, FORMAT_CODES[runs], wide[:, 3:3 + n], int8_activations)
    got = wide[:, 3:3 + n]
    assert ((got.double() - want).abs().max() / want.abs().max()) < 2e-6
    assert (wide[:, :3] == 7.0).all() and (wide[:, 3 + n:] == 7.0).all()
    assert torch.equal(kernels.gguf_dequantize(packed, FORMAT_CODES[runs], k),
                       dequantize(blocks, kind, (n, k)))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_K_X4", "Q5_K_X4",
                                  "Q6_K_X4", "Q8_0_X8"])
def test_integer_sums_are_the_same_bits_on_each_vector_build(kind):
    """Where the CPU has AVX-512 VNNI, the native build sums with vpdpbusd/vpdpwssd and
    the AVX2 build with vpmaddubsw/vpmaddwd: the same integers, so the same outputs, bit
    for bit, for a decode step's rows and a prompt chunk's (on an AVX2-only CPU both
    builds run the AVX2 code)."""
    avx2 = Kernels(KERNEL_BUILD_FLAGS["avx2"])
    assert avx2.available, avx2.reason
    plain = FROM_RUNS.get(kind, kind)
    n, k = 8 * 5, 2048
    blocks = weight(plain, n, k, seed=3)
    data = blocks if plain == kind else kernels.gguf_repack_runs(blocks, plain, k)
    for rows in (1, 2, 3, 4, 8, 37):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
        native, vector = torch.empty(rows, n), torch.empty(rows, n)
        assert kernels.gguf_rows_int8(x, data, FORMAT_CODES[kind], native)
        assert avx2.gguf_rows_int8(x, data, FORMAT_CODES[kind], vector)
        assert torch.equal(native, vector), (kind, rows)


def test_runs_of_rows_refuse_what_they_cannot_hold():
    with pytest.raises(ValueError, match="whole runs of 4 rows of whole Q4_K blocks"):
        kernels.gguf_repack_runs(weight("Q4_K", 6, 256, seed=1), "Q4_K", 256)
    with pytest.raises(ValueError, match="whole runs of 8 rows of whole Q8_0 blocks"):
        kernels.gguf_repack_runs(weight("Q8_0", 12, 256, seed=1), "Q8_0", 256)
    with pytest.raises(ValueError, match="K at most 16384"):
        kernels.gguf_repack_runs(weight("Q5_K", 4, 16640, seed=1), "Q5_K", 16640)
    with pytest.raises(ValueError, match="rows of 144 bytes"):
        kernels.gguf_repack_runs(weight("Q8_0", 4, 256, seed=1), "Q4_K", 256)
    with pytest.raises(ValueError, match="whole runs of 16 rows of whole BF16 blocks"):
        kernels.gguf_repack_runs(weight("BF16", 24, 256, seed=1), "BF16", 256)
    with pytest.raises(ValueError, match="Q4_K, Q5_K, Q6_K, Q8_0, BF16 rows, not Q4_0"):
        kernels.gguf_repack_runs(weight("Q4_0", 4, 256, seed=1), "Q4_0", 256)
