"""The tuning plan: what start-up measured, saved under a key of what it depends on, and
applied by a later start without measuring, giving the same kernels; a plan of another
machine, model or setting is refused by path and not taken from the cache."""
from __future__ import annotations

import json

import pytest

from kvserve import LLM, SamplingParams
from kvserve.worker.tuning import plan as plan_module, tuner
from kvserve.worker.tuning.plan import PlanMismatchError, PlanStore, TuningPlan, plan_path
from kvserve.worker.tuning.row_padding import named_packed_linears
from tests.helpers import hf_greedy, prompts_of_lengths


def _worker(llm):
    return llm.engine.worker.inner


def _layer_state(model) -> dict[str, tuple]:
    """Every choice start-up makes, as each packed layer's method holds it."""
    return {name: (m.method.gemv_reads_panels, m.method.panel_max_rows, m.method.min_rows,
                   m.method.dense_max_rows, m.method.native_max_rows)
            for name, m in named_packed_linears(model)}


def _state(llm) -> tuple:
    worker = _worker(llm)
    captured = worker.runner.captured
    return (_layer_state(worker.model), None if captured is None else captured.max_rows)


def _forbid_measuring(monkeypatch):
    """Every start-up measurement fails the test if it runs."""
    def measured(*args, **kwargs):
        raise AssertionError("start-up measured what the plan holds")
    for name in ("choose_gemv_weights", "choose_panel_rows", "choose_captured_rows",
                 "measure_min_rows", "choose_layer_paths"):
        monkeypatch.setattr(tuner, name, measured)


def test_a_plan_round_trips_through_json_and_prints_its_choices():
    plan = TuningPlan({"cpu": "x"}, gemv_reads_panels=True, panel_max_rows=2**62,
                      captured_max_rows=8, linear_min_rows=1,
                      layer_paths={"a": "packed", "b": "dense<=2", "c": "dense<=2"},
                      timings={"steps": {1: 0.002, 16: 0.004}})
    again = TuningPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan and again.timings["steps"][16] == 0.004
    text = plan.describe()
    assert "captured_max_rows: 8" in text and "2 dense<=2, 1 packed" in text
    assert "steps: 1:2.00ms 16:4.00ms" in text
    with pytest.raises(ValueError, match="not a kvserve tuning plan.*'colour'"):
        TuningPlan.from_dict({"key": {}, "colour": 1})


def test_plan_paths_beside_the_given_one():
    assert plan_path(None) is None
    assert str(plan_path("p/plan.json")) == "p/plan.json"
    assert str(plan_path("p/plan.json", "draft")) == "p/plan.draft.json"
    assert str(plan_path("p/plan.json", "", rank=1)) == "p/plan.rank1.json"
    assert str(plan_path("p/plan.json", "draft", rank=1)) == "p/plan.draft.rank1.json"


@pytest.mark.parametrize("settings", [{}, {"enforce_eager": True}])
def test_a_restart_applies_the_cached_plan_without_measuring(llama_dir, monkeypatch,
                                                             tmp_path, settings):
    # eager engines also tune their few-row GEMMs (row padding, each layer's path)
    first = LLM(llama_dir, num_kv_blocks=64, **settings)
    measured = _worker(first).tuning_plan()
    assert measured.measured == []  # saved
    cached = list(plan_module.plan_cache_dir().glob("plan-*.json"))
    assert len(cached) == 1
    if settings:
        assert measured.layer_paths is not None and measured.linear_min_rows is not None
    else:
        assert measured.captured_max_rows == 8 and measured.gemv_reads_panels is not None
    expected = _state(first)
    first.engine.close()

    _forbid_measuring(monkeypatch)
    again = LLM(llama_dir, num_kv_blocks=64, **settings)
    assert _worker(again).tuning_plan() == measured
    assert _state(again) == expected
    prompts = prompts_of_lengths([3, 12, 30])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = again.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(llama_dir, prompts, 6)


def test_another_setting_is_another_plan_and_no_cache_means_measuring(llama_dir, tmp_path):
    LLM(llama_dir, num_kv_blocks=64).engine.close()
    LLM(llama_dir, num_kv_blocks=64, huge_pages=False).engine.close()
    assert len(list(plan_module.plan_cache_dir().glob("plan-*.json"))) == 2
    LLM(llama_dir, num_kv_blocks=64, tuning_cache=False).engine.close()
    assert len(list(plan_module.plan_cache_dir().glob("plan-*.json"))) == 2


def test_a_plan_given_by_path_is_saved_there_and_refused_for_another_engine(
        llama_dir, tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    first = LLM(llama_dir, num_kv_blocks=64, tuning_plan=str(path))
    saved = json.loads(path.read_text())
    assert saved["key"]["threads"] >= 1 and saved["captured_max_rows"] == 8
    assert len(list(plan_module.plan_cache_dir().glob("*.json"))) == 1  # measured: cached
    expected = _state(first)
    first.engine.close()
    with monkeypatch.context() as m:
        _forbid_measuring(m)
        again = LLM(llama_dir, num_kv_blocks=64, tuning_plan=str(path))
        assert _state(again) == expected
        again.engine.close()
    with pytest.raises(PlanMismatchError, match=r"plan\.json was measured for another "
                                                r"huge_pages than this engine's"):
        LLM(llama_dir, num_kv_blocks=64, huge_pages=False, tuning_plan=str(path))


def test_a_new_path_takes_the_cached_plan(llama_dir, tmp_path, monkeypatch):
    first = LLM(llama_dir, num_kv_blocks=64)
    measured = _worker(first).tuning_plan()
    first.engine.close()
    _forbid_measuring(monkeypatch)
    path = tmp_path / "written.json"
    LLM(llama_dir, num_kv_blocks=64, tuning_plan=str(path)).engine.close()
    assert TuningPlan.from_dict(json.loads(path.read_text())) == measured


def test_a_damaged_plan_is_named(llama_dir, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the tuning plan .*plan.json"):
        LLM(llama_dir, num_kv_blocks=64, tuning_plan=str(path))


def test_a_cached_plan_of_another_key_is_measured_anew(tmp_path, monkeypatch):
    monkeypatch.setattr(plan_module, "plan_cache_dir", lambda: tmp_path)
    key = {"cpu": "this one"}
    plan_module.write_plan(TuningPlan({"cpu": "another"}, panel_max_rows=16),
                           plan_module.cache_path(key))
    store = PlanStore(None, cached=True)
    assert store.load(key) == TuningPlan(key) and store.source == "measured"


def test_speculative_step_costs_come_from_the_plan(llama_dir, monkeypatch):
    spec = {"method": "draft_model", "model": llama_dir, "num_speculative_tokens": 2}
    first = LLM(llama_dir, num_kv_blocks=64, speculative_config=spec)
    worker = _worker(first)
    steps = dict(worker.tuning_plan().timings["steps"])
    draft = worker.draft_tuner.plan.timings
    assert steps and draft["draft_passes"] and draft["draft_catch_ups"]
    first.engine.close()

    from kvserve.worker import model_runner

    def timed(*args, **kwargs):
        raise AssertionError("a step cost the plan holds was measured again")
    _forbid_measuring(monkeypatch)
    monkeypatch.setattr(model_runner.ModelRunner, "time_rows", timed)
    monkeypatch.setattr(model_runner.ModelRunner, "time_decodes", timed)
    again = LLM(llama_dir, num_kv_blocks=64, speculative_config=spec)
    assert _worker(again).tuning_plan().timings["steps"] == steps
    assert _worker(again).draft_tuner.plan.timings == draft
    again.engine.close()
