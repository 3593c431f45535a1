"""LLM: the offline API, `LLM(model).generate(prompts, sampling_params)`."""
from __future__ import annotations

import time
from typing import Sequence

from tqdm.auto import tqdm

from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine, PromptType
from kvserve.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from kvserve.lora.request import LoRARequest
from kvserve.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams


class LLM:
    """Generate for a list of prompts at once, continuously batched.

    ``model=None`` uses the embedded default model. Engine settings are keyword
    arguments with EngineArgs' names (``block_size=16, max_num_seqs=64, ...``).
    """

    def __init__(self, model: str | None = None, **engine_args) -> None:
        unknown = set(engine_args) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"unknown engine argument(s) {sorted(unknown)}; "
                            f"allowed: {sorted(EngineArgs.field_names() - {'model'})}")
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))

    def reset_prefix_cache(self) -> bool:
        """Forget cached prompt blocks; False while requests are running."""
        return self.engine.reset_prefix_cache()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """``lora_request``: the adapter every prompt runs with, or one per prompt (None:
        the base model); needs ``enable_lora=True``."""
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._per_prompt(sampling_params, len(prompts))
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority has {len(priorities)} entries for {len(prompts)} prompts")
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple))
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request has {len(loras)} entries for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, sp, prio, lora in zip(prompts, params, priorities, loras):
                ids.append(self.engine.add_request(None, prompt, sp, priority=prio,
                                                   lora_request=lora))
        except Exception:
            self.engine.abort_request(ids)  # all or nothing: leave no request behind
            raise
        return self._run(ids, use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Each prompt's best ``params.beam_width`` hypotheses by beam search, as
        transformers' ``generate(num_beams=...)`` finds them (see beam_search.py)."""
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        engine = self.engine
        token_ids = []
        for prompt in prompts:
            _, ids = engine.tokenize_prompt(prompt)
            engine.validate_prompt(ids, SamplingParams(max_tokens=params.max_tokens))
            token_ids.append(ids)
        return beam_search(self, token_ids, params, engine.stop_ids)

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | None = None, use_tqdm: bool = True
              ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding: its hidden states pooled as the model's pooling
        config (or ``pooling_params``) says, as vLLM's ``LLM.embed``."""
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = []
        try:
            for prompt in prompts:
                ids.append(self.engine.add_request(None, prompt,
                                                   pooling_params or PoolingParams()))
        except Exception:
            self.engine.abort_request(ids)
            raise
        return [EmbeddingRequestOutput(out.request_id, out.prompt_token_ids,
                                       EmbeddingOutput(out.pooled))
                for out in self._run(ids, use_tqdm)]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None,
             chat_template: str | None = None) -> list[RequestOutput]:
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tok = self.engine.tokenizer
        prompts = [{"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}
                   for text in (tok.apply_chat_template(
                       c, add_generation_prompt, continue_final_message=continue_final_message,
                       template_kwargs=chat_template_kwargs, chat_template=chat_template)
                       for c in conversations)]
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's recommended fields (``generation_config``),
        what ``generate`` uses when given none."""
        return SamplingParams(**self.engine.config.model.sampling_defaults)

    def _per_prompt(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling_params for {n} prompts")
        return params

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True,
                   disable=not use_tqdm)
        start = time.perf_counter()
        in_tokens = out_tokens = 0
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if not out.finished:
                    continue
                done[out.request_id] = out
                in_tokens += len(out.prompt_token_ids)
                out_tokens += sum(len(o.token_ids) for o in out.outputs)
                elapsed = time.perf_counter() - start
                bar.set_postfix_str(f"est. speed input: {in_tokens / elapsed:.2f} toks/s, "
                                    f"output: {out_tokens / elapsed:.2f} toks/s")
                bar.update(1)
        bar.close()
        return [done[i] for i in ids]
