"""The OpenAI Files and Batch API on a live server: /v1/files and /v1/batches.

One module-scoped server (its own --state-dir) serves these tests;
test_batch_durability.py kills and restarts servers of its own.
"""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.entrypoints.batch_client import MODEL, TERMINAL, completion_body, jsonl, line, \
    make_client, read_lines, upload, wait_batch
from tests.entrypoints.conftest import served


@pytest.fixture(scope="module")
def srv(llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch_api")
    yield from served(llama_dir, tmp / "server.log", "--served-model-name", MODEL,
                      "--state-dir", str(tmp / "state"), "--max-batch-lines-in-flight", "4")


@pytest.fixture(scope="module")
def client(srv):
    with make_client(srv.url) as c:
        yield c


# -- 1. files --------------------------------------------------------------------------------

def test_files_upload_list_retrieve_content_delete(srv, client):
    payloads = [jsonl([line(f"f{k}-{i}", completion_body(i)) for i in range(k + 1)])
                for k in range(3)]
    uploaded = [client.files.create(file=(f"in{k}.jsonl", data), purpose="batch")
                for k, data in enumerate(payloads)]
    ids = [f.id for f in uploaded]
    assert len(set(ids)) == 3
    for f, data, k in zip(uploaded, payloads, range(3)):
        assert f.object == "file" and f.purpose == "batch" and f.bytes == len(data)
        assert f.filename == f"in{k}.jsonl" and f.id.startswith("file-")
        got = client.files.retrieve(f.id)
        assert got.model_dump() == f.model_dump()
        content = client.files.content(f.id)
        assert content.content == data  # byte for byte

    # purpose filter: every listed file has that purpose
    listed = client.files.list(purpose="batch")
    assert {f.purpose for f in listed.data} == {"batch"}
    assert set(ids) <= {f.id for f in listed.data}
    assert not set(ids) & {f.id for f in client.files.list(purpose="batch_output").data}

    # pagination by hand: pages of 2, each page's last id is the next page's after
    seen, after, pages = [], None, 0
    while True:
        query = {"purpose": "batch", "limit": 2, **({"after": after} if after else {})}
        page = httpx.get(f"{srv.url}/v1/files", params=query, timeout=10).json()
        assert page["object"] == "list" and len(page["data"]) <= 2
        seen += [f["id"] for f in page["data"]]
        pages += 1
        if not page["has_more"]:
            break
        assert len(page["data"]) == 2 and page["last_id"] == page["data"][-1]["id"]
        after = page["last_id"]
    assert pages >= 2 and len(seen) == len(set(seen)) and set(ids) <= set(seen)
    # ... and the client's auto-pagination over after/limit finds the same files
    auto = [f.id for f in client.files.list(purpose="batch", limit=1)]
    assert auto == seen
    first = client.files.list(purpose="batch", limit=1)
    assert len(first.data) == 1 and first.has_more
    assert client.files.list(purpose="batch", limit=1, after=first.data[0].id).data[0].id \
        == seen[1]

    # delete, then 404 everywhere
    gone = client.files.delete(ids[0])
    assert gone.id == ids[0] and gone.deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(ids[0])
    with pytest.raises(openai.NotFoundError):
        client.files.content(ids[0])
    with pytest.raises(openai.NotFoundError):
        client.files.delete(ids[0])
    assert ids[0] not in {f.id for f in client.files.list(purpose="batch")}
    assert client.files.content(ids[1]).content == payloads[1]  # the others untouched


def test_files_wrong_purpose_and_not_multipart(srv, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert e.value.status_code == 400
    err = e.value.body
    assert err["param"] == "purpose" and "batch" in err["message"] \
        and "fine-tune" in err["message"]

    r = httpx.post(f"{srv.url}/v1/files", json={"purpose": "batch", "file": "x"}, timeout=10)
    assert r.status_code == 415
    assert "multipart/form-data" in r.json()["error"]["message"]

    r = httpx.post(f"{srv.url}/v1/files", data={"purpose": "batch"},
                   files={"other": ("x", b"y")}, timeout=10)  # multipart, but no 'file'
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"

    # malformed forms are the client's error (400), never a 500
    r = httpx.post(f"{srv.url}/v1/files", data={"purpose": "batch"},
                   files=[("file", ("a", b"x")), ("file", ("b", b"y"))], timeout=10)
    assert r.status_code == 400 and "files" in r.json()["error"]["message"]
    for ctype in ("multipart/form-data", "multipart/form-data; boundary=xyz"):
        r = httpx.post(f"{srv.url}/v1/files", content=b"garbage",
                       headers={"content-type": ctype}, timeout=10)
        assert r.status_code == 400, (ctype, r.text)

    with pytest.raises(openai.NotFoundError):
        client.files.retrieve("file-doesnotexist")


# -- 2. a completions batch and a chat batch -------------------------------------------------

BAD_LINE = 5  # 1-based line of the 12 with max_tokens -1


def test_completions_batch(srv, client):
    rows = [line(f"req-{i}", completion_body(i, max_tokens=4 + i % 5)) for i in range(12)]
    rows[BAD_LINE - 1]["body"]["max_tokens"] = -1
    f = upload(client, rows)
    meta = {"project": "tests", "run": "1"}
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                  completion_window="24h", metadata=meta)
    assert batch.object == "batch" and batch.id.startswith("batch_")
    assert batch.status in ("validating", "in_progress", "finalizing", "completed")
    assert batch.input_file_id == f.id and batch.endpoint == "/v1/completions"
    assert batch.completion_window == "24h" and batch.metadata == meta

    batch = wait_batch(client, batch.id)
    assert batch.status == "completed", batch
    assert batch.errors is None and batch.metadata == meta
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (12, 11, 1)
    assert batch.completed_at and batch.in_progress_at and batch.finalizing_at
    assert batch.created_at <= batch.in_progress_at <= batch.completed_at
    assert batch.output_file_id and batch.error_file_id

    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    out = read_lines(client, batch.output_file_id)
    err = read_lines(client, batch.error_file_id)
    ids = [r["custom_id"] for r in out + err]
    assert sorted(ids) == sorted(r["custom_id"] for r in rows)  # each exactly once
    assert len({r["id"] for r in out + err}) == 12

    by_id = {r["custom_id"]: r for r in rows}
    for r in out:
        assert r["error"] is None and r["id"].startswith("batch_req_")
        resp = r["response"]
        assert resp["status_code"] == 200
        body = resp["body"]
        assert body["object"] == "text_completion" and resp["request_id"] == body["id"]
        assert body["model"] == MODEL and len(body["choices"]) == 1
        sent = by_id[r["custom_id"]]["body"]
        assert body["usage"]["completion_tokens"] <= sent["max_tokens"]
        assert body["usage"]["total_tokens"] == (body["usage"]["prompt_tokens"]
                                                 + body["usage"]["completion_tokens"])
        direct = httpx.post(f"{srv.url}/v1/completions", json=sent, timeout=30)
        assert direct.status_code == 200
        direct = direct.json()
        assert body["choices"] == direct["choices"]  # same text at temperature 0
        assert body["usage"] == direct["usage"]

    (bad,) = err
    assert bad["custom_id"] == f"req-{BAD_LINE - 1}" and bad["error"] is None
    assert bad["response"]["status_code"] == 400
    direct = httpx.post(f"{srv.url}/v1/completions", json=rows[BAD_LINE - 1]["body"],
                        timeout=30)
    assert direct.status_code == 400
    assert bad["response"]["body"] == direct.json()  # the server's own error body
    assert bad["response"]["body"]["error"]["param"] == "max_tokens"

    # listed, newest first, with pagination
    assert batch.id in {b.id for b in client.batches.list(limit=100)}
    page = httpx.get(f"{srv.url}/v1/batches", params={"limit": 1}, timeout=10).json()
    assert page["object"] == "list" and len(page["data"]) == 1
    walked, after = [], None
    while True:
        page = client.batches.list(limit=1, **({"after": after} if after else {}))
        walked += [b.id for b in page.data]
        if not page.has_more:
            break
        after = page.data[-1].id
    assert batch.id in walked and len(walked) == len(set(walked))
    assert [b.id for b in client.batches.list(limit=1)] == walked  # auto-pagination

    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_doesnotexist")
    r = httpx.get(f"{srv.url}/v1/batches", params={"after": "batch_doesnotexist"},
                  timeout=10)
    assert r.status_code == 400


def test_chat_batch(srv, client):
    url = "/v1/chat/completions"
    bodies = [{"model": MODEL, "max_tokens": 6, "temperature": 0,
               "messages": [{"role": "user", "content": f"count to {i}"}]} for i in range(4)]
    f = upload(client, [line(f"chat-{i}", b, url) for i, b in enumerate(bodies)])
    batch = client.batches.create(input_file_id=f.id, endpoint=url, completion_window="24h")
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed" and batch.metadata is None
    assert (batch.request_counts.total, batch.request_counts.completed,
            batch.request_counts.failed) == (4, 4, 0)
    assert batch.error_file_id is None
    out = read_lines(client, batch.output_file_id)
    assert sorted(r["custom_id"] for r in out) == [f"chat-{i}" for i in range(4)]
    for r in out:
        body = r["response"]["body"]
        assert r["response"]["status_code"] == 200
        assert body["object"] == "chat.completion" and "usage" in body
        assert body["choices"][0]["message"]["role"] == "assistant"
        direct = httpx.post(f"{srv.url}{url}", json=bodies[int(r["custom_id"][5:])],
                            timeout=30).json()
        assert body["choices"] == direct["choices"] and body["usage"] == direct["usage"]


# -- 3. validation ---------------------------------------------------------------------------

def test_invalid_input_lines_fail_the_batch(srv, client):
    rows = [
        line("a", completion_body(0)),                                  # 1 fine
        '{"custom_id": "b", "method": "POST", "url": ',                # 2 not JSON
        line("c", completion_body(2), url="/v1/chat/completions"),     # 3 other url
        line("a", completion_body(3)),                                  # 4 duplicate
        line("e", completion_body(4, stream=True)),                     # 5 streams
        line("f", completion_body(5)),                                  # 6 fine
    ]
    f = upload(client, rows)
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                  completion_window="24h")
    batch = wait_batch(client, batch.id, timeout=10)  # failed at once: nothing runs
    assert batch.status == "failed" and batch.failed_at
    assert batch.output_file_id is None and batch.error_file_id is None
    assert batch.request_counts.completed == 0
    problems = {(e.line, e.code) for e in batch.errors.data}
    assert problems == {(2, "invalid_json"), (3, "invalid_url"),
                        (4, "duplicate_custom_id"), (5, "invalid_body")}, batch.errors
    by_line = {e.line: e for e in batch.errors.data}
    assert by_line[3].param == "url" and "/v1/completions" in by_line[3].message
    assert by_line[4].param == "custom_id" and "'a'" in by_line[4].message
    assert by_line[5].param == "body.stream"
    # a failed batch cannot be cancelled
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_create_batch_request_validation(srv, client):
    f = upload(client, [line("x", completion_body(0))])
    base = {"input_file_id": f.id, "endpoint": "/v1/completions", "completion_window": "24h"}
    cases = [
        ({**base, "endpoint": "/v1/embeddings"}, "endpoint"),
        ({**base, "completion_window": "48h"}, "completion_window"),
        ({**base, "priority": "high"}, "priority"),
    ]
    for body, param in cases:
        r = httpx.post(f"{srv.url}/v1/batches", json=body, timeout=10)
        assert r.status_code == 400, (body, r.text)
        assert param in json.dumps(r.json()["error"]), (body, r.text)
    with pytest.raises(openai.BadRequestError):  # the client sends it too
        client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings",
                              completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-doesnotexist", endpoint="/v1/completions",
                              completion_window="24h")


# -- 4. cancel -------------------------------------------------------------------------------

def test_cancel(srv, client):
    n = 12
    rows = [line(f"long-{i}", completion_body(i, max_tokens=200, ignore_eos=True))
            for i in range(n)]
    f = upload(client, rows)
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                  completion_window="24h")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    batch = wait_batch(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    assert batch.cancelled_at >= batch.cancelling_at

    out = read_lines(client, batch.output_file_id)
    err = read_lines(client, batch.error_file_id)
    assert sorted(r["custom_id"] for r in out + err) == sorted(r["custom_id"] for r in rows)
    unrun = [r for r in err if r["response"] is None]
    assert unrun, "cancelled right away: some lines never ran"
    for r in unrun:
        assert r["error"]["code"] == "batch_cancelled" and r["error"]["message"]
    for r in out:
        assert r["response"]["status_code"] == 200
        assert r["response"]["body"]["usage"]["completion_tokens"] == 200
    counts = batch.request_counts
    assert counts.total == n and counts.completed == len(out)
    assert counts.completed + counts.failed + len(unrun) == n

    with pytest.raises(openai.ConflictError):  # cancelled already
        client.batches.cancel(batch.id)

    f = upload(client, [line("one", completion_body(0, max_tokens=4))])
    done = client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                 completion_window="24h")
    done = wait_batch(client, done.id)
    assert done.status == "completed"
    with pytest.raises(openai.ConflictError) as e:
        client.batches.cancel(done.id)
    assert e.value.status_code == 409
    assert client.batches.retrieve(done.id).status == "completed"
    with pytest.raises(openai.NotFoundError):
        client.batches.cancel("batch_doesnotexist")


# -- 6. metrics and stats --------------------------------------------------------------------

def test_metrics_and_stats_while_a_batch_runs(srv, client):
    finished = "kvserve:batch_lines_finished_total{outcome=\"completed\"}"
    running = "kvserve:batch_lines{state=\"running\"}"
    before = srv.metrics()
    assert running in before and finished in before
    stats = httpx.get(f"{srv.url}/v1/stats", timeout=10).json()
    assert set(stats["batch"]) >= {"queued", "running", "done", "failed"}

    n = 8
    f = upload(client, [line(f"m-{i}", completion_body(i, max_tokens=120, ignore_eos=True))
                        for i in range(n)])
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                  completion_window="24h")
    saw_gauge = saw_stats = saw_moving = False
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        sample = srv.metrics()
        stats = httpx.get(f"{srv.url}/v1/stats", timeout=10).json()["batch"]
        assert stats is not None
        saw_gauge |= sample[running] > 0
        saw_stats |= stats["running"] > 0 or stats["queued"] > 0
        saw_moving |= before[finished] < sample[finished] < before[finished] + n
        if client.batches.retrieve(batch.id).status in TERMINAL:
            break
        time.sleep(0.02)
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed"
    assert saw_gauge or saw_moving, "neither the running gauge nor the counter moved"
    assert saw_stats or saw_moving
    after = srv.metrics()
    assert after[finished] - before[finished] == n
    assert after[running] == 0
    stats = httpx.get(f"{srv.url}/v1/stats", timeout=10).json()["batch"]
    assert stats["running"] == 0 and stats["queued"] == 0 and stats["done"] >= n
