"""pagellm: a small LLM inference and serving engine with a paged KV cache."""
from pagellm.llm import LLM
from pagellm.lora import LoRARequest
from pagellm.outputs import CompletionOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "PoolingParams", "RequestOutput", "CompletionOutput",
           "EmbeddingRequestOutput", "LoRARequest", "Logprob"]
__version__ = "0.1.0"
