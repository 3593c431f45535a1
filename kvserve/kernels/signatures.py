"""Each C entry point's signature, declared once, checked against the C source at load.

The table below names every argument and its kind (``ptr``: a pointer, ``i64``:
``int64_t``, ``f32``: ``float``). At load, :func:`check_against_sources` reads the
definitions in the C files and refuses a table whose names, kinds or order differ, so an
argument swapped on either side fails loudly instead of running on garbage. Python calls
go by keyword through :func:`bind`, so a call site cannot swap two arguments either.
Functions defined through ``KV_NAME(f)`` exist once per KV pool type (``f_f32``, ...).
"""
from __future__ import annotations

import ctypes
import re
from pathlib import Path

CTYPES = {"ptr": ctypes.c_void_p, "i64": ctypes.c_int64, "f32": ctypes.c_float}


def _parse(spec: str) -> tuple[tuple[str, str], ...]:
    return tuple(tuple(item.split(":")) for item in spec.split())  # type: ignore[misc]


# name: (return kind or None, "arg:kind ...")
SIGNATURES: dict[str, tuple[str | None, tuple[tuple[str, str], ...]]] = {
    name: (ret, _parse(args)) for name, (ret, args) in {
        "paged_attention_rows": (None, "q:ptr q_stride:i64 k_pool:ptr v_pool:ptr tables:ptr "
                                       "table_stride:i64 seq_lens:ptr out:ptr num_seqs:i64 "
                                       "num_heads:i64 num_kv_heads:i64 head_dim:i64 "
                                       "block_size:i64 scale:f32 window:i64"),
        "write_kv": (None, "k:ptr v:ptr k_stride:i64 v_stride:i64 slots:ptr n:i64 k_pool:ptr "
                           "v_pool:ptr num_kv_heads:i64 head_dim:i64 block_size:i64"),
        "rms_norm": (None, "x:ptr weight:ptr out:ptr rows:i64 dim:i64 eps:f32"),
        "rms_norm_bf16": (None, "x:ptr weight:ptr out:ptr rows:i64 dim:i64 eps:f32"),
        "add_rms_norm": (None, "x:ptr residual:ptr weight:ptr out:ptr rows:i64 dim:i64 "
                               "eps:f32"),
        "add_rms_norm_bf16": (None, "x:ptr residual:ptr weight:ptr out:ptr rows:i64 dim:i64 "
                                    "eps:f32"),
        "head_rms_norm": (None, "qkv:ptr row_stride:i64 rows:i64 q_weight:ptr k_weight:ptr "
                                "num_q:i64 num_k:i64 head_dim:i64 eps:f32"),
        "silu_mul": (None, "gate_up:ptr out:ptr rows:i64 inter:i64"),
        "gemv_rows": (None, "x:ptr m:i64 k:i64 w:ptr n:i64 bias:ptr y:ptr"),
        "gemm_panels": ("i64", "x:ptr m:i64 k:i64 panels:ptr n:i64 bias:ptr y:ptr"),
        "gemv_panels": (None, "x:ptr m:i64 k:i64 panels:ptr n:i64 bias:ptr y:ptr"),
        "rotary": (None, "qkv:ptr row_stride:i64 rows:i64 positions:ptr cos_table:ptr "
                         "sin_table:ptr num_q:i64 num_k:i64 head_dim:i64"),
        "rotary_bf16": (None, "qkv:ptr row_stride:i64 rows:i64 positions:ptr cos_table:ptr "
                              "sin_table:ptr num_q:i64 num_k:i64 head_dim:i64"),
        "quantize_rows_int8": (None, "x:ptr q:ptr scale:ptr rows:i64 cols:i64 divisor:f32"),
        "rescale_int32": (None, "acc:ptr row_scale:ptr col_scale:ptr bias:ptr out:ptr rows:i64 "
                                "cols:i64"),
        "int8_matmul": ("i64", "x:ptr m:i64 k:i64 w:ptr n:i64 acc:ptr"),
        "int8_pack_runs": ("i64", "w:ptr n:i64 k:i64 runs:ptr row_sums:ptr"),
        "int8_runs_matmul": ("i64", "x:ptr m:i64 k:i64 runs:ptr row_sums:ptr n:i64 acc:ptr"),
        "bf16_pack_runs": ("i64", "w:ptr n:i64 k:i64 runs:ptr"),
        "bf16_runs_matmul": ("i64", "x:ptr m:i64 k:i64 runs:ptr n:i64 bias:ptr y:ptr "
                                    "y_stride:i64"),
        "lora_rows": ("i64", "x:ptr rows:i64 in_dim:i64 slots:ptr num_slots:i64 a:ptr b:ptr "
                             "b_stride:i64 ranks:ptr max_rank:i64 bounds:ptr num_slices:i64 "
                             "shrunk:ptr out:ptr"),
        "gguf_rows": ("i64", "x:ptr m:i64 k:i64 w:ptr n:i64 fmt:i64 y:ptr y_stride:i64"),
        "gguf_rows_int8": ("i64", "x:ptr m:i64 k:i64 w:ptr n:i64 fmt:i64 y:ptr y_stride:i64"),
        "gguf_dequantize": ("i64", "w:ptr n:i64 k:i64 fmt:i64 out:ptr"),
        "gguf_dequantize_row": (None, "w:ptr row:i64 k:i64 fmt:i64 out:ptr"),
        "gguf_repack_runs": ("i64", "src:ptr n:i64 k:i64 fmt:i64 dst:ptr unpack:i64"),
        "int4_rows": ("i64", "x:ptr m:i64 k:i64 codes:ptr scales:ptr zeros:ptr group:i64 "
                             "n:i64 y:ptr y_stride:i64"),
        "int4_dequantize": ("i64", "codes:ptr scales:ptr zeros:ptr group:i64 n:i64 k:i64 "
                                   "out:ptr"),
        "bind_omp_threads": ("i64", "cpus:ptr n:i64"),
        "release_omp_threads": ("i64", "cpus:ptr ncpus:i64 n:i64"),
        "moe_route": ("i64", "x:ptr rows:i64 hidden:i64 w:ptr experts:i64 top_k:i64 norm:i64 "
                             "logits:ptr chosen:ptr weights:ptr"),
        "captured_step": ("i64", "plan:ptr tokens:ptr positions:ptr slots:ptr tables:ptr "
                                 "table_stride:i64 seq_lens:ptr rows:i64 eps:f32 scale:f32 "
                                 "logits:ptr timings:ptr"),
    }.items()}

_DEFINITION = re.compile(
    r"^(void|int64_t)\s+(?:KV_NAME\((\w+)\)|(\w+))\s*\(([^)]*)\)\s*\{", re.M)
_C_KINDS = {"int64_t": "i64", "float": "f32"}


def parse_definitions(text: str) -> dict[str, tuple[str | None, tuple[tuple[str, str], ...]]]:
    """Signatures of the non-static functions defined in C source ``text``."""
    found = {}
    for ret, kv_name, name, params in _DEFINITION.findall(text):
        args = []
        for param in params.split(","):
            words = param.replace("*", " * ").split()
            if not words:
                continue
            pointer = "*" in words
            ctype = [w for w in words if w not in ("const", "*")][0]
            kind = "ptr" if pointer else _C_KINDS.get(ctype, f"unsupported {ctype}")
            args.append((words[-1], kind))
        found[kv_name or name] = (None if ret == "void" else _C_KINDS[ret], tuple(args))
    return found


def check_against_sources(sources: tuple[Path, ...]) -> None:
    """Raise RuntimeError for every table entry whose C definition differs or is missing."""
    defined = {}
    for path in sources:
        defined.update(parse_definitions(path.read_text()))
    problems = []
    for name, (ret, args) in SIGNATURES.items():
        if name not in defined:
            problems.append(f"{name}: no definition in the C sources")
        elif defined[name] != (ret, args):
            c_ret, c_args = defined[name]
            problems.append(f"{name}: declared ({ret}) {_fmt(args)}, C has ({c_ret}) "
                            f"{_fmt(c_args)}")
    if problems:
        raise RuntimeError("kernel signatures differ from the C sources: " + "; ".join(problems))


def _fmt(args) -> str:
    return ", ".join(f"{n}:{k}" for n, k in args)


def bind(lib: ctypes.CDLL, name: str, symbol: str | None = None):
    """The C function ``symbol`` (default ``name``) with ``name``'s declared signature,
    wrapped in a Python function that takes the arguments by keyword only."""
    ret, args = SIGNATURES[name]
    fn = getattr(lib, symbol or name)
    fn.argtypes = [CTYPES[kind] for _, kind in args]
    fn.restype = CTYPES[ret] if ret else None
    names = [n for n, _ in args]
    # generated so that a call costs one plain Python call, not a kwargs walk
    source = (f"def {name}(*, {', '.join(names)}):\n"
              f"    return fn({', '.join(names)})\n")
    scope: dict = {"fn": fn}
    exec(source, scope)  # noqa: S102 - names come from the table above, not from input
    return scope[name]
