"""kvserve: an LLM inference and serving engine.

    from kvserve import LLM, SamplingParams
    llm = LLM()  # the embedded default model
    print(llm.generate("def fibonacci(n):", SamplingParams(temperature=0))[0].outputs[0].text)
"""
from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.llm import LLM
from kvserve.default_model import default_draft_model_dir, default_model_dir
from kvserve.lora.request import LoRARequest
from kvserve.outputs import CompletionOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "PoolingParams", "EngineArgs", "LoRARequest", "RequestOutput",
           "EmbeddingRequestOutput", "CompletionOutput",
           "Logprob", "default_model_dir", "default_draft_model_dir", "__version__"]
