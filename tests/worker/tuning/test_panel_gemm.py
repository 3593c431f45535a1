"""The panels at start (worker/panel_gemm.py): packed for the layers they fit, the
panel GEMM's rows chosen, let go when no path reads them, and the dense weights let go
where the panels serve every few-row GEMM."""
from __future__ import annotations

import pytest
import torch

from kvserve.kernels import load_kernels
from kvserve.model.execution import ExecutionMode
from kvserve.model.layers import Linear
from kvserve.worker.tuning import panel_gemm
from kvserve.worker.tuning.panel_gemm import ALL_ROWS, chosen_rows, choose_panel_rows, \
    measure_panel_rows, pack_panel_weights, panel_linears, release_dense_weights, \
    release_unread_copies, release_unused_panels, time_prompt_gemms
# (measure_panel_rows, time_prompt_gemms: the real ones, imported before the suite's
# engines get stand-ins)

kernels = load_kernels()
pytestmark = pytest.mark.skipif(not kernels.available, reason=f"no C compiler: {kernels.reason}")


def test_chosen_rows_asks_a_clear_win_first_then_no_loss():
    times = {16: (10.0, 8.0), 32: (10.0, 9.6), 64: (10.0, 10.1), 128: (10.0, 5.0)}
    assert chosen_rows(times) == 32          # 32 gained 4 %: enough above a clear win
    assert chosen_rows({16: (10.0, 9.6), 32: (10.0, 5.0)}) == 0  # 4 % at the first: not
    assert chosen_rows({16: (10.0, 9.9)}) == 0
    assert chosen_rows({16: (10.0, 9.0), 32: (10.0, 9.0)}) == 32  # the ladder goes on
    assert chosen_rows({16: (10.0, 9.0), 32: (10.0, 10.0)}) == 32  # a tie is no loss
    assert chosen_rows({16: (10.0, 9.0), 32: (10.0, 9.6)}, extend_gain=0.05) == 16
    assert chosen_rows({}) == 0


def test_winning_the_whole_ladder_takes_every_larger_count_too():
    ladder = (16, 32)
    assert chosen_rows({16: (10.0, 9.0), 32: (10.0, 9.6)}, ladder=ladder) == ALL_ROWS
    assert chosen_rows({16: (10.0, 9.0), 32: (10.0, 10.2)}, ladder=ladder) == 16


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(Linear(32, 48), Linear(48, 32), Linear(32, 20))  # 20: no panels
    for m in model:
        m.method.packed_weight = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach())
    return model


def test_only_layers_of_whole_panels_take_part():
    model = _model()
    assert panel_linears(model) == [model[0], model[1]]


@pytest.mark.parametrize("huge_pages", [False, True])
def test_packing_gives_the_layers_of_whole_panels_their_panels(huge_pages):
    model = _model()
    packed = pack_panel_weights(model, kernels, huge_pages)
    assert packed == 4 * (32 * 48 + 48 * 32)
    for m in panel_linears(model):
        assert torch.equal(m.method.panel_weight, kernels.pack_panels(m.weight))
    assert model[2].method.panel_weight is None
    first = model[0].method.panel_weight
    assert pack_panel_weights(model, kernels, huge_pages) == 0  # packed once
    assert model[0].method.panel_weight is first


@pytest.mark.parametrize("wins", [True, False])
def test_choose_sets_the_rows_and_keeps_the_panels_for_the_gemv(monkeypatch, wins):
    model = _model()
    pack_panel_weights(model, kernels, huge_pages=False)
    faster = {16: (2.0, 1.0), 32: (2.0, 1.0), 64: (2.0, 3.0)}
    slower = {16: (1.0, 2.0)}
    monkeypatch.setattr(panel_gemm, "measure_panel_rows",
                        lambda layers, time_steps, **kw: faster if wins else slower)
    rows, times = choose_panel_rows(model, kernels, time_steps=None)
    assert rows == (32 if wins else 0)
    for m in panel_linears(model):
        assert m.method.panel_max_rows == rows
        assert m.method.panel_weight is not None
        assert (m.method.panel_gemm is not None) == wins


@pytest.mark.parametrize("reader", [None, "gemm", "gemv"])
def test_panels_go_only_when_no_layer_reads_them(reader):
    model = _model()
    pack_panel_weights(model, kernels, huge_pages=True)
    if reader == "gemm":
        model[1].method.panel_max_rows = 32
    elif reader == "gemv":
        model[0].method.native_max_rows = 4
    released = release_unused_panels(model)
    assert released == (0 if reader else 4 * (32 * 48 + 48 * 32))
    assert all((m.method.panel_weight is not None) == bool(reader) for m in panel_linears(model))


def test_the_few_row_gemv_reads_the_panels_where_the_layer_has_them():
    model = _model()
    m = model[0]
    m.method.native, m.method.native_max_rows = kernels, 8
    x = torch.randn(3, 32)
    with torch.inference_mode():
        dense = m(x)
        torch.testing.assert_close(dense, torch.nn.functional.linear(x, m.weight, m.bias),
                                   rtol=1e-5, atol=1e-5)
        pack_panel_weights(model, kernels, huge_pages=False)
        m.weight.data.zero_()  # the dense copy no longer read: the same answer
        torch.testing.assert_close(m(x), dense, rtol=1e-5, atol=1e-5)


def test_the_layer_runs_its_panels_only_within_its_rows():
    model = _model()
    m = model[0]
    m.method.panel_weight = kernels.pack_panels(m.weight)
    calls = []
    m.method.panel_gemm = lambda x, w, b: calls.append(x.shape[0]) or kernels.gemm_panels(x, w, b)
    m.method.panel_max_rows = 32
    with torch.inference_mode():
        for rows in (4, 9, 32, 33):
            x = torch.randn(rows, 32)
            torch.testing.assert_close(m(x), torch.nn.functional.linear(x, m.weight, m.bias),
                                       rtol=1e-5, atol=1e-5)
    assert calls == [9, 32]


def _timer(layers, panel_speed):
    """A step timer whose steps take n seconds on oneDNN and n * panel_speed[n] on the
    panel GEMM; it checks that every layer is on one path and records which."""
    calls = []

    def time_steps(counts):
        panel = layers[0].method.panel_max_rows > 0
        assert all(m.method.panel_max_rows == layers[0].method.panel_max_rows for m in layers)
        calls.append((counts, panel))
        return {n: n * (panel_speed[n] if panel else 1.0) for n in counts}

    return time_steps, calls


def _panel_layers():
    layers = panel_linears(_model())
    for m in layers:
        m.method.panel_weight = kernels.pack_panels(m.weight)
        m.method.panel_gemm = kernels.gemm_panels
    return layers


def test_measure_times_steps_on_both_paths_and_leaves_the_layers_on_onednn():
    layers = _panel_layers()
    time_steps, calls = _timer(layers, {16: 0.5, 32: 0.5})
    times = measure_panel_rows(layers, time_steps, rounds=2, ladder=(16, 32))
    assert times == {16: (16.0, 8.0), 32: (32.0, 16.0)}
    assert calls == [([16], False), ([16], True), ([16], False), ([16], True),
                     ([32], False), ([32], True), ([32], False), ([32], True)]
    assert all(m.method.panel_max_rows == 0 for m in layers)
    assert chosen_rows(times, ladder=(16, 32)) == ALL_ROWS


def test_a_burst_over_adjacent_steps_does_not_decide():
    """The median of the rounds' pairs: a burst of other work that slows two or three
    steps in a row, whichever path they ran on, neither wins a count for the panel GEMM
    nor loses it one."""
    layers = _panel_layers()
    slow = iter([1.0, 3.0, 3.0, 1.0, 1.0, 1.0,    # 16 rows (panel, oneDNN, panel ...)
                 3.0, 3.0, 3.0, 1.0, 1.0, 1.0])   # 32 rows: oneDNN, panel, oneDNN slowed
    time_steps, calls = _timer(layers, {16: 1.0, 32: 0.5})

    def disturbed(counts):
        return {n: t * next(slow) for n, t in time_steps(counts).items()}

    times = measure_panel_rows(layers, disturbed, rounds=3, ladder=(16,))
    assert times == {16: (16.0, 16.0)}
    times = measure_panel_rows(layers, disturbed, rounds=3, ladder=(32,))
    onednn, panel = times[32]
    assert panel / onednn == 0.5 and chosen_rows(times, ladder=(32,)) == ALL_ROWS
    assert [panel for _, panel in calls] == [False, True] * 6


def test_measure_goes_up_while_no_larger_count_is_lost():
    layers = _panel_layers()
    time_steps, _ = _timer(layers, {16: 0.5, 32: 0.98, 64: 1.02, 128: 0.5})
    times = measure_panel_rows(layers, time_steps, rounds=1, ladder=(16, 32, 64, 128))
    assert sorted(times) == [16, 32, 64]     # 32 is won at 2 %; 64, 2 % slower, is lost
    assert chosen_rows(times, ladder=(16, 32, 64, 128)) == 32


def test_measure_stops_up_the_ladder_at_the_first_count_lost():
    layers = _panel_layers()
    time_steps, calls = _timer(layers, {16: 1.0, 32: 0.5})
    times = measure_panel_rows(layers, time_steps, rounds=1, ladder=(16, 32))
    assert times == {16: (16.0, 16.0)}
    assert chosen_rows(times, ladder=(16, 32)) == 0


@pytest.mark.parametrize("prompt, expected", [((1.0, 1.02), ALL_ROWS), ((1.0, 1.2), 128),
                                              ((0.0, 0.0), ALL_ROWS)])
def test_a_won_ladder_takes_prompt_steps_unless_their_lone_gemms_run_slower(
        monkeypatch, prompt, expected):
    model = _model()
    pack_panel_weights(model, kernels, huge_pages=False)
    won = {16: (2.0, 1.0), 64: (2.0, 1.0), 128: (2.0, 1.0)}
    asked = []
    monkeypatch.setattr(panel_gemm, "measure_panel_rows", lambda layers, ts, **kw: dict(won))
    monkeypatch.setattr(panel_gemm, "time_prompt_gemms",
                        lambda layers, rows: asked.append(rows) or prompt)
    rows, times = choose_panel_rows(model, kernels, time_steps=None, prompt_rows=4096)
    assert asked == [2048]  # capped at PROMPT_ROWS
    assert rows == expected
    assert all(m.method.panel_max_rows == rows for m in panel_linears(model))
    assert times.get(2048) == (prompt if prompt[0] else None)


def test_no_prompt_check_where_the_ladder_was_lost_or_the_budget_is_within_it(monkeypatch):
    model = _model()
    pack_panel_weights(model, kernels, huge_pages=False)
    monkeypatch.setattr(panel_gemm, "time_prompt_gemms", lambda *a: pytest.fail("timed"))
    monkeypatch.setattr(panel_gemm, "measure_panel_rows",
                        lambda layers, ts, **kw: {16: (2.0, 1.0), 64: (2.0, 1.0), 128: (2.0, 1.0)})
    assert choose_panel_rows(model, kernels, None, prompt_rows=128)[0] == ALL_ROWS
    monkeypatch.setattr(panel_gemm, "measure_panel_rows",
                        lambda layers, ts, **kw: {16: (2.0, 1.0), 64: (2.0, 3.0)})
    assert choose_panel_rows(model, kernels, None, prompt_rows=2048)[0] == 16


def test_prompt_gemms_time_each_repeated_shape_on_both_paths_and_leave_onednn():
    torch.manual_seed(0)
    model = torch.nn.Sequential(Linear(32, 48), Linear(32, 48), Linear(48, 32))  # one 48->32
    for m in model:
        m.method.packed_weight = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach())
    pack_panel_weights(model, kernels, huge_pages=False)
    calls = []
    for m in model:
        m.method.panel_gemm = (lambda x, w, b:
                               calls.append(x.shape[0]) or kernels.gemm_panels(x, w, b))
    onednn, panel = time_prompt_gemms(list(model), rows=40, rounds=2)
    assert onednn > 0 and panel > 0
    assert calls == [40] * 4  # the repeated shape only, twice a round (its kernel, then timed)
    assert all(m.method.panel_max_rows == 0 for m in model)
    assert time_prompt_gemms([model[2]], rows=40) == (0.0, 0.0)


def test_start_up_times_decode_steps_and_an_engine_on_onednn_keeps_transformers_tokens(
        llama_dir, monkeypatch):
    from kvserve import LLM, SamplingParams
    from tests.helpers import hf_greedy, prompts_of_lengths

    measured = []

    def onednn_wins(linears, time_steps, **kw):  # real steps timed, the choice forced
        measured.append(time_steps([16]))
        return {16: (1.0, 1.0)}
    monkeypatch.setattr(panel_gemm, "measure_panel_rows", onednn_wins)
    llm = LLM(llama_dir, num_threads=1)
    assert measured and measured[0][16] > 0
    layers = panel_linears(llm.engine.worker.runner.model)
    assert layers and all(m.method.panel_max_rows == 0 for m in layers)
    prompts = prompts_of_lengths([1, 7, 17, 40])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(llama_dir, prompts, 12)


def test_a_dense_weight_goes_only_where_the_panels_serve_every_few_row_gemm():
    model = _model()
    pack_panel_weights(model, kernels, huge_pages=False)
    dense = [m.weight.detach().clone() for m in model]
    model[1].method.dense_max_rows = 2  # torch's dense GEMM still reads this one
    assert release_dense_weights(model) == 4 * 32 * 48
    assert model[0].weight.is_meta and model[0].weight.shape == (48, 32)
    assert not model[1].weight.is_meta and not model[2].weight.is_meta  # 2: no panels
    x = torch.randn(3, 32)
    with torch.inference_mode():
        model[0].method.native, model[0].method.native_max_rows = kernels, 8
        torch.testing.assert_close(model[0](x), x @ dense[0].T + model[0].bias,
                                   rtol=1e-5, atol=1e-5)
        model[0].method.native_max_rows, model[0].method.dense_max_rows = 0, 4
        with pytest.raises(RuntimeError, match="dense weight was let go"):
            model[0](x)  # a read fails loudly
    model[0].configure(ExecutionMode(kernels=kernels, packed_linear=True))
    assert torch.equal(model[0].weight, dense[0])  # back, from the panels


def test_a_weight_another_module_shares_stays():
    model = _model()
    tied = torch.nn.Module()
    tied.weight = model[0].weight  # as a tied LM head's embeddings
    both = torch.nn.ModuleList([model, tied])
    pack_panel_weights(model, kernels, huge_pages=False)
    assert release_dense_weights(both) == 4 * 48 * 32  # model[1]'s only
    assert not model[0].weight.is_meta and model[1].weight.is_meta


@pytest.mark.parametrize("arch", ["llama", "llama3-tied"])
def test_an_engine_on_panels_lets_the_dense_weights_go_and_keeps_transformers_tokens(
        arch, model_dirs):
    from kvserve import LLM, SamplingParams
    from tests.helpers import hf_greedy, prompts_of_lengths

    model_dir = model_dirs(arch)
    llm = LLM(model_dir, num_threads=1)
    model = llm.engine.worker.runner.model
    assert llm.engine.worker.runner.captured.on_panels
    layers = panel_linears(model)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == (arch == "llama3-tied")
    assert layers and all(m.weight.is_meta != (tied and m is model.lm_head) for m in layers)
    prompts = prompts_of_lengths([1, 7, 17, 40])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model_dir, prompts, 12)


@pytest.mark.parametrize("captured_reads, kept_panels, kept_dense", [
    ("panels", True, False),  # the captured step's plan holds the panels
    ("dense", False, True),   # ...or the dense weights
    (None, False, True),      # no captured step, no layer on the panels: they go
])
def test_start_up_lets_go_of_what_nothing_reads(captured_reads, kept_panels, kept_dense):
    model = _model()
    pack_panel_weights(model, kernels, huge_pages=False)
    panels, dense = release_unread_copies(model, captured_reads)
    layers = panel_linears(model)
    assert all((m.method.panel_weight is not None) == kept_panels for m in layers)
    assert all(m.weight.is_meta != kept_dense for m in layers)
    assert (panels > 0, dense > 0) == (not kept_panels, not kept_dense)


def test_a_layer_without_its_dense_weight_still_takes_zero_rows():
    model = _model()
    pack_panel_weights(model, kernels, huge_pages=False)
    release_dense_weights(model)
    with torch.inference_mode():
        assert model[0](torch.zeros(0, 32)).shape == (0, 48)


@pytest.mark.parametrize("given", [0, 64])
def test_given_rows_are_set_without_measuring_and_keep_transformers_tokens(
        llama_dir, monkeypatch, given):
    from kvserve import LLM, SamplingParams
    from tests.helpers import hf_greedy, prompts_of_lengths

    monkeypatch.setattr(panel_gemm, "measure_panel_rows", lambda *a, **kw: pytest.fail("timed"))
    llm = LLM(llama_dir, num_threads=1, panel_gemm_max_rows=given)
    layers = panel_linears(llm.engine.worker.runner.model)
    assert layers and all(m.method.panel_max_rows == given for m in layers)
    assert all((m.method.panel_gemm is not None) == bool(given) for m in layers)
    prompts = prompts_of_lengths([3, 40, 70])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(llama_dir, prompts, 8)


def test_given_rows_are_checked(llama_dir):
    from kvserve.engine.engine_args import EngineArgs

    with pytest.raises(ValueError, match="panel_gemm_max_rows must be an integer >= 0"):
        EngineArgs(model=llama_dir, panel_gemm_max_rows=-1).create_engine_config()
    with pytest.raises(ValueError, match="panel_gemm_max_rows applies to one process"):
        EngineArgs(model=llama_dir, tensor_parallel_size=2,
                   panel_gemm_max_rows=64).create_engine_config()
