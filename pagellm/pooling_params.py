"""An embedding request's settings (vLLM's PoolingParams): what LLM.embed and POST
/v1/embeddings pool from a prompt.

The embedding is the hidden state of the prompt's last token after the model's final norm
(last-token pooling, what decoder embedding models such as Qwen3-Embedding, gte-Qwen2 and
e5-mistral are trained for), its first `dimensions` values where given (Matryoshka models
keep their meaning in a prefix), then scaled to unit length unless normalize is False."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolingParams:
    normalize: bool = True
    dimensions: int | None = None
    n = 1  # one output a prompt (what the server counts as a request's sequences)

    def __post_init__(self) -> None:
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool)
                                            or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
