"""AsyncLLMEngine and the app in-process: streams, aborts, and failures that stay local."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.streams import EngineRequestError
from kvserve.engine.llm_engine import LLMEngine
from kvserve.entrypoints.openai.api_server import build_app
from kvserve.metrics import ServerMetrics, StatsRecorder
from kvserve.sampling_params import SamplingParams
from kvserve.worker import KernelBuild
from tests.helpers import engine_settled


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def llm_engine(llama_dir, request):
    return LLMEngine(EngineArgs(model=llama_dir, num_threads=1, max_num_seqs=8,
                                async_scheduling=request.param))


def _run(llm_engine, body):
    """Run ``body(engine)`` on a fresh AsyncLLMEngine (one engine thread at a time)."""
    async def main():
        engine = AsyncLLMEngine(llm_engine, StatsRecorder(ServerMetrics("t"), log_interval=0))
        engine.start()
        try:
            return await asyncio.wait_for(body(engine), 60)
        finally:
            await engine.shutdown()
    return asyncio.run(main())


def test_generate_streams_cumulative_outputs(llm_engine):
    async def body(engine):
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2)
        outs = [o async for o in engine.generate("r1", [5, 6, 7, 8], params)]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(lengths) and lengths[-1] == 12
        assert outs[-1].outputs[0].token_ids == outs[-1].outputs[1].token_ids  # greedy
        assert await engine_settled(engine)
    _run(llm_engine, body)


def test_bad_prompt_raises_value_error(llm_engine):
    async def body(engine):
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_request("bad", [5] * 600, SamplingParams())
        with pytest.raises(ValueError, match="empty"):
            await engine.add_request("bad2", [], SamplingParams())
        assert engine.num_in_flight == 0
    _run(llm_engine, body)


def test_leaving_a_stream_aborts_and_frees_kv(llm_engine):
    async def body(engine):
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        streams = [await engine.add_request(f"a{i}", [9, 10, 11], params) for i in range(4)]
        for s in streams:
            async for out in engine.stream_outputs(s):
                if len(out.outputs[0].token_ids) >= 2:
                    break  # closing the generator aborts the request
        assert await engine_settled(engine)
        assert engine.num_in_flight == 0
    _run(llm_engine, body)


def test_failed_step_fails_only_its_requests(llm_engine, monkeypatch):
    real = llm_engine.worker.runner.execute
    calls = {"n": 0}

    def flaky(sched):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real(sched)
    monkeypatch.setattr(llm_engine.worker.runner, "execute", flaky)

    async def body(engine):
        with pytest.raises(EngineRequestError):
            async for _ in engine.generate("f1", [5, 6], SamplingParams(max_tokens=4)):
                pass
        outs = [o async for o in engine.generate("f2", [5, 6], SamplingParams(max_tokens=4))]
        assert outs[-1].outputs[0].finish_reason in ("stop", "length")
        assert await engine_settled(engine)
    _run(llm_engine, body)


def test_app_internal_error_is_500_and_server_recovers(llm_engine, monkeypatch):
    real = llm_engine.worker.runner.execute
    fail = {"on": True}

    def flaky(sched):
        if fail["on"]:
            raise RuntimeError("boom")
        return real(sched)
    monkeypatch.setattr(llm_engine.worker.runner, "execute", flaky)

    async def body(engine):
        app = build_app(engine, "m")
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            body = {"prompt": "x", "max_tokens": 3}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 500
            assert r.json()["error"]["type"] == "server_error"
            r = await client.post("/v1/completions", json={**body, "stream": True})
            lines = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
            assert "error" in json.loads(lines[-2][6:]) and lines[-1] == "data: [DONE]"
            fail["on"] = False
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"]
            assert (await client.get("/health")).status_code == 200
            metrics = (await client.get("/metrics")).text
            assert 'kvserve:request_success_total{engine="0",finished_reason="error",model_name="t"} 2.0' \
                in metrics
    _run(llm_engine, body)


async def _health_and_gauge(engine) -> tuple[dict, str]:
    """/health's body and the kernels_compiled line of /metrics."""
    transport = httpx.ASGITransport(app=build_app(engine, "m"))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        health = await client.get("/health")
        assert health.status_code == 200
        metrics = (await client.get("/metrics")).text
    gauge, = [ln for ln in metrics.splitlines() if ln.startswith("kvserve:kernels_compiled{")]
    return health.json(), gauge


def test_health_and_a_gauge_say_the_kernels_built(llm_engine):
    built = llm_engine.kernel_build()

    async def body(engine):
        health, gauge = await _health_and_gauge(engine)
        assert health == {"status": "ok", "native_kernels": {"compiled": built.compiled,
                                                             "reason": built.reason}}
        assert gauge.endswith(" 1.0" if built.compiled else " 0.0")
    _run(llm_engine, body)


def test_health_and_a_gauge_say_the_torch_paths_run_without_a_compiler(llm_engine,
                                                                         monkeypatch):
    missing = KernelBuild(False, "no C compiler (neither cc nor gcc on PATH)")
    monkeypatch.setattr(llm_engine.worker, "kernel_build", lambda: missing)

    async def body(engine):
        health, gauge = await _health_and_gauge(engine)
        assert health["native_kernels"] == {"compiled": False, "reason": missing.reason}
        assert gauge.endswith(" 0.0")
    _run(llm_engine, body)


def test_abort_all_ends_streams_with_503(llm_engine):
    """What graceful shutdown does to requests still running at its deadline."""
    async def body(engine):
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        streams = [await engine.add_request(f"s{i}", [7, 8], params) for i in range(3)]
        await streams[0].get()
        engine.abort_all()
        for s in streams:
            with pytest.raises(EngineRequestError) as info:
                async for _ in engine.stream_outputs(s):
                    pass
            assert info.value.status == 503
        assert await engine_settled(engine)
    _run(llm_engine, body)


def test_from_engine_args_loads_and_steps_on_one_thread(llama_dir, monkeypatch):
    """The model is built on the thread that later steps it (one OpenMP team)."""
    import threading

    built_on, stepped_on = [], []
    real_init, real_step = LLMEngine.__init__, LLMEngine.step

    def init(self, args):
        built_on.append(threading.get_ident())
        real_init(self, args)

    def step(self):
        stepped_on.append(threading.get_ident())
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "__init__", init)
    monkeypatch.setattr(LLMEngine, "step", step)
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(model=llama_dir, num_threads=1, max_num_seqs=4))
    assert built_on and built_on[0] != threading.get_ident()

    async def main():
        engine.start()
        try:
            params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
            outs = [o async for o in engine.generate("a", [5, 6, 7], params)]
            assert len(outs[-1].outputs[0].token_ids) == 5
        finally:
            await engine.shutdown()
    asyncio.run(main())
    assert set(stepped_on) == {built_on[0]}
    assert not engine._thread.is_alive()


def test_from_engine_args_reraises_load_errors_and_shuts_down_unstarted(llama_dir, tmp_path):
    with pytest.raises(FileNotFoundError):
        AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tmp_path / "missing")))
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=llama_dir, num_threads=1))
    asyncio.run(engine.shutdown(timeout=10))  # never started: the thread just ends
    assert not engine._thread.is_alive()
