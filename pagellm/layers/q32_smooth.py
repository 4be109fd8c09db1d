"""Smoothed requantized blocks: the loader's last step where PAGELLM_Q32_BLOCK asks for
requantized q32 products (layers/q32.py).

A requantized block rounds a row's activations with one step per 64-256 values, so one
outlier channel (SmolLM2's 507, 308, 230 after every norm) sets the step of its whole block
and flattens the rest to a few levels. Before requantizing, the loader measures each
product's inputs on a short fixed text (one forward of ~400 tokens through the file's own
blocks) and moves part of each channel's range into its weights, as SmoothQuant (Xiao et al.,
2023) does: input j's weights are multiplied by

    s_j = max|x_j| ** ALPHA / max_i |w_ij| ** (1 - ALPHA)

and its activations by 1 / s_j, in float32, as the product's quantizer reads them
(Q32Linear.inv). The product is the same up to rounding; only the int8 steps move. Nothing
is folded into other weights (norms, v, up), so the few-row kernels, which read the file's
blocks, are untouched. Scored on this project's docs (`pagellm bench accuracy`, 8 windows of
1,024 tokens), the default model's mean |log-probability difference| from float32
transformers: the file's own blocks 0.060; blocks of 64 0.086 -> 0.059 smoothed; auto (192
and 256) 0.123 -> 0.078 (ALPHA 0.5: 0.080, 0.7: 0.084). PAGELLM_Q32_SMOOTH=0 requantizes
without smoothing.
"""
from __future__ import annotations

import logging
import os
import time

import torch

from pagellm.layers import q32

logger = logging.getLogger(__name__)

ALPHA = 0.6  # the share of each channel's range moved into its weights
# What the loader measures the activations on: prose, dialogue, code, arithmetic, SQL, JSON
# and another language, as a serving engine sees them (~400 tokens with SmolLM2's tokenizer).
CALIBRATION_TEXT = """\
The river had risen overnight, and by morning the lower fields were a sheet of brown water. \
Maria walked the fence line with her father, counting the posts that still stood. "Forty-two," \
she said at last. "The rest went downstream." He nodded, wrote the number in his notebook, and \
asked what it would cost to replace them before the spring planting.

def moving_average(values, window=3):
    \"\"\"Return the mean of each run of `window` consecutive values.\"\"\"
    if window <= 0:
        raise ValueError("window must be positive")
    return [sum(values[i:i + window]) / window for i in range(len(values) - window + 1)]

Q: What is 17 multiplied by 23? A: 17 x 23 = 391, because 17 x 20 = 340 and 17 x 3 = 51.
User: Can you summarize the main causes of inflation in two sentences?
Assistant: Inflation usually rises when demand for goods and services grows faster than the \
economy can produce them, or when the costs of energy, wages and materials push prices up. \
Expectations matter too: if people believe prices will keep climbing, they spend and negotiate \
wages in ways that make it happen.
SELECT name, COUNT(*) AS orders FROM customers JOIN orders USING (customer_id) GROUP BY name \
ORDER BY orders DESC LIMIT 10;
La ciudad despierta temprano; los mercados abren a las seis y el aroma del pan recién hecho \
llena las calles.
{"id": 7, "status": "shipped", "items": [{"sku": "A-113", "qty": 2}, {"sku": "C-090", "qty": 1}], \
"total": 48.50}
"""
RANDOM_TOKENS = 384  # the calibration's length where the model has no tokenizer (random ids)


def enabled() -> bool:
    """PAGELLM_Q32_SMOOTH (default 1): smooth the requantized products' activations."""
    return os.environ.get("PAGELLM_Q32_SMOOTH", "1").strip() != "0"


def pending(model) -> list:
    """The modules whose q32 form waits for requantization (Q32Linear.pending_block)."""
    return [m for m in model.modules()
            if getattr(m, "q32", None) is not None and m.q32.pending_block is not None]


def calibration_ids(tokenizer, vocab_size: int, max_len: int) -> list[int]:
    """CALIBRATION_TEXT's token ids, or fixed random ids where there is no tokenizer; at
    most max_len (the model's positions)."""
    if tokenizer is not None:
        ids = tokenizer.encode(CALIBRATION_TEXT)
        if len(ids) >= 16 and max(ids) < vocab_size:
            return ids[:max_len]
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (min(RANDOM_TOKENS, max_len),), generator=g).tolist()


def measure(model, modules: list, ids: list[int], dtype: torch.dtype,
            device: torch.device) -> dict:
    """One forward of `ids` as one prompt through the model's module path, over a temporary
    pool of the KV dtype serving takes (the model's dtype and device); for each module that
    ran, max |x_j| [K] float32 over the rows its q32 form multiplied."""
    from pagellm.engine.memory import resolve_kv_dtype
    from pagellm.engine.model_runner import ModelRunner

    stats: dict = {}

    def recording(m):
        run = m.q32._run

        def record(x, width, kernel):
            a = x.detach().reshape(-1, x.shape[-1]).float().abs().amax(0)
            stats[m] = torch.maximum(stats[m], a) if m in stats else a
            return run(x, width, kernel)
        return record

    for m in modules:  # an instance attribute: __call__ and gated() both run self._run
        m.q32._run = recording(m)
    kv = resolve_kv_dtype("auto", dtype, device, model.act_dtype)
    block_size = 16
    try:
        runner = ModelRunner(model, -(-len(ids) // block_size), block_size, kv, device)
        _, pos, md = runner.synthetic_step([len(ids)])
        with torch.inference_mode():
            model(torch.tensor(ids, dtype=torch.long), pos, md)
    finally:
        for m in modules:
            del m.q32._run
        for layer in model.layers:  # the temporary pool goes, as profile_forward's does
            layer.self_attn.k_cache = layer.self_attn.v_cache = None
    return stats


def factors(amax: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """s [K] from the inputs' measured max |x_j| and the weights' max_i |w_ij| (both [K]):
    SmoothQuant's balance, 1 where a channel or its weights are all zero (or not finite)."""
    s = amax.clamp_min(1e-5) ** ALPHA / w.clamp_min(1e-5) ** (1 - ALPHA)
    keep = (amax > 0) & (w > 0) & torch.isfinite(s) & (s > 0)
    return torch.where(keep, s, torch.ones_like(s)).float()


def kept_names(model) -> list[str]:
    """The projections whose q32 forms keep the file's blocks while others wait for
    requantization (their inputs are no multiple of the block PAGELLM_Q32_BLOCK asks for),
    each named once with the layers that have it: "mlp.down_proj (30 layers)"."""
    counts: dict[str, int] = {}
    for name, m in model.named_modules():
        if getattr(m, "q32", None) is not None and m.q32.pending_block is None:
            parts = name.split(".")
            at = next((i for i, p in enumerate(parts) if p.isdigit()), None)
            key = ".".join(parts[at + 1:]) if at is not None else name
            counts[key] = counts.get(key, 0) + 1
    return [f"{k} ({n} layer{'s' if n != 1 else ''})" for k, n in counts.items()]


def requantize_model(model, tokenizer, vocab_size: int, max_len: int, dtype: torch.dtype,
                     device: torch.device) -> int:
    """Requantize every pending q32 form to its block, smoothed by a measured forward unless
    PAGELLM_Q32_SMOOTH=0 (a form the forward did not reach, e.g. every product where the
    model's positions are fewer than a many-row step, is requantized unsmoothed, and the log
    says how many; it also names the projections that keep the file's blocks). Returns the
    number of forms requantized."""
    modules = pending(model)
    kept = kept_names(model)
    if not modules:
        if kept and q32.asked_block() is not None:
            logger.warning("q32: PAGELLM_Q32_BLOCK=%s divides no product's inputs; every "
                           "product keeps the file's blocks", os.environ["PAGELLM_Q32_BLOCK"])
        return 0
    start = time.perf_counter()
    stats = (measure(model, modules, calibration_ids(tokenizer, vocab_size, max_len), dtype,
                     device) if enabled() else {})
    for mod in modules:
        u, d, m = mod.q32.own_blocks()
        smooth = factors(stats[mod], q32.column_max(u, d, m)) if mod in stats else None
        mod.q32 = q32.Q32Linear.from_blocks(u, d, m, mod.q32.pending_block, smooth)
    logger.info("q32: %d products requantized (%d smoothed) in %.2f s; the file's blocks kept "
                "by those whose inputs are no multiple of the block: %s", len(modules),
                sum(m in stats for m in modules), time.perf_counter() - start,
                ", ".join(kept) or "none")
    return len(modules)
