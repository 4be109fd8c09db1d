"""The LM head of steps whose every row is greedy: int8 products, then the exact argmax
(kernels/cpu_greedy_head.c), on CPUs with AVX-512 VNNI and bf16 units.

Such a step reads nothing of its logits but each row's argmax. From 6 rows the head would run
as a bf16 product (oneDNN): it rounds the hidden state and the logits to bf16, and its argmax
differs from the exact product's in ~2% of the default model's greedy rows. This head takes a
Q8_0 head's codes as they are against int8 activations (vpdpbusd, twice a bf16 product's
multiply-adds an instruction), bounds each logit's error from the activations' rounding, and
computes exactly (double precision) every output whose bound reaches the row's best: the
logits' argmax is the exact product's. Logits other than those keep the int8 product's
values (relative error ~5e-3), which is why only rows that read their argmax alone come here
(`sampler.reads_argmax_only`).

Measured on the default model's 49152 x 576 head, 64 rows, two Zen 4 cores: see README.
"""
from __future__ import annotations

import os

import torch

from pagellm.kernels import native
from pagellm.layers import q32, quant

PANEL = 32


def available() -> bool:
    """The kernel is built with AVX-512 VNNI and the CPU has bf16 units (where the many-row
    head it replaces runs in bf16); PAGELLM_GREEDY_HEAD=0 turns it off."""
    lib = native.library()
    return (os.environ.get("PAGELLM_GREEDY_HEAD", "1") != "0" and q32.available()
            and bool(lib.greedy_head_available()))


class GreedyHeadQ8:
    """A Q8_0 head (NativeQ8: codes [N, K] int8, one scale per 32) in the kernel's panels. The
    file's codes stay shared with the NativeQ8 (views): the exact outputs are computed from
    them. Extra memory: the codes again in panels (1 byte a weight) and 12 bytes per 32."""

    @staticmethod
    def supports(head: quant.NativeQ8) -> bool:
        """Inputs a multiple of 32 and finite scales (the bound is built from them)."""
        return head.codes.shape[1] % q32.BLOCK == 0 and bool(torch.isfinite(head.scale).all())

    def __init__(self, head: quant.NativeQ8):
        codes, scale = head.codes, head.scale
        n, k = codes.shape
        if not self.supports(head):
            raise ValueError("greedy head: inputs must be a multiple of 32 and scales finite")
        self.codes, self.scale = codes, scale
        self.out_features, self.in_features = n, k
        g, pad = k // q32.BLOCK, -n % PANEL
        c = torch.cat([codes, codes.new_zeros(pad, k)]) if pad else codes
        s = torch.cat([scale, scale.new_zeros(pad, g)]) if pad else scale
        p = (n + pad) // PANEL
        # [P, 32, K / 4, 4] -> [P, K / 4, 32, 4]: 4 consecutive inputs of an output a lane
        self.panels = c.view(p, PANEL, k // 4, 4).permute(0, 2, 1, 3).contiguous()
        blocks = c.view(p, PANEL, g, q32.BLOCK)
        sums = blocks.sum(dim=-1, dtype=torch.int32)  # [P, 32, G]
        abs_sums = blocks.abs().sum(dim=-1, dtype=torch.int32)
        sv = s.view(p, PANEL, g)
        self.d = sv.permute(0, 2, 1).contiguous()  # [P, G, 32]
        self.neg_sums = (-128 * sums).permute(0, 2, 1).contiguous()
        # d (an f16) times an integer below 2^12: exact in float32
        self.abs_w = (sv * abs_sums.float()).permute(0, 2, 1).contiguous()  # [P, G, 32]
        pt = -(-p // 16) * 16
        amax = self.abs_w.amax(dim=2).t()  # [G, P]
        self.abs_max = torch.zeros(g, pt, dtype=torch.float32)
        self.abs_max[:, :p] = amax
        # the last call's argmax and outputs computed exactly, per row
        self.last_ids: torch.Tensor | None = None
        self.last_counts: torch.Tensor | None = None

    def __call__(self, hidden: torch.Tensor, ids_only: bool = False) -> torch.Tensor | None:
        """hidden [R, K] -> float32 logits [R, N] whose argmax is the exact product's, or None
        where no bound holds (a hidden value not finite, a subnormal block, overflowed
        products): the caller's own head then runs. ids_only: that argmax alone, [R] int64,
        with no [R, N] logits made (64 rows of the default model: 12.6 MB a step)."""
        h = hidden.float().contiguous()
        rows = h.shape[0]
        logits = None if ids_only else torch.empty(rows, self.out_features, dtype=torch.float32)
        ids = torch.empty(rows, dtype=torch.int64)
        counts = torch.empty(rows, dtype=torch.int32)
        rc = native.library().greedy_head_q8(
            h.data_ptr(), rows, self.in_features, self.panels.data_ptr(), self.d.data_ptr(),
            self.neg_sums.data_ptr(), self.abs_w.data_ptr(), self.abs_max.data_ptr(),
            self.codes.data_ptr(), self.scale.data_ptr(), self.out_features,
            None if logits is None else logits.data_ptr(), ids.data_ptr(), counts.data_ptr(),
            torch.get_num_threads())
        if rc == 1:
            return None
        if rc != 0:
            raise MemoryError("greedy_head_q8: out of memory for its buffers")
        self.last_ids, self.last_counts = ids, counts
        return ids if ids_only else logits

    @property
    def nbytes(self) -> int:
        return (self.panels.numel() + 4 * (self.d.numel() + self.neg_sums.numel()
                                           + self.abs_w.numel() + self.abs_max.numel()))
