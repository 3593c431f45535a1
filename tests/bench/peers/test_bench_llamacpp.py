"""The llama.cpp peer's kvserve side: the same timings, the figures, the agreement."""
from __future__ import annotations

import pytest

from kvserve.bench.peers import llamacpp
from kvserve.bench.workloads.definitions import BenchRequest


def _request(tokens, steps, total, ttft=0.01):
    return {"ttft_s": ttft, "steps_s": steps, "total_s": total, "tokens": tokens}


def test_summarize_takes_the_median_step_and_end_to_end_rate():
    out = llamacpp.summarize([_request([1, 2, 3], [0.01, 0.03], 0.05),
                              _request([4, 5], [0.02], 0.05)])
    assert out["decode_step_ms"] == pytest.approx(20.0)
    assert out["decode_tok_s"] == pytest.approx(50.0)
    assert out["sequential_output_tok_s"] == pytest.approx(5 / 0.1)
    assert out["requests"] == 2


def test_token_agreement_compares_the_first_tokens_only():
    n = llamacpp.AGREEMENT_TOKENS
    ours = [_request(list(range(n)) + [1], [], 1), _request([7] * n, [], 1)]
    theirs = [_request(list(range(n)) + [2], [], 1), _request([7] * (n - 1) + [8], [], 1)]
    assert llamacpp.token_agreement(ours, theirs) == 0.5


def test_sequential_requests_cap_the_output():
    reqs = [BenchRequest([1, 2], 500), BenchRequest([3], 4), BenchRequest([5], 9)]
    out = llamacpp.sequential_requests(reqs, 2)
    assert [(r.prompt_token_ids, r.max_tokens) for r in out] == \
        [([1, 2], llamacpp.MAX_NEW_TOKENS), ([3], 4)]


def test_kvserve_sequential_times_each_request_alone(llama_dir):
    from kvserve import LLM, SamplingParams
    llm = LLM(llama_dir, num_threads=1)
    reqs = [BenchRequest([5, 6, 7], 6), BenchRequest([8, 9], 4)]
    out = llamacpp.kvserve_sequential(llm, reqs)
    assert [len(r["tokens"]) for r in out] == [6, 4]
    assert [len(r["steps_s"]) for r in out] == [5, 3]  # every token after the first
    assert all(r["ttft_s"] > 0 and r["total_s"] >= r["ttft_s"] for r in out)
    greedy = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                          SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)
    assert out[0]["tokens"] == list(greedy[0].outputs[0].token_ids)


def test_the_converter_wrapper_declares_gpt2s_pre_tokenizer():
    assert 'get_vocab_base_pre = lambda self, tokenizer: "gpt-2"' in llamacpp.CONVERT_SOURCE
    compile(llamacpp.CONVERT_SOURCE, "convert.py", "exec")
    compile(llamacpp.RUNNER_SOURCE, "runner.py", "exec")


def test_ggml_features_read_from_the_system_line():
    line = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | OPENMP = 1 | "
    assert llamacpp.ggml_features(line) == {"SSE3": "1", "AVX2": "1", "AVX512": "1",
                                            "OPENMP": "1"}


def test_llama_bench_is_run_and_read(tmp_path):
    """The binary's JSON (a stand-in printing llama-bench's record layout) gives the
    tg rate, its build and the CPUs it ran on."""
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\ncat <<'JSON'\n[{\"n_prompt\": 0, \"n_gen\": 128, \"avg_ts\": "
                    "80.5, \"stddev_ts\": 1.5, \"n_threads\": 2, \"build_commit\": \"abc\", "
                    "\"build_number\": 7, \"cpu_info\": \"AMD EPYC\"}]\nJSON\n")
    fake.chmod(0o755)
    out = llamacpp.run_llama_bench(str(fake), tmp_path / "m.gguf", threads=2)
    assert out["tg_tok_s"] == 80.5 and out["n_threads"] == 2 and out["build_commit"] == "abc"
    assert "-n 128 -t 2" in out["command"] and "cpus" in out


def test_llama_bench_at_a_depth_reads_that_record(tmp_path):
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\ncat <<'JSON'\n[{\"n_prompt\": 0, \"n_gen\": 16, \"n_depth\": 0, "
                    "\"avg_ts\": 80.5, \"stddev_ts\": 1.5, \"n_threads\": 2}, {\"n_prompt\": 0, "
                    "\"n_gen\": 16, \"n_depth\": 512, \"avg_ts\": 60.0, \"stddev_ts\": 1.0, "
                    "\"n_threads\": 2}]\nJSON\n")
    fake.chmod(0o755)
    out = llamacpp.run_llama_bench(str(fake), tmp_path / "m.gguf", threads=2, tokens=16,
                                   depth=512)
    assert out["tg_tok_s"] == 60.0 and out["n_depth"] == 512
    assert out["command"].endswith("-d 512")


def test_llama_bench_prompt_processing_reads_the_pp_record(tmp_path):
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\ncat <<'JSON'\n[{\"n_prompt\": 512, \"n_gen\": 0, \"n_depth\": 0, "
                    "\"avg_ts\": 65.2, \"stddev_ts\": 3.0, \"n_threads\": 2}]\nJSON\n")
    fake.chmod(0o755)
    out = llamacpp.run_llama_bench(str(fake), tmp_path / "m.gguf", threads=2, prompt=512)
    assert out["pp_tok_s"] == 65.2 and out["n_prompt"] == 512 and "tg_tok_s" not in out
    assert "-p 512 -n 0 -t 2" in out["command"]


def test_llama_bench_and_the_runner_must_agree_or_say_why():
    bench = {"tg_tok_s": 100.0}
    near = llamacpp.llama_bench_check(bench, [{"decode_tok_s": 95.0}, {"decode_tok_s": 97.0}])
    assert near["agree"] and "why" not in near
    assert near["runner_over_llama_bench"] == pytest.approx(0.96)
    far = llamacpp.llama_bench_check(bench, [{"decode_tok_s": 70.0}])
    assert not far["agree"] and "-30 %" in far["why"]


def test_llama_benchs_ggml_build_flags_come_from_its_cmake_cache(tmp_path):
    from kvserve.bench.peers.llamacpp import cmake_build_flags
    binary = tmp_path / "build" / "bin" / "llama-bench"
    binary.parent.mkdir(parents=True)
    binary.write_text("")
    assert cmake_build_flags(binary) == {}
    (tmp_path / "build" / "CMakeCache.txt").write_text(
        "# a comment\nGGML_NATIVE:BOOL=ON\nGGML_AVX512:BOOL=OFF\n"
        "CMAKE_BUILD_TYPE:STRING=Release\nCMAKE_C_FLAGS:STRING=-O2\n"
        "//GGML_CUDA help text\nGGML_CUDA:BOOL=OFF\n")
    assert cmake_build_flags(binary) == {"GGML_NATIVE": "ON", "GGML_AVX512": "OFF",
                                         "CMAKE_BUILD_TYPE": "Release", "GGML_CUDA": "OFF"}
