"""The captured step: bitwise the eager step's logits on the native GEMV (both vector
builds), transformers' greedy tokens with it, the models it refuses, the measured
choice, --enforce-eager, and its parts reported to the step profiler."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.core.scheduler_output import SamplingInfo, ScheduledRequest
from kvserve.kernels import Kernels, load_kernels
from kvserve.model.execution import ExecutionMode, configure_layers
from kvserve.worker import captured_step
from kvserve.worker.captured_step import MAX_ROWS, CapturedStep, choose_captured_rows, \
    unsupported_reason
from kvserve.worker.input_batch import build_inputs
from kvserve.worker.tuning.row_padding import packed_linears
from kvserve.worker.tuning.small_gemm import _use
from tests.helpers import hf_greedy, prompts_of_lengths

kernels = load_kernels()
pytestmark = pytest.mark.skipif(not kernels.available, reason=f"no C compiler: {kernels.reason}")
LLAMA_FAMILY = ["llama", "llama3-tied", "qwen2", "mistral", "qwen3", "qwen3-moe"]


def _runner(model_dir, **engine_args):
    return LLM(model_dir, num_threads=1, **engine_args).engine.worker.runner


def _decode_step(runner, contexts: list[int], drafts: int = 0):
    """A step of one row per context (each request's tokens after ``context`` tokens),
    plus ``drafts`` draft rows on the first request; each its own blocks."""
    return build_inputs(_scheduled(runner, contexts, drafts), runner.block_size,
                        runner.config.sliding_window, runner.native_attention)


def _scheduled(runner, contexts: list[int], drafts: int = 0) -> list[ScheduledRequest]:
    bs, info = runner.block_size, SamplingInfo(SamplingParams(), (), (), None)
    scheduled, first = [], 0
    for i, ctx in enumerate(contexts):
        n = 1 + (drafts if i == 0 else 0)
        blocks = -(-(ctx + n) // bs)
        tokens = [(7 * i + j) % 50 + 3 for j in range(n)]
        scheduled.append(ScheduledRequest(f"r{i}", tokens, ctx, list(range(first, first + blocks)),
                                          info, n - 1))
        first += blocks
    return scheduled


def _assert_bitwise_the_eager_steps(runner, captured, cases) -> None:
    """Each (contexts, drafts) step's logits, captured, equal the eager step's."""
    for contexts, drafts in cases:
        inputs = _decode_step(runner, contexts, drafts)
        runner.captured = None
        with torch.inference_mode():
            eager = runner.forward(inputs)
        runner.captured = captured
        assert captured.covers(inputs)
        with torch.inference_mode():
            got = runner.forward(inputs)
        assert torch.equal(got, eager), (contexts, drafts, (got - eager).abs().max())


@pytest.mark.parametrize("layout", ["panels", "dense", "dense-chosen"])
@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize("arch", LLAMA_FAMILY)
def test_logits_are_bitwise_the_eager_steps_on_the_native_gemv(layout, build, arch,
                                                                model_dirs):
    runner = _runner(model_dirs(arch))
    built = kernels if build == "native" else Kernels(("-mno-avx512f",))
    assert built.available, built.reason
    configure_layers(runner.model, ExecutionMode(kernels=built, packed_linear=True))
    for m in packed_linears(runner.model):  # eager's linear layers on the same kernel
        _use(m, "native", MAX_ROWS, built)
        if layout == "dense":  # no panels: no panel GEMM either
            m.method.panel_weight, m.method.panel_max_rows = None, 0
        m.method.gemv_reads_panels = layout != "dense-chosen"  # panels kept, the GEMV on dense
    captured = CapturedStep(runner.model, runner.caches, built)
    assert captured.on_panels == (layout == "panels")
    captured.max_rows = MAX_ROWS
    runner.native_attention = built
    _assert_bitwise_the_eager_steps(runner, captured, [
        ([5], 0), ([3, 40], 0), ([1, 17, 33], 0), ([9, 2, 64, 30], 0), ([20], 3), ([12, 8], 2),
        ([4, 9, 13, 2, 30, 7], 0), ([5, 6, 7, 8, 9, 10, 11, 12], 0), ([15, 3, 22], 5)])


@pytest.mark.parametrize("arch", LLAMA_FAMILY)
def test_greedy_tokens_are_transformers_with_captured_steps(arch, model_dirs, monkeypatch):
    llm = LLM(model_dirs(arch), max_num_seqs=MAX_ROWS)
    captured = llm.engine.worker.runner.captured
    assert captured is not None and captured.max_rows == MAX_ROWS
    calls = []
    real = CapturedStep._run
    monkeypatch.setattr(CapturedStep, "_run", lambda self, rows, *a: calls.append(
        rows) or real(self, rows, *a))
    prompts = prompts_of_lengths([1, 7, 17, 40, 3, 9, 2, 25, 11, 4])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model_dirs(arch), prompts, 12)
    assert calls and set(calls) <= set(range(1, MAX_ROWS + 1)) and max(calls) > 4


@pytest.mark.parametrize("arch", ["llama", "mistral"])  # mistral: a sliding window
def test_a_decode_step_without_step_inputs_gives_the_same_logits(arch, model_dirs):
    runner = _runner(model_dirs(arch))
    captured = runner.captured
    for contexts in [[5], [3, 40], [70, 1, 17], [9, 2, 64, 30, 5, 6, 7, 8]]:
        scheduled = _scheduled(runner, contexts)
        with torch.inference_mode():
            expected = captured(build_inputs(scheduled, runner.block_size,
                                             runner.config.sliding_window, kernels))
            got = captured.decode(scheduled)
        assert torch.equal(got, expected), contexts
    too_many = _scheduled(runner, list(range(3, 4 + MAX_ROWS)))
    drafted = _scheduled(runner, [20], drafts=2)
    info = SamplingInfo(SamplingParams(), (), (), None)
    chunk = [ScheduledRequest("p", [5, 6, 7], 0, [0], info)]
    unsampled = [ScheduledRequest("p", [5], 3, [0], None)]
    assert all(captured.decode(s) is None
               for s in (too_many, drafted, chunk, unsampled, []))
    captured.max_rows = 0
    assert captured.decode(_scheduled(runner, [3])) is None


@pytest.fixture(scope="module")
def q8_0_files(model_dirs, tmp_path_factory):
    """arch -> the test model converted to a Q8_0 GGUF file by llama.cpp's converter."""
    from pathlib import Path
    from tests.format_tools import convert_to_gguf, llama_cpp_source
    tree = llama_cpp_source(Path.home() / ".cache" / "kvserve-tests" / "llama-cpp")
    made = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = convert_to_gguf(tree, model_dirs(arch), "q8_0",
                                         tmp_path_factory.mktemp("gguf") / f"{arch}-q8_0.gguf")
        return made[arch]
    return get


@pytest.mark.parametrize("arch, activations", [("llama", "int8"), ("llama", "float"),
                                               ("qwen3-moe", "int8")])
def test_a_gguf_models_step_is_bitwise_the_eager_one(q8_0_files, arch, activations):
    """Every linear layer on the file's blocks (a Qwen3-MoE's experts each on its own rows
    of the file's tensors, its router the file's F32 tensor) and the embedding decoded a
    row at a time, in one native call: the same kernels, so the same logits."""
    runner = _runner(str(q8_0_files(arch)), gguf_activations=activations)
    captured = runner.captured
    assert captured is not None and captured.gguf and captured.max_rows > 0
    captured.max_rows = MAX_ROWS
    _assert_bitwise_the_eager_steps(runner, captured,
                                    [([5], 0), ([3, 40], 0), ([9, 2, 64, 30], 0), ([20], 3)])


def test_steps_it_does_not_cover_run_eager(llama_dir):
    runner = _runner(llama_dir)
    captured = runner.captured
    assert captured.covers(_decode_step(runner, list(range(3, 3 + MAX_ROWS))))
    assert not captured.covers(_decode_step(runner, list(range(3, 4 + MAX_ROWS))))  # too many
    bs, info = runner.block_size, SamplingInfo(SamplingParams(), (), (), None)
    prefill = build_inputs([ScheduledRequest("p", [5, 6, 7], 0, [0], info)], bs, None,
                           runner.native_attention)
    assert not captured.covers(prefill)  # two of its rows give no logits
    captured.max_rows = 0
    assert not captured.covers(_decode_step(runner, [3]))


def test_enforce_eager_runs_no_captured_step(llama_dir):
    llm = LLM(llama_dir, enforce_eager=True, max_num_seqs=2)
    assert llm.engine.worker.runner.captured is None
    prompts = prompts_of_lengths([5, 20])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(llama_dir, prompts, 8)


@pytest.mark.parametrize("arch, engine_args, reason", [
    ("gpt2", {}, "GPT2LMHeadModel: the captured step runs Llama, Mistral, Qwen2, Qwen3 and "
     "Qwen3-MoE layers only"),
    ("qwen2-moe", {}, "Qwen2MoeForCausalLM: the captured step runs Llama, Mistral, Qwen2, "
     "Qwen3 and Qwen3-MoE layers only"),
    ("llama", {"quantization": "int8"}, "quantized linear layers"),
    ("llama", {"dtype": "bfloat16"}, "weights are not float32"),
    ("llama", {"kv_cache_dtype": "float16"}, "the KV cache is not float32"),
])
def test_models_it_cannot_run_stay_eager(arch, engine_args, reason, model_dirs):
    runner = _runner(model_dirs(arch), **engine_args)
    assert runner.captured is None
    assert unsupported_reason(runner.model, runner.caches, kernels) == reason
    with pytest.raises(ValueError, match=reason):
        CapturedStep(runner.model, runner.caches, kernels)


def test_a_strided_weight_is_refused(llama_dir):
    runner = _runner(llama_dir)
    attn = runner.model.model.layers[0].self_attn
    attn.o_proj.weight.data = attn.o_proj.weight.data.t().contiguous().t()
    reason = "a weight or KV pool is not contiguous"
    assert unsupported_reason(runner.model, runner.caches, kernels) == reason


def test_without_native_kernels_it_is_not_built(llama_dir):
    runner = _runner(llama_dir, attention_backend="torch")
    assert runner.captured is None
    assert unsupported_reason(runner.model, runner.caches, None) == "no native kernels"


class _TimedRunner:
    """time_decodes answers from a table: eager's when max_rows is 0, else captured's;
    ``calls`` records which, in order."""

    def __init__(self, captured, eager, fast):
        self.captured, self.eager, self.fast = captured, eager, fast
        self.calls: list[str] = []

    def time_decodes(self, counts, rounds=3, warm=True):
        mode = "captured" if self.captured.max_rows else "eager"
        self.calls.append(mode)
        table = self.fast if mode == "captured" else self.eager
        return {n: table[n] for n in counts if n in table}


def test_rows_are_captured_up_to_the_first_count_eager_is_clearly_faster(llama_dir):
    captured = _runner(llama_dir).captured
    eager = {n: 1.0 for n in range(1, MAX_ROWS + 1)}
    fast = {n: 0.5 for n in eager} | {1: 0.8, 2: 1.01, 4: 1.05, 3: 2.0}
    runner = _TimedRunner(captured, eager, fast)
    times = choose_captured_rows(runner, captured, rounds=3)
    assert runner.calls == ["eager", "captured", "captured", "eager", "eager", "captured"]
    assert set(times) == set(captured_step.TIMED_ROWS) == {1, 2, 4, 8}  # 3 is not timed
    assert captured.max_rows == 2  # 2 ties (captured); eager is clearly faster at 4
    assert times[4] == (1.0, 1.05)
    choose_captured_rows(_TimedRunner(captured, eager, {n: 1.2 for n in eager}), captured)
    assert captured.max_rows == 0
    choose_captured_rows(_TimedRunner(captured, eager, {n: 1.01 for n in eager}), captured)
    assert captured.max_rows == 8  # ties everywhere
    # a pool too small for a count's context: counts from there on are not captured
    choose_captured_rows(_TimedRunner(captured, {1: 1.0}, {1: 0.5}), captured)
    assert captured.max_rows == 1
    assert captured_step.REQUIRED_GAIN > 0


def test_the_profiler_gets_the_captured_steps_parts(llama_dir):
    worker = LLM(llama_dir, step_profile_interval=1).engine.worker
    runner = worker.runner
    assert runner.captured.profiler is worker.profiler
    inputs = _decode_step(runner, [10, 20])
    assert runner.captured.covers(inputs)  # no module runs: no hook fires
    before = worker.step_time_stats()
    with torch.inference_mode():
        worker.profiler.run(runner.forward, inputs)
    after = worker.step_time_stats()
    assert after.profiled_steps == before.profiled_steps + 1
    linear, attention, _ = (a - b for a, b in zip(after.seconds, before.seconds))
    assert linear > 0 and attention > 0
    assert not worker.profiler.active


def test_cost_of_a_prompt_chunk_is_timed_eager(llama_dir, monkeypatch):
    """A draft model's catch-up is a prompt chunk (only its last row samples): its cost
    is timed on that shape, which the captured step does not run."""
    runner = _runner(llama_dir)
    rows: list[int] = []
    real = CapturedStep.__call__
    monkeypatch.setattr(CapturedStep, "__call__",
                        lambda self, i: rows.append(i.tokens.shape[0]) or real(self, i))
    runner.time_rows([2, 4], rounds=1, all_rows_sample=False)
    assert rows == []
    runner.time_rows([2, 4], rounds=1)  # a verify step: every row samples, captured
    assert set(rows) == {2, 4}
