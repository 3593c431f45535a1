"""The step profiler: one step in N split into linear / attention / other, hooks gone after."""
from __future__ import annotations

from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams


def run(llama_dir, interval):
    engine = LLMEngine(EngineArgs(model=llama_dir, num_threads=1, step_profile_interval=interval))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("a", [5, 6, 7, 8], params)
    steps, tokens = 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        steps += 1
    return engine, steps, tokens


def test_profiled_steps_split_their_time(llama_dir):
    engine, steps, tokens = run(llama_dir, interval=3)
    stats = engine.get_stats().step_time
    assert stats.profiled_steps == steps // 3
    assert all(s > 0 for s in stats.seconds), stats
    model = engine.worker.model
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    _, _, plain = run(llama_dir, interval=0)
    assert tokens == plain  # timing changes no result


def test_off_profiles_nothing(llama_dir):
    engine, _, _ = run(llama_dir, interval=0)
    assert engine.get_stats().step_time.profiled_steps == 0


def test_the_parts_are_exclusive(llama_dir):
    """Linear time inside an attention block is counted once, as linear."""
    import torch

    from kvserve.worker.step_profiler import StepProfiler

    class Lin(torch.nn.Linear):
        step_part = "linear"

    class Att(torch.nn.Module):
        step_part = "attention"

        def __init__(self):
            super().__init__()
            self.proj = Lin(64, 64)

        def forward(self, x):
            for _ in range(20):
                x = torch.tanh(x @ x.T @ x / 64)   # attention-side work
            return self.proj(x)

    model = torch.nn.Sequential(Att(), Lin(64, 64))
    prof = StepProfiler(model, 1)
    assert prof.due()
    prof.run(model, torch.randn(64, 64))
    linear, attention, other = prof.stats().seconds
    assert linear > 0 and attention > linear / 2 and other >= 0
