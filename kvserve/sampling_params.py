"""Sampling parameters, named and validated as in vLLM."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvserve.structured_output.params import StructuredOutputsParams

_MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
_MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy. Every field is checked in ``__post_init__``;
    an invalid value raises ``ValueError`` naming the field and the allowed range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, [-100, 100]
    prompt_logprobs: int | None = None  # each prompt token's logprob, plus this many top ones
    # token sequences never generated: a one-token sequence is banned everywhere, a longer
    # one's last token where the output ends with the rest (vLLM's bad_words, tokenized)
    bad_words_token_ids: list[list[int]] | None = None
    structured_outputs: StructuredOutputsParams | None = None  # the output matches this
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stop_list = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _check_int("n", self.n, low=1)
        _check_number("temperature", self.temperature, low=0.0, high=None)
        _check_number("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_int("top_k", self.top_k, low=0, hint="-1 or 0 (disabled) or a positive integer")
        _check_number("min_p", self.min_p, low=0.0, high=1.0)
        _check_number("repetition_penalty", self.repetition_penalty, low=0.0, high=None, low_open=True)
        _check_number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=2**63 - 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        for seq in self.bad_words_token_ids or ():
            if not seq or not all(isinstance(t, int) and t >= 0 for t in seq):
                raise ValueError(f"bad_words_token_ids must hold non-empty lists of token ids, "
                                 f"got {seq!r:.80}")
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        if len(self.stop_list) > _MAX_STOP_STRINGS:
            raise ValueError(
                f"stop may hold at most {_MAX_STOP_STRINGS} strings, got {len(self.stop_list)}")
        for s in self.stop_list:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, low=0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must map token ids to biases, got "
                                 f"{self.logit_bias!r:.80}")
            if len(self.logit_bias) > _MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias may hold at most {_MAX_LOGIT_BIAS} tokens, got "
                                 f"{len(self.logit_bias)}")
            for token, bias in self.logit_bias.items():
                _check_int("logit_bias token id", token, low=0)
                _check_number("logit_bias value", bias, low=-100.0, high=100.0)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def for_child(self, index: int) -> SamplingParams:
        """Parameters of the ``index``-th of ``n`` samples: n=1 and a distinct seed."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed, stop=list(self.stop_list))


def _check_int(name: str, value: object, low: int, high: int | None = None,
               hint: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        allowed = hint or (f">= {low}" if high is None else f"in [{low}, {high}]")
        raise ValueError(f"{name} must be {allowed}, got {value}")


def _check_number(name: str, value: object, low: float, high: float | None,
                  low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    too_low = value <= low if low_open else value < low
    if too_low or (high is not None and value > high):
        left = "(" if low_open else "["
        right = f"{high}]" if high is not None else "inf)"
        raise ValueError(f"{name} must be in {left}{low}, {right}, got {value}")
