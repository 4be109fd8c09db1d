"""An embedding table kept as the GGUF file's blocks (kernels/cpu_dequant.c decodes the rows a
step looks up). An untied embedding is only ever read a row per token, so its dense copy is
memory for nothing: Qwen2.5-Coder-1.5B Q4_K_M's 151,936 x 1,536 table is 445 MiB in bf16 and
125 MiB as the file's Q4_K blocks; a Llama-3-8B's ~1 GiB in bf16. The rows decoded are
gguf.quants.dequantize's bit for bit, then rounded to the model's dtype, as a dense table of
the same file would hold them. A tied embedding is the LM head, whose products need it dense:
that one stays an nn.Embedding."""
from __future__ import annotations

import torch
from torch import nn

from pagellm.kernels import native
from pagellm.layers import quant


class BlockEmbedding(nn.Module):
    def __init__(self, blocks: quant.GGUFBlocks, dtype: torch.dtype):
        super().__init__()
        values, nbytes = blocks.unit
        if blocks.cols % values or blocks.raw.shape[1] != blocks.cols // values * nbytes:
            raise ValueError(f"embedding: {blocks.raw.shape[1]} bytes a row are not "
                             f"{blocks.cols} values of {blocks.ggml_type.name}")
        self.ggml_type = int(blocks.ggml_type)
        self.num_embeddings, self.embedding_dim = blocks.shape
        # buffers, not parameters: the module's .to() moves the blocks (uint8: no dtype
        # change) and converts the empty probe, whose dtype is the lookups' output dtype
        self.register_buffer("raw", blocks.raw.contiguous(), persistent=False)
        self.register_buffer("_probe", torch.empty(0, dtype=dtype), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self._probe.dtype

    @classmethod
    def available(cls, blocks) -> bool:
        """Whether rows of these blocks can be decoded here (the native kernels)."""
        return (isinstance(blocks, quant.GGUFBlocks) and blocks.raw.device.type == "cpu"
                and native.available() and blocks.ggml_type in quant.GGUF_PACKED_TYPES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., embedding_dim]
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        if flat.numel():  # the kernel reads rows by id: one past the table reads other memory
            low, high = torch.aminmax(flat)
            if low < 0 or high >= self.num_embeddings:
                raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        out = torch.empty(flat.numel(), self.embedding_dim, dtype=torch.float32)
        rc = native.library().gguf_dequantize_rows(
            self.raw.data_ptr(), self.raw.shape[1], self.ggml_type, self.embedding_dim,
            flat.data_ptr(), flat.numel(), out.data_ptr())
        if rc != 0:
            raise ValueError(f"embedding: type {self.ggml_type} rows of {self.embedding_dim} "
                             f"values ({self.raw.shape[1]} bytes) cannot be decoded")
        return out.to(self.dtype).view(*ids.shape, self.embedding_dim)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.ggml_type}"


class Q8RowsEmbedding(nn.Module):
    """A tied embedding read from its LM head's Q8_0 codes (quant.NativeQ8): where the head's
    many-row products have their own prepacked copy (LlamaForCausalLM.prepack_head), the
    dense table served lookups only, and it goes. Rows are the dense table's bit for bit:
    codes times their block's scale in float32, rounded to the model's dtype. Gemma 3 270M's
    262,144 x 640 table is 320 MiB in bf16. `weight` is a meta tensor of the table's shape and
    dtype: what asks for the dense head sees that there is none."""

    def __init__(self, head: quant.NativeQ8, dtype: torch.dtype):
        super().__init__()
        self.head = head
        self.num_embeddings, self.embedding_dim = head.codes.shape
        self.weight = torch.empty(head.codes.shape, dtype=dtype, device="meta")

    def first_rows(self, n: int) -> torch.Tensor:
        """The dense table's first n rows."""
        return self._rows(self.head.codes[:n], self.head.scale[:n])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., embedding_dim]
        flat = ids.reshape(-1).to(torch.int64)
        rows = self._rows(self.head.codes.index_select(0, flat), self.head.scale.index_select(0, flat))
        return rows.view(*ids.shape, self.embedding_dim)

    def _rows(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return quant.Int8Blocks(codes, scale).dequantize().to(self.weight.dtype)

    @property
    def nbytes(self) -> int:
        return 0  # the head's codes

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, from the Q8_0 head"
