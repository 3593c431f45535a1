"""Field checks and value parsers shared by the config parts; each error names the
setting, what it got and what is allowed."""
from __future__ import annotations

import re

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6,
               "g": 10**9, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30,
               "tib": 2**40, "t": 10**12, "tb": 10**12}


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,6"`` -> [0, 1, 2, 3, 6] (the format of taskset and vLLM's
    VLLM_CPU_OMP_THREADS_BIND); a CPU named twice or a malformed item is an error."""
    cpus: list[int] = []
    for item in text.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
            raise ValueError(f"CPU list {text!r}: {item.strip()!r} is not a CPU number or a "
                             "range a-b (expected e.g. '0-3,6')")
        cpus.extend(range(int(lo), int(hi if sep else lo) + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"CPU list {text!r} names a CPU more than once")
    return cpus


def parse_size(value: int | float | str) -> int:
    """Bytes from an int or a string like ``"2GiB"`` / ``"512MB"`` / ``"1.5g"``."""
    if isinstance(value, bool):
        raise ValueError(f"a memory size must be bytes or a string like '2GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"a memory size must be positive, got {value}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _SIZE_UNITS:
        raise ValueError(
            f"cannot read memory size {value!r}: use bytes or a number with a unit "
            f"({', '.join(u for u in _SIZE_UNITS if u)}), e.g. '2GiB'")
    size = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise ValueError(f"a memory size must be positive, got {value!r}")
    return size


def positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def optional_positive_int(name: str, value: object) -> None:
    if value is not None:
        positive_int(name, value)


def non_negative_int(name: str, value: object, zero_means: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0 (0: {zero_means}), got {value!r}")


def number(name: str, value: object, low: float, high: float = float("inf"),
           low_open: bool = False) -> None:
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and (value > low if low_open else value >= low) and value <= high)
    if not ok:
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ValueError(f"{name} must be a number in {bounds}, got {value!r}")


def choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
