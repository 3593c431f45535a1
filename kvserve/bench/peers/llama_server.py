"""llama.cpp's own OpenAI server (``llama-server``) as a bench peer: the same GGUF file
kvserve serves, on loopback, with a KV cache of the same bytes.

llama.cpp keeps K and V in float16, so a budget of ``kv_cache_gib`` holds
``kv_cache_gib`` GiB / (2 bytes x 2 x layers x KV heads x head size) tokens, split
evenly among ``slots`` parallel sequences (its continuous batching runs them in one
batch). Its threads are given the process's CPUs.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from kvserve.bench.peers.llamacpp import cmake_build_flags, tool_version
from kvserve.bench.peers.server_process import SERVED_NAME, PeerProcess, free_port, \
    wait_healthy

F16_BYTES = 2


def kv_tokens(model_dir: Path, kv_cache_gib: float) -> int:
    """Tokens of float16 K and V that ``kv_cache_gib`` holds for the model whose
    ``config.json`` is in ``model_dir`` (a prepared GGUF directory)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    per_token = (2 * F16_BYTES * cfg["num_hidden_layers"]
                 * cfg.get("num_key_value_heads", heads) * head_dim)
    return int(kv_cache_gib * 2**30 // per_token)


class LlamaServer(PeerProcess):
    """``binary`` (llama-server) serving ``gguf``, healthy once constructed."""

    def __init__(self, binary: str, gguf: Path, model_dir: Path, log_path: Path,
                 kv_cache_gib: float, slots: int = 8, start_timeout_s: float = 900.0) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self._log = open(log_path, "wb")
        threads = len(os.sched_getaffinity(0))
        tokens = kv_tokens(model_dir, kv_cache_gib)
        tokens -= tokens % slots
        flags = ["--threads", str(threads), "--threads-batch", str(threads),
                 "--ctx-size", str(tokens), "--parallel", str(slots),
                 "--alias", SERVED_NAME]
        self.build = {"version": tool_version(binary), "flags": flags,
                      "build_flags": cmake_build_flags(binary),
                      "kv_tokens": tokens, "kv_cache_gib": kv_cache_gib}
        self.proc = subprocess.Popen(
            [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port",
             self.url.rsplit(":", 1)[1], *flags],
            stdout=self._log, stderr=subprocess.STDOUT)
        wait_healthy(self, "llama-server", log_path, start_timeout_s, 1.0)
