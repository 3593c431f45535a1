"""Which copy the few-row GEMV reads (worker/gemv_weights.py): both timed, the panels
kept unless the dense weight was clearly faster, and an engine on either copy giving
transformers' greedy tokens, the copy nothing reads let go."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.kernels import load_kernels
from kvserve.model.layers import Linear
from kvserve.worker.tuning import gemv_weights
from kvserve.worker.tuning.gemv_weights import choose_gemv_weights, dense_clearly_faster, \
    measure_gemv_weights
from kvserve.worker.tuning.panel_gemm import pack_panel_weights, panel_linears, release_unread_copies
from tests.helpers import hf_greedy, prompts_of_lengths

# (measure_gemv_weights: the real one, imported before the suite's engines get a stand-in)
kernels = load_kernels()
pytestmark = pytest.mark.skipif(not kernels.available, reason=f"no C compiler: {kernels.reason}")


def test_the_dense_weight_must_be_clearly_faster_over_all_counts():
    assert dense_clearly_faster({1: (9.0, 10.0), 4: (9.0, 10.0)})
    assert not dense_clearly_faster({1: (9.9, 10.0), 4: (9.8, 10.0)})  # 1.5 %: not enough
    assert not dense_clearly_faster({1: (8.0, 10.0), 4: (13.0, 10.0)})  # lost overall
    assert not dense_clearly_faster({1: (10.0, 10.0)})


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(Linear(32, 48), Linear(48, 32, bias=False), Linear(32, 20))
    for m in model:
        m.method.packed_weight = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach())
    return model


def test_both_copies_are_timed_at_each_count():
    model = _model()
    pack_panel_weights(model, kernels, huge_pages=False)
    times = measure_gemv_weights(panel_linears(model), kernels, rows=(1, 3), rounds=2)
    assert sorted(times) == [1, 3]
    assert all(d > 0 and p > 0 for d, p in times.values())


@pytest.mark.parametrize("dense_faster", [False, True])
def test_the_choice_is_the_whole_models_and_forward_follows_it(dense_faster, monkeypatch):
    model = _model()
    pack_panel_weights(model, kernels, huge_pages=True)
    timed = {1: (8.0, 10.0), 4: (8.0, 10.0)} if dense_faster else {1: (10.0, 8.0)}
    monkeypatch.setattr(gemv_weights, "measure_gemv_weights", lambda linears, k: timed)
    assert choose_gemv_weights(model, kernels) == timed
    on_panels = not dense_faster
    assert [m.method.gemv_reads_panels for m in panel_linears(model)] == [on_panels, on_panels]
    x = torch.randn(3, 32)
    layer = model[0]
    layer.method.native, layer.method.native_max_rows = kernels, 4
    expected = (kernels.gemv_panels(x, layer.method.panel_weight, layer.bias) if on_panels
                else kernels.gemv_rows(x, layer.weight, layer.bias))
    assert torch.equal(layer(x), expected)


def test_the_copy_the_gemv_does_not_read_goes_at_the_end_of_start_up():
    model = _model()
    pack_panel_weights(model, kernels, huge_pages=True)
    for m in panel_linears(model):
        m.method.gemv_reads_panels = False
        m.method.native, m.method.native_max_rows = kernels, 4
    weights = [m.weight.detach().clone() for m in panel_linears(model)]
    panels, dense = release_unread_copies(model, captured_reads="dense")
    assert panels == 4 * (32 * 48 + 48 * 32) and dense == 0
    for m, w in zip(panel_linears(model), weights):
        assert m.method.panel_weight is None and torch.equal(m.weight, w)
        assert m.method.release_dense_weight(m) == 0  # the GEMV reads it


def test_packing_on_huge_pages_moves_the_dense_weights_into_a_buffer_of_their_own():
    model = _model()
    before = [m.weight.detach().clone() for m in model]
    addresses = [m.weight.data_ptr() for m in model]
    pack_panel_weights(model, kernels, huge_pages=True)
    for m, w, at in zip(model, before, addresses):
        assert torch.equal(m.weight, w)
        assert (m.weight.data_ptr() != at) == (m.method.panel_weight is not None)
    first, second = (m.weight.data_ptr() for m in panel_linears(model))
    assert first % 64 == 0 and 0 < second - first < 2**21  # one mapping, cache-line aligned


def test_a_tied_weight_stays_where_the_embeddings_keep_it():
    embed = torch.nn.Embedding(48, 32)
    head = Linear(32, 48, bias=False)
    head.weight = embed.weight
    head.method.packed_weight = torch.ops.mkldnn._reorder_linear_weight(head.weight.detach())
    model = torch.nn.ModuleDict({"embed": embed, "head": head})
    at = embed.weight.data_ptr()
    pack_panel_weights(model, kernels, huge_pages=True)
    assert head.method.panel_weight is not None and embed.weight.data_ptr() == at
    assert head.weight is embed.weight


@pytest.mark.parametrize("arch", ["llama", "llama3-tied"])
def test_greedy_tokens_are_transformers_with_the_gemv_on_the_dense_weights(
        arch, model_dirs, monkeypatch):
    monkeypatch.setattr(gemv_weights, "measure_gemv_weights",
                        lambda linears, k: {1: (1.0, 2.0), 4: (1.0, 2.0)})
    llm = LLM(model_dirs(arch), max_num_seqs=8)
    runner = llm.engine.worker.runner
    assert runner.captured is not None and not runner.captured.on_panels
    assert all(not m.weight.is_meta for m in panel_linears(runner.model))  # kept
    prompts = prompts_of_lengths([1, 7, 17, 40, 3, 9, 2, 25, 11, 4])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model_dirs(arch), prompts, 12)
