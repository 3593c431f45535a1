"""Tensor parallelism at TP=2: transformers' greedy tokens and logprobs for every
architecture, the engine's modes on top, bad sizes refused, and a rank that dies stops
the engine (the server answers 503 and exits non-zero) instead of hanging it."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from kvserve import LLM, EngineArgs, SamplingParams
from tests.helpers import hf_greedy, hf_logprobs, prompts_of_lengths

MAX_NEW = 16
PROMPTS = prompts_of_lengths([5, 9, 14, 3, 20, 7, 33], seed=3)


def _greedy(llm, prompts=PROMPTS, max_new=MAX_NEW):
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture
def tp_llm():
    made = []

    def make(model_dir, **settings):
        llm = LLM(model_dir, tensor_parallel_size=2, **settings)
        made.append(llm)
        return llm
    yield make
    for llm in made:
        llm.engine.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "llama3-tied", "mistral", "qwen3", "gemma2",
                                  "phi3-longrope"])
def test_tp2_greedy_tokens_and_logprobs_are_transformers(arch, model_dirs, tp_llm):
    model_dir = model_dirs(arch)
    llm = tp_llm(model_dir)
    assert _greedy(llm) == hf_greedy(model_dir, PROMPTS, MAX_NEW)
    prompt = PROMPTS[2]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    expected = hf_logprobs(model_dir, prompt, list(out.token_ids))
    for j, (token, logprobs) in enumerate(zip(out.token_ids, out.logprobs)):
        assert abs(logprobs[token].logprob - float(expected[j, token])) < 1e-4


@pytest.mark.parametrize("settings", [
    {"num_kv_blocks": 24, "block_size": 8},                          # preemption
    {"num_kv_blocks": 24, "block_size": 8, "preemption_mode": "swap"},
    {"block_size": 4, "max_num_batched_tokens": 16},                 # chunked prompts
    {"attention_backend": "torch", "kv_manager": "buddy"},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                            "prompt_lookup_min": 1}},
], ids=["preempt", "swap", "chunked", "torch-buddy", "ngram"])
def test_tp2_keeps_the_engine_modes_exact(settings, llama_dir, tp_llm):
    llm = tp_llm(llama_dir, **settings)
    repeated = [p * 3 for p in PROMPTS[:4]]  # prompt lookup finds matches
    assert _greedy(llm, PROMPTS + repeated) == hf_greedy(llama_dir, PROMPTS + repeated, MAX_NEW)
    assert _greedy(llm, PROMPTS) == hf_greedy(llama_dir, PROMPTS, MAX_NEW)  # prefix hits
    assert llm.engine.kv.stats().num_used_blocks == 0


def test_ranks_keep_onednns_gemms_instead_of_timing_steps_alone(llama_dir, tp_llm):
    # a rank timing steps by itself would wait in their all-reduces for the others
    from kvserve.worker.tuning.panel_gemm import panel_linears

    llm = tp_llm(llama_dir)
    layers = panel_linears(llm.engine.worker.local.runner.model)
    assert layers and all(m.method.panel_max_rows == 0 and m.method.panel_weight is None
                          for m in layers)
    assert _greedy(llm, PROMPTS[:2], 4) == _greedy(llm, PROMPTS[:2], 4)


def test_each_rank_gets_its_own_cpus_and_threads(llama_dir):
    from kvserve.worker.parallel.tensor_parallel_worker import rank_config

    config = EngineArgs(model=llama_dir, tensor_parallel_size=2, omp_threads_bind="1|0",
                        ).create_engine_config()
    binds = [rank_config(config, r).worker for r in (0, 1)]
    assert [(w.omp_threads_bind, w.num_threads) for w in binds] == [("1", 1), ("0", 1)]


def test_bad_tensor_parallel_settings_are_refused(llama_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineArgs(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide 4 attention "
                                         "heads"):
        EngineArgs(model=llama_dir, tensor_parallel_size=3).create_engine_config()
    with pytest.raises(ValueError, match="gives 2 CPU lists .* tensor_parallel_size is 1"):
        EngineArgs(model=llama_dir, omp_threads_bind="0|1").create_engine_config()


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_a_dead_rank_makes_the_server_answer_503_and_exit_non_zero(llama_dir, tmp_path):
    from tests.entrypoints.conftest import ServerProcess

    from kvserve.worker.platform import allowed_cpus

    # an engine earlier in this process bound this thread to one CPU, which a child
    # would inherit: the server gets every CPU, one per rank
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, allowed_cpus())
    try:
        server = ServerProcess(llama_dir, tmp_path / "server.log", "--tensor-parallel-size",
                               "2")
    finally:
        os.sched_setaffinity(0, mine)
    try:
        server.wait_healthy()
        body = {"prompt": "hello", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code \
            == 200
        ranks = _children(server.proc.pid)
        assert len(ranks) == 1, ranks
        os.kill(ranks[0], signal.SIGKILL)  # as the OOM killer would
        statuses = set()
        deadline = time.monotonic() + 30
        while server.proc.poll() is None and time.monotonic() < deadline:
            try:
                r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=10)
                statuses.add(r.status_code)
                statuses.add(httpx.get(f"{server.url}/health", timeout=5).status_code)
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert server.proc.wait(30) == 1, server.log()
        assert 503 in statuses, (statuses, server.log())
        assert "tensor-parallel rank 1 exited" in server.log()
    finally:
        server.terminate()


def test_the_kv_memory_setting_is_the_whole_engines(llama_dir, tp_llm):
    """Each rank holds its share of every block: the same memory holds the same blocks."""
    one = LLM(llama_dir, kv_cache_memory="2MiB").engine.kv_layout
    two = tp_llm(llama_dir, kv_cache_memory="2MiB").engine.kv_layout
    assert two.num_blocks == one.num_blocks and two.bytes_per_block * 2 == one.bytes_per_block


def test_a_failure_on_rank_0_stops_the_engine_and_frees_the_ranks(llama_dir, tp_llm,
                                                                 monkeypatch):
    """After rank 0 fails mid-step the ranks are out of step: the engine must stop, not
    go on (the others would read its next call as the step's sums)."""
    from kvserve.worker import WorkerDiedError

    llm = tp_llm(llama_dir)
    worker = llm.engine.worker

    def broken(out):
        raise ValueError("a bug in rank 0's step")
    monkeypatch.setattr(worker.local, "execute_model", broken)
    llm.engine.add_request("r", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=4))
    with pytest.raises(WorkerDiedError, match="rank 0 failed in execute_model"):
        llm.engine.step()
    start = time.monotonic()
    worker.close()
    assert time.monotonic() - start < 5
    assert all(p.poll() is not None for p in worker.ranks)


def test_ranks_measure_step_costs_together_at_every_start(llama_dir, tp_llm):
    """Speculation's step costs are whole TP steps: a rank that took them from a plan
    while another measured would wait forever on its all-reduces, so none is planned."""
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    for _ in range(2):
        llm = tp_llm(llama_dir, speculative_config=spec)
        assert "steps" not in llm.engine.worker.tuning_plan().timings
        assert _greedy(llm, PROMPTS[:2], 4) == hf_greedy(llama_dir, PROMPTS[:2], 4)
        llm.engine.close()
