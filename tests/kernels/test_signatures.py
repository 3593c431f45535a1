"""The kernels' declared signatures match the C sources; a swap on either side is refused."""
from __future__ import annotations

import pytest

from kvserve.kernels import load_kernels
from kvserve.kernels.build import HEADERS, SOURCES
from kvserve.kernels.signatures import check_against_sources, parse_definitions


def test_every_declared_function_matches_its_definition():
    check_against_sources(SOURCES + HEADERS)  # raises on any difference


def test_a_swapped_argument_in_the_source_is_refused(tmp_path):
    source = next(p for p in SOURCES if p.name == "elementwise.c").read_text()
    swapped = source.replace("void silu_mul(const float *gate_up, float *out, int64_t rows, "
                             "int64_t inter)",
                             "void silu_mul(const float *gate_up, float *out, int64_t inter, "
                             "int64_t rows)")
    assert swapped != source
    bad = tmp_path / "elementwise.c"
    bad.write_text(swapped)
    others = tuple(p for p in SOURCES + HEADERS if p.name != "elementwise.c")
    with pytest.raises(RuntimeError, match=r"silu_mul: declared \(None\) gate_up:ptr, "
                                           r"out:ptr, rows:i64, inter:i64, C has"):
        check_against_sources(others + (bad,))


def test_a_type_change_and_a_missing_function_are_refused(tmp_path):
    path = tmp_path / "k.c"
    path.write_text("void rms_norm(const float *x, const float *weight, float *out, "
                    "int64_t rows, float dim, float eps) {}\n")
    with pytest.raises(RuntimeError) as err:
        check_against_sources((path,))
    assert "rms_norm: declared" in str(err.value) and "dim:f32" in str(err.value)
    assert "silu_mul: no definition in the C sources" in str(err.value)


def test_parser_reads_kv_name_definitions_and_skips_static_helpers():
    text = ("static void helper(int64_t a) {}\n"
            "void KV_NAME(write_kv)(const KV_T *k, int64_t n) {\n}\n"
            "int64_t bind_omp_threads(const int64_t *cpus, int64_t n) {\n")
    assert parse_definitions(text) == {"write_kv": (None, (("k", "ptr"), ("n", "i64"))),
                                       "bind_omp_threads": ("i64", (("cpus", "ptr"),
                                                                    ("n", "i64")))}


def test_bound_functions_take_keywords_only():
    kernels = load_kernels()
    if not kernels.available:
        pytest.skip(f"no C compiler: {kernels.reason}")
    silu_mul = kernels._silu_mul
    with pytest.raises(TypeError):
        silu_mul(0, 0, 1, 1)  # positional: refused
    with pytest.raises(TypeError):
        silu_mul(gate_up=0, out=0, rows=1)  # one missing: refused before reaching C
