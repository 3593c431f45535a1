"""Prompts as the engine takes them: read from a warm-up file, tokenized, checked
against the model; and the tokens that end a generation."""
from __future__ import annotations

import json
from pathlib import Path

from kvserve.model.tokenizer import Tokenizer
from kvserve.sampling_params import SamplingParams

PromptType = str | list[int] | dict


def read_prompt_file(path: str) -> list[str | dict]:
    """Prompts, one per line: plain text, or JSON objects with 'prompt' or
    'prompt_token_ids' (JSONL). Blank lines are skipped."""
    prompts: list[str | dict] = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            prompts.append(json.loads(line))
        else:
            prompts.append(line.replace("\\n", "\n"))
    if not prompts:
        raise ValueError(f"warm-up prompt file {path} holds no prompt")
    return prompts


def stop_token_ids(model_dir: Path, config_eos: tuple[int, ...], tokenizer: Tokenizer
                   ) -> tuple[int | None, list[int]]:
    """(the EOS token, the other ids that end a generation) from config.json's,
    generation_config.json's and the tokenizer's EOS tokens."""
    ids = list(config_eos)
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    primary = tokenizer.eos_token_id
    if primary is None and ids:
        primary = ids[0]
    return primary, sorted({i for i in ids if i != primary})


def tokenize_prompt(tokenizer: Tokenizer, prompt: PromptType) -> tuple[str | None, list[int]]:
    """(its text if it has one, its token ids)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, list):
        return None, list(prompt)
    raise ValueError(f"prompt must be a string, a list of token ids or a dict, "
                     f"got {type(prompt).__name__}")


def validate_prompt(token_ids: list[int], params: SamplingParams, vocab: int,
                    max_model_len: int) -> int:
    """Checks the prompt against the model's vocabulary and length; returns the resolved
    max_tokens."""
    if not token_ids:
        raise ValueError("prompt must not be empty")
    bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool)
           or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
    outside = [t for t in (params.logit_bias or {}) if t >= vocab]
    if outside:
        raise ValueError(f"logit_bias token ids must be in [0, {vocab}); got {outside[:5]}")
    n = len(token_ids)
    if n >= max_model_len:
        raise ValueError(f"prompt has {n} tokens but max_model_len is {max_model_len}: "
                         "it must be shorter to leave room for at least one new token")
    room = max_model_len - n
    if params.max_tokens is None:
        return room
    if params.max_tokens > room:
        raise ValueError(
            f"prompt has {n} tokens and max_tokens is {params.max_tokens}: together "
            f"{n + params.max_tokens} exceed max_model_len {max_model_len}")
    return params.max_tokens
