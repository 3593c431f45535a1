"""A batch survives its server: SIGKILLed twice mid-batch and restarted on the same
--state-dir, it completes every line once, none lost, none repeated."""
from __future__ import annotations

import random
import time

import httpx
import pytest

from tests.entrypoints.batch_client import MODEL, completion_body, line, make_client, \
    read_lines, upload, wait_batch
from tests.entrypoints.conftest import ServerProcess


@pytest.mark.slow  # (15-25 s: `make test` stays near 10 minutes)
def test_batch_survives_sigkill(llama_dir, tmp_path):
    rng = random.Random(20240611)
    state = tmp_path / "state"
    flags = ("--served-model-name", MODEL, "--state-dir", str(state),
             "--max-batch-lines-in-flight", "1")
    n, tokens = 40, 96  # lines long enough that both kills land mid-batch
    rows = [line(f"dur-{i:02d}", completion_body(i, max_tokens=tokens, ignore_eos=True))
            for i in range(n)]

    def start(k: int) -> ServerProcess:
        """A server on the state dir, polled for health every few ms: a restarted one
        resumes the batch at once, so the test must catch it early."""
        server = ServerProcess(llama_dir, tmp_path / f"server{k}.log", *flags)
        deadline = time.monotonic() + 90
        while True:
            assert server.proc.poll() is None, server.log()
            assert time.monotonic() < deadline, server.log()
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
            time.sleep(0.005)

    def counts(server: ServerProcess, batch_id: str) -> dict:
        b = httpx.get(f"{server.url}/v1/batches/{batch_id}", timeout=10).json()
        return {"status": b["status"], **b["request_counts"]}

    server = start(0)
    kills = []
    try:
        with make_client(server.url) as c:
            f = upload(c, rows)
            batch_id = c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                        completion_window="24h", metadata={"k": "v"}).id
        last = 0
        for k in range(2):
            # wait until this server has finished some lines itself, then a random delay
            target = last + rng.randint(1, 4)
            deadline = time.monotonic() + 30
            while (seen := counts(server, batch_id))["completed"] < target:
                assert seen["status"] == "in_progress", seen
                assert time.monotonic() < deadline, seen
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.06))
            seen = counts(server, batch_id)
            server.proc.kill()  # SIGKILL: no shutdown, no flush
            server.proc.wait(10)
            server.terminate()  # closes the log
            kills.append(seen)
            server = start(k + 1)
            now = counts(server, batch_id)
            # nothing committed is lost across the kill
            assert now["completed"] >= seen["completed"] and now["total"] == n, (seen, now)
            last = now["completed"]
        # both kills landed mid-batch (one line in flight, some done, some queued)
        assert all(s["status"] == "in_progress" and 0 < s["completed"] < n for s in kills), \
            kills

        with make_client(server.url) as c:
            batch = wait_batch(c, batch_id, timeout=60)
            assert batch.status == "completed", batch
            assert batch.metadata == {"k": "v"}
            rc = batch.request_counts
            assert (rc.total, rc.completed, rc.failed) == (n, n, 0)
            out = read_lines(c, batch.output_file_id)
            err = read_lines(c, batch.error_file_id)
            assert batch.error_file_id is None and not err
            ids = [r["custom_id"] for r in out + err]
            assert len(ids) == len(set(ids)) == n  # no duplicate ...
            assert set(ids) == {r["custom_id"] for r in rows}  # ... and no loss
            assert len({r["id"] for r in out}) == n
            for r in out:
                assert r["error"] is None and r["response"]["status_code"] == 200
                body = r["response"]["body"]
                assert body["usage"]["completion_tokens"] == tokens
                # a line re-run after a kill answers as a direct request does
                sent = rows[int(r["custom_id"][4:])]["body"]
                direct = httpx.post(f"{server.url}/v1/completions", json=sent, timeout=30)
                assert body["choices"] == direct.json()["choices"]
    finally:
        server.terminate()
