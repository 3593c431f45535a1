"""``kvserve run-batch``: a Batch API input file run offline, output in input order."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvserve.entrypoints.openai.run_batch import parse_mixed_input, run_batch
from kvserve.engine.engine_args import EngineArgs

REPO = Path(__file__).resolve().parents[2]
NAME = "m"  # --served-model-name
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPTS = ["The quick brown fox", "Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,",
           "Hello", "In the beginning", "import numpy as np", "The capital of France is",
           "A B C D", "Roses are red"]


def completion_body(i: int, **changes) -> dict:
    return {"model": NAME, "prompt": PROMPTS[i], "max_tokens": 4 + i % 5, "temperature": 0,
            **changes}


def chat_body(i: int, **changes) -> dict:
    return {"model": NAME, "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": f"Question {i}: why?"}], **changes}


def line(custom_id: str, url: str, body: dict, **extra) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body,
                       **extra})


def write(path: Path, rows: list[str]) -> Path:
    path.write_text("\n".join(rows) + "\n")
    return path


def read(path: Path) -> list[dict]:
    return [json.loads(row) for row in path.read_text().splitlines()]


def run(llama_dir: str, src: Path, dst: Path, **kw) -> int:
    return run_batch(str(src), str(dst), EngineArgs(model=llama_dir, num_threads=1), NAME,
                     progress=False, **kw)


def test_mixed_file_matches_generate(llama_dir, tmp_path, capsys):
    from kvserve import LLM, SamplingParams

    rows = []  # 10 completions and 4 chat lines, interleaved
    for i in range(10):
        rows.append(line(f"cmpl-{i}", CMPL, completion_body(i)))
        if i % 3 == 0:
            rows.append(line(f"chat-{i}", CHAT, chat_body(i)))
    src, dst = write(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    assert run(llama_dir, src, dst, summary_json=str(tmp_path / "summary.json")) == 0

    out = read(dst)
    assert [o["custom_id"] for o in out] == [json.loads(r)["custom_id"] for r in rows]
    assert len({o["id"] for o in out}) == len(out) == 14
    assert all(o["id"].startswith("batch_req_") and o["error"] is None for o in out)
    responses = {o["custom_id"]: o["response"] for o in out}
    for cid, r in responses.items():
        assert r["status_code"] == 200
        body = r["body"]
        assert body["object"] == ("text_completion" if cid.startswith("cmpl")
                                  else "chat.completion")
        assert body["model"] == NAME and r["request_id"] == body["id"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["lines"], summary["ok"], summary["failed"]) == (14, 14, 0)
    assert summary["output_tokens"] == sum(r["body"]["usage"]["completion_tokens"]
                                           for r in responses.values())
    assert "14 lines: 14 ok, 0 failed" in capsys.readouterr().out

    bodies = [completion_body(i) for i in range(10)]
    want = LLM(llama_dir).generate([b["prompt"] for b in bodies],
                                   [SamplingParams(temperature=0, max_tokens=b["max_tokens"])
                                    for b in bodies], use_tqdm=False)
    for i, ref in enumerate(want):
        assert responses[f"cmpl-{i}"]["body"]["choices"][0]["text"] == ref.outputs[0].text, i


def test_bad_line_gets_its_error_others_succeed(llama_dir, tmp_path):
    src = write(tmp_path / "in.jsonl", [
        line("a", CMPL, completion_body(1)),
        line("bad", CMPL, completion_body(0, max_tokens=-1)),
        line("wrong-model", CHAT, chat_body(0, model="other")),
        line("c", CHAT, chat_body(2))])
    dst = tmp_path / "out.jsonl"
    assert run(llama_dir, src, dst) == 0
    out = {o["custom_id"]: o["response"] for o in read(dst)}
    assert list(out) == ["a", "bad", "wrong-model", "c"]
    assert out["bad"]["status_code"] == 400
    error = out["bad"]["body"]["error"]
    assert error["type"] == "invalid_request_error" and "max_tokens" in error["message"]
    assert out["wrong-model"]["status_code"] == 404  # the model check, as on the server
    assert out["wrong-model"]["body"]["error"]["code"] == "model_not_found"
    assert out["a"]["status_code"] == out["c"]["status_code"] == 200
    assert out["a"]["body"]["choices"][0]["text"]


def test_invalid_file_runs_nothing(tmp_path, capsys):
    src = write(tmp_path / "in.jsonl", [
        line("a", CMPL, completion_body(0)),
        "{not json",
        line("b", "/v1/embeddings", {"model": NAME, "input": "x"}),
        line("a", CHAT, chat_body(0)),  # 'a' again, for the other endpoint
        line("c", CHAT, chat_body(1))])
    dst = tmp_path / "out.jsonl"
    # refused before any model loads: a model path that does not exist never matters
    code = run_batch(str(src), str(dst), EngineArgs(model=str(tmp_path / "no-model")), NAME,
                     progress=False)
    assert code != 0
    assert list(tmp_path.iterdir()) == [src]  # no output, no temporary file
    err = capsys.readouterr().err
    assert f"{src}:2: invalid_json" in err
    assert f"{src}:3: invalid_url" in err and "/v1/embeddings" in err
    assert f"{src}:4: duplicate_custom_id" in err
    assert f"{src}:1:" not in err and f"{src}:5:" not in err


def test_parse_mixed_input():
    rows = [line("a", CHAT, chat_body(0)),
            line("b", CMPL, completion_body(0)),
            "",
            line("c", CMPL, completion_body(1, stream=True)),
            line("b", CMPL, completion_body(2)),
            line("d", CMPL, completion_body(3), method="GET"),
            line("e", "/v1/responses", completion_body(4))]
    lines, errors = parse_mixed_input("\n".join(rows).encode())
    assert [(b.endpoint, b.line.custom_id, b.line.line) for b in lines] == [
        (CHAT, "a", 1), (CMPL, "b", 2)]
    assert [(e["line"], e["code"]) for e in errors] == [
        (4, "invalid_body"), (5, "duplicate_custom_id"), (6, "invalid_method"),
        (7, "invalid_url")]
    assert "one of ['/v1/completions', '/v1/chat/completions']" in errors[-1]["message"]
    assert parse_mixed_input(b"\n\n")[1][0]["code"] == "empty_file"


def test_cli(llama_dir, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvserve.cli", "run-batch",
                               *args], check=False, cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=120)

    src = write(tmp_path / "in.jsonl", [line("x", CMPL, completion_body(0)),
                                        line("y", CHAT, chat_body(0))])
    dst = tmp_path / "out.jsonl"
    done = cli("-i", str(src), "-o", str(dst), llama_dir, "--served-model-name", NAME,
               "--num-threads", "1")
    assert done.returncode == 0, done.stderr
    assert "2 lines: 2 ok, 0 failed" in done.stdout
    out = read(dst)
    assert [o["custom_id"] for o in out] == ["x", "y"]
    assert [o["response"]["status_code"] for o in out] == [200, 200]
    assert "Running batch" not in done.stderr  # no progress bar: stderr is not a terminal

    bad = write(tmp_path / "bad.jsonl", [line("x", CMPL, completion_body(0)), "[]"])
    done = cli("-i", str(bad), "-o", str(tmp_path / "bad-out.jsonl"), llama_dir)
    assert done.returncode == 1 and f"{bad}:2: invalid_request" in done.stderr
    assert not (tmp_path / "bad-out.jsonl").exists()
