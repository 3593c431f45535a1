"""The runner's warm-up step at engine start leaves no trace the engine can see."""
from __future__ import annotations

import torch

from kvserve import LLM, SamplingParams
from kvserve.worker import model_runner
from tests.helpers import hf_greedy, prompts_of_lengths


def test_warm_up_sizes_itself_to_the_pool(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=64, block_size=8)
    runner = llm.engine.worker.runner
    assert runner.warm_up(100, max_prompt_len=40) == 80  # two prompts of 40, 6 blocks each
    assert runner.warm_up(2048) == 511  # the pool's 512 slots: one prompt and its decode
    assert LLM(llama_dir, num_kv_blocks=1, block_size=4).engine.worker.runner.warm_up(64) == 3
    assert LLM(llama_dir, num_kv_blocks=1, block_size=1).engine.worker.runner.warm_up(64) == 0


def test_a_large_models_warm_up_prompt_is_capped_by_a_layers_work(llama_dir, monkeypatch):
    runner = LLM(llama_dir, num_kv_blocks=64, block_size=8).engine.worker.runner
    layer = runner.model.model.layers[0]
    macs = sum(m.in_features * m.out_features for m in layer.modules()
               if isinstance(m, torch.nn.Linear))
    monkeypatch.setattr(model_runner, "WARM_UP_LAYER_MACS", 20 * macs)  # 20 tokens' work
    assert runner.warm_up(100, max_prompt_len=40) == 20  # one prompt of 20
    assert runner.warm_up(100, max_prompt_len=8) == 16  # two of 8
    monkeypatch.setattr(model_runner, "WARM_UP_LAYER_MACS", 0.5 * macs)
    assert runner.warm_up(100, max_prompt_len=40) == 1


def test_engine_starts_warm_with_every_block_free_and_exact(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=40, block_size=4)  # warm-up wrote into these blocks
    assert llm.engine.kv.stats().num_used_blocks == 0
    prompts = prompts_of_lengths([3, 30, 60])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(llama_dir, prompts, 8)


def test_few_row_gemms_are_tuned_only_for_eager_few_row_steps(llama_dir, monkeypatch):
    from kvserve.worker.tuning.row_padding import packed_linears
    from kvserve.worker.tuning.tuner import StartupTuner
    calls = []
    real = StartupTuner.layer_paths
    monkeypatch.setattr(StartupTuner, "layer_paths",
                        lambda self, model, kernels: calls.append(model) or real(self, model,
                                                                                 kernels))
    # the suite captures steps of 1-8 rows: such decode steps never run eager
    captured = LLM(llama_dir, num_kv_blocks=64).engine.worker
    assert captured.runner.captured.max_rows == 8 and not calls
    assert all((m.method.native_max_rows, m.method.dense_max_rows) == (0, 0)
               for m in packed_linears(captured.model))
    captured.tune_eager_few_rows()  # what bench captured does for its eager rounds
    captured.tune_eager_few_rows()  # once only: padding is measured on unpadded layers
    assert len(calls) == 1
    eager = LLM(llama_dir, num_kv_blocks=64, enforce_eager=True).engine.worker
    assert eager.runner.captured is None and len(calls) == 2


def test_warm_up_runs_a_layer_with_every_row_and_a_last_one(llama_dir, monkeypatch):
    from kvserve.worker import model_runner
    runner = LLM(llama_dir, num_kv_blocks=64, block_size=8).engine.worker.runner
    rows: dict[int, list[int]] = {}
    for i, layer in enumerate(runner.model.model.layers):
        layer.mlp.register_forward_hook(
            lambda module, args, out, i=i: rows.setdefault(i, []).append(args[0].shape[0]))
    assert model_runner.WARM_UP_LAYERS == 2 == len(runner.model.model.layers)
    runner.warm_up(80, max_prompt_len=40)  # two prompts of 40, then a decode step of two
    assert rows == {0: [80, 2], 1: [0, 0]}  # the last layer: only rows giving logits
    rows.clear()
    monkeypatch.setattr(model_runner, "WARM_UP_LAYERS", 1)
    runner.warm_up(80, max_prompt_len=40)
    assert rows == {0: [0, 0]}  # the first layer is then the last: the second never runs
