"""Fixtures for the bench tests: a tiny tokenizer directory and a tiny bench model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SPECIALS = ("<|endoftext|>", "<|pad|>")


def build_tiny_tokenizer(out: Path, n_words: int = 60) -> Path:
    """A word-level tokenizer: 2 special tokens (ids 0, 1) and ``n_words`` words."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"w{i}": len(SPECIALS) + i for i in range(n_words)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(SPECIALS))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|pad|>",
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    (out / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    from kvserve.bench.workloads.models import BenchModelSpec, make_bench_model

    spec = BenchModelSpec(32, 2, 4, 2, 64, vocab_size=96, max_position_embeddings=256)
    return make_bench_model(spec, tmp_path_factory.mktemp("model"), tiny_tokenizer_dir)


def process_state(pid: int) -> str:
    """The process's state letter from /proc (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def record_served(monkeypatch: pytest.MonkeyPatch, started: dict) -> list[tuple[str, int]]:
    """Wrap the bench client: each run is checked to hit the one server of ``started``
    (name -> server) not paused, and recorded as (name, requests) in the list returned."""
    from kvserve.bench.instruments import serve

    served: list[tuple[str, int]] = []
    real_run = serve.run_serve

    def run(requests, base_url, **kwargs):
        hit = next(n for n, s in started.items() if s.url == base_url)
        paused = [n for n in started if n != hit]
        assert process_state(started[hit].proc.pid) != "T"
        assert all(process_state(started[n].proc.pid) == "T" for n in paused)
        served.append((hit, len(requests)))
        return real_run(requests, base_url=base_url, **kwargs)
    monkeypatch.setattr(serve, "run_serve", run)
    return served
