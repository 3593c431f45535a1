"""The ingress in front of two in-process replicas: the single server's answers, the
router's choices, the API key, /metrics, and a replica that dies under a request."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.config.replicas import ReplicaConfig
from kvserve.entrypoints.openai.api_server import APIKeyMiddleware
from kvserve.replicas.ingress import Ingress
from tests.helpers import engine_settled
from tests.replicas.conftest import InProcessHandle

PREFIX = list(range(100, 164))  # four index blocks


@pytest.fixture
def handles(replicas):
    return [InProcessHandle(r) for r in replicas]


def _ingress(handles, **config) -> Ingress:
    return Ingress(handles, ReplicaConfig(num_replicas=len(handles), **config), "kvserve",
                   max_body_bytes=1 << 20, max_file_bytes=1 << 20)


async def _request(app, method: str, path: str, **kw) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as client:
        return await client.request(method, path, **kw)


def _comparable(r: httpx.Response):
    try:
        body = r.json()
    except ValueError:
        return r.status_code, r.text
    if isinstance(body, dict):
        for key in ("id", "created"):
            body.pop(key, None)
        for item in body.get("data", []) if isinstance(body.get("data"), list) else []:
            item.pop("created", None)
    return r.status_code, body


@pytest.mark.parametrize("method,path,body", [
    ("POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 5, "temperature": 0}),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": -3}),
    ("POST", "/v1/completions", {"prompt": "x", "best_of_typo": 2}),
    ("POST", "/v1/completions", {"prompt": "x", "model": "other"}),
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"prompt": "hello"}),
    ("GET", "/v1/nowhere", None),
])
def test_every_route_answers_as_the_single_server(handles, run, method, path, body):
    ingress = _ingress(handles)
    kw = {} if body is None else {"json": body}
    via_ingress = run(_request(ingress, method, path, **kw))
    direct = run(_request(handles[0].replica.app, method, path, **kw))
    assert _comparable(via_ingress) == _comparable(direct)


def test_a_stream_is_relayed_to_its_done(handles, run):
    body = {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0, "stream": True,
            "ignore_eos": True}
    r = run(_request(_ingress(handles), "POST", "/v1/completions", json=body))
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    plain = run(_request(handles[0].replica.app, "POST", "/v1/completions",
                         json={**body, "stream": False}))
    assert text == plain.json()["choices"][0]["text"]


def test_the_api_key_is_checked_at_the_ingress_and_not_passed_on(handles, run):
    app = APIKeyMiddleware(_ingress(handles), "secret")
    body = {"prompt": [5], "max_tokens": 1}
    assert run(_request(app, "POST", "/v1/completions", json=body)).status_code == 401
    assert not any(h.requests for h in handles)
    ok = run(_request(app, "POST", "/v1/completions", json=body,
                      headers={"Authorization": "Bearer secret"}))
    assert ok.status_code == 200
    forwarded = [r for h in handles for r in h.requests]
    assert forwarded and all(k != b"authorization" for r in forwarded for k, _ in r["headers"])


def test_same_prefix_requests_land_on_one_replica(handles, run):
    ingress = _ingress(handles)
    for i in range(4):
        r = run(_request(ingress, "POST", "/v1/completions",
                         json={"prompt": PREFIX + [10 + i] * 8, "max_tokens": 2}))
        assert r.status_code == 200
    assert [len(h.requests) for h in handles] == [4, 0]
    other = run(_request(ingress, "POST", "/v1/completions",
                         json={"prompt": list(range(300, 380)), "max_tokens": 2}))
    assert other.status_code == 200 and len(handles[1].requests) == 1  # a miss: the emptier
    families = _families(run(_request(ingress, "GET", "/metrics")).text)
    decisions = {(s.labels["replica"], s.labels["reason"]): s.value
                 for s in families["kvserve:router_requests"].samples}
    assert decisions == {("0", "cache_miss"): 1, ("0", "cache_hit"): 3, ("1", "cache_miss"): 1}
    hits = {s.labels["replica"]: s.value for s in families["kvserve:prefix_cache_hits"].samples}
    assert hits["0"] >= 3 * 48  # each later request found at least three full KV blocks


def test_round_robin_alternates_whatever_the_prompt(handles, run):
    ingress = _ingress(handles, router="round_robin")
    for i in range(4):
        run(_request(ingress, "POST", "/v1/completions",
                     json={"prompt": PREFIX + [i], "max_tokens": 1}))
    assert [len(h.requests) for h in handles] == [2, 2]


def _families(text: str) -> dict:
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), "a family appears twice"
    return {f.name: f for f in families}


def test_metrics_label_every_replica(handles, run):
    text = run(_request(_ingress(handles), "GET", "/metrics")).text
    families = _families(text)
    running = families["kvserve:num_requests_running"]
    assert sorted(s.labels["replica"] for s in running.samples) == ["0", "1"]
    assert {s.labels["replica"]: s.value for s in families["kvserve:replica_up"].samples} \
        == {"0": 1.0, "1": 1.0}
    assert "_created" not in text


def test_a_replica_dying_mid_stream_ends_it_with_an_error_and_is_probed_back(handles, run):
    ingress = _ingress(handles)
    body = {"prompt": [5, 6], "max_tokens": 200, "ignore_eos": True, "stream": True}
    run(_request(ingress, "POST", "/v1/completions", json={**body, "max_tokens": 1}))
    handles[0].items, handles[0].fail_after = 0, 3
    r = run(_request(ingress, "POST", "/v1/completions", json=body))
    assert r.status_code == 200
    events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 2
    error = json.loads(events[-2])["error"]
    assert error["code"] == "replica_died" and "replica 0" in error["message"]
    assert ingress.up == [False, True]
    assert run(engine_settled(handles[0].replica.engine)), "the dead request's KV was not freed"

    # while replica 0 is down everything goes to replica 1
    handles[0].healthy = False
    again = run(_request(ingress, "POST", "/v1/completions",
                         json={**body, "stream": False, "max_tokens": 3}))
    assert again.status_code == 200 and len(handles[1].requests) == 1
    families = _families(run(_request(ingress, "GET", "/metrics")).text)
    assert {s.labels["replica"]: s.value for s in families["kvserve:replica_up"].samples} \
        == {"0": 0.0, "1": 1.0}
    assert {s.labels["replica"]: s.value
            for s in families["kvserve:replica_failures"].samples}["0"] == 1.0

    handles[0].fail_after, handles[0].dead, handles[0].healthy = None, False, True  # restarted

    async def probed_back():  # the probe started when replica 0 went down
        for _ in range(100):
            if ingress.up[0]:
                break
            await asyncio.sleep(0.05)
        return ingress.up[0] and ingress._probe.done()
    assert run(probed_back())
    back = run(_request(ingress, "POST", "/v1/completions",
                        json={"prompt": [5, 6], "max_tokens": 2}))
    assert back.status_code == 200 and len(handles[0].requests) == 3  # on a new channel


def test_no_replica_up_is_a_503(handles, run):
    ingress = _ingress(handles)
    ingress.up = [False, False]
    assert run(_request(ingress, "GET", "/health")).status_code == 503
    r = run(_request(ingress, "POST", "/v1/completions", json={"prompt": [5], "max_tokens": 1}))
    assert r.status_code == 503 and "no replica is up" in r.json()["error"]["message"]


def test_batch_and_stats_routes_go_where_their_state_is(handles, run):
    ingress = _ingress(handles)
    run(_request(ingress, "GET", "/v1/batches"))
    run(_request(ingress, "GET", "/v1/stats?replica=1"))
    assert [r["path"] for r in handles[0].requests] == ["/v1/batches"]
    assert [r["path"] for r in handles[1].requests] == ["/v1/stats"]
    for wanted in ("7", "%C2%B2"):  # out of range; a digit that int() refuses
        bad = run(_request(ingress, "GET", f"/v1/stats?replica={wanted}"))
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "replica"


def test_an_oversized_body_is_a_413_before_any_replica(handles, run):
    ingress = Ingress(handles, ReplicaConfig(num_replicas=2), "kvserve", max_body_bytes=100,
                      max_file_bytes=100)
    r = run(_request(ingress, "POST", "/v1/completions", json={"prompt": "x" * 200}))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert not any(h.requests for h in handles)


def _submit_long(replica, run, channel_id: str):
    request = {"method": "POST", "path": "/v1/completions", "query_string": b"",
               "headers": [(b"content-type", b"application/json")],
               "body": json.dumps({"prompt": [5, 6], "max_tokens": 400, "ignore_eos": True,
                                   "stream": True}).encode()}

    async def start():
        stream = replica.channel(channel_id)
        assert await stream.__anext__() == []  # the channel is open: submits may come
        await replica.submit(channel_id, "r1", request)
        items = [await stream.__anext__() for _ in range(3)]
        assert replica.engine.num_in_flight == 1
        return stream, [i for batch in items for i in batch]
    return run(start())


def test_cancel_aborts_the_request(handles, run):
    """What the ingress calls when its client goes away."""
    replica = handles[0].replica
    stream, items = _submit_long(replica, run, "c1")
    assert items[0][0] == "r1" and items[0][1][0] == 200  # the first chunk carries the start
    run(replica.cancel("c1", "r1"))
    assert run(engine_settled(replica.engine))
    run(stream.aclose())


def test_a_submit_on_a_channel_this_replica_does_not_have_is_refused(handles, run):
    """A process Serve started in place of the channel's: the ingress must hear of it."""
    with pytest.raises(LookupError, match="has no channel"):
        run(handles[0].replica.submit("elsewhere", "r1", {}))


def test_a_channel_closed_by_its_ingress_aborts_its_requests(handles, run):
    replica = handles[0].replica
    stream, _ = _submit_long(replica, run, "c2")
    run(stream.aclose())
    assert run(engine_settled(replica.engine))
    assert "c2" not in replica._channels


def test_a_step_of_many_requests_comes_back_in_few_channel_items(handles, run):
    ingress = _ingress(handles, router="round_robin")
    body = {"prompt": [5, 6, 7], "max_tokens": 16, "ignore_eos": True, "stream": True}
    handles[0].items = 0

    async def many():
        return await asyncio.gather(*(_request(ingress, "POST", "/v1/completions", json=body)
                                      for _ in range(8)))
    responses = run(many())
    assert all(r.text.endswith("data: [DONE]\n\n") for r in responses)
    # 4 requests on replica 0, each 16 token chunks + its end: batched, not one item each
    assert handles[0].items < 4 * 17 * 0.6


def test_a_cancelled_request_task_aborts_its_request_on_the_replica(handles, run):
    """Serve's proxy (and uvicorn at its shutdown deadline) cancel the ASGI task itself."""
    ingress = _ingress(handles, router="round_robin")
    body = {"prompt": [5, 6], "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def cancel_mid_stream():
        task = asyncio.ensure_future(_request(ingress, "POST", "/v1/completions", json=body))
        engine = handles[0].replica.engine
        for _ in range(200):
            if engine.num_in_flight:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return await engine_settled(engine)
    assert run(cancel_mid_stream()), "the replica kept generating for a cancelled request"
    assert ingress.loads == [0, 0] and not ingress._active
