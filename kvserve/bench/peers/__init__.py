"""The other systems a bench runs for comparison: HF transformers static batching
(:mod:`~kvserve.bench.peers.hf_baseline`), vLLM's CPU build
(:mod:`~kvserve.bench.peers.vllm_runner`) and llama.cpp
(:mod:`~kvserve.bench.peers.llamacpp`), each in its own venv where it needs one; and
kvserve's own server as a subprocess (:mod:`~kvserve.bench.peers.server_process`), started
the way a peer's server is."""
