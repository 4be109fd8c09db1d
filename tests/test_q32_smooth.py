"""Smoothed requantized blocks (layers/q32_smooth.py, the `inv` factors of kernels/cpu_q32.c):
the quantizer multiplies each activation by its channel's factor in float32 before rounding,
the weights carry the inverse, the product stays the file's product within the int8 bound of
the smoothed values, and on the default model smoothing brings the requantized products'
log-probabilities back near the file's own blocks."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from pagellm.layers import q32, q32_smooth
from tests.gguf_files import random_blocks
from tests.helpers import outputs_on_one_and_two_threads

pytestmark = pytest.mark.skipif(not q32.available(),
                                reason="needs AVX-512 VNNI or AVX2 (and a C compiler)")
# requantized codes are bytes: their products need the AVX-512 VNNI tiles
needs_byte_codes = pytest.mark.skipif(q32.max_code() < 255,
                                      reason="requantized blocks: AVX-512 VNNI tiles")


def _factors(k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.exp(torch.randn(k, generator=g) * 1.5)  # factors over ~2 decades


@pytest.mark.parametrize("block", (64, 192))
def test_the_quantizer_scales_each_channel_before_rounding(block):
    """q32.quantize(x, block, inv) == q32.quantize of bf16(x) * inv computed in float32 (the
    quantizer's float32 path takes products that are no bf16 values as they are: the same
    block arithmetic), on bf16 and float32 rows, one and two threads."""
    k = 576
    inv = (1 / _factors(k, block)).float()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(33, k, generator=g) * 4
    x[5, 7] = 300.0  # an outlier channel
    xb = x.to(torch.bfloat16)
    got = q32.quantize(xb, block, inv)
    assert torch.equal(q32.quantize(x, block, inv)[0], got[0])  # float32 rows: bf16 first
    for other in outputs_on_one_and_two_threads(lambda t: q32.quantize(t, block, inv), xb):
        assert all(torch.equal(a, b) for a, b in zip(other, got))
    # the reference: the scaled values' blocks, each with max|v| / 127 and nearest codes
    v = (xb.float() * inv).view(33, k // block, block)
    mx = v.abs().amax(-1, keepdim=True)
    codes = torch.round(v * (torch.full_like(mx, 127) / mx)).clamp(-127, 127)
    assert torch.equal(got[0].view_as(codes).float(), codes)
    assert torch.allclose(got[1], (mx / 127)[..., 0], rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="inv"):
        q32.quantize(xb, block, inv[:-1])


@needs_byte_codes
@pytest.mark.parametrize("block", (64, 192))
def test_a_smoothed_product_is_the_files_product_within_its_bound(block):
    """from_blocks(..., block, s): weights w_ij s_j requantized, activations x_j / s_j rounded per
    block: y = x W^T within half a step of each smoothed activation block times its weights,
    plus what requantizing moved the weights; one and two threads the same; the gated
    product's output quantized for a smoothed down product equals q32.quantize of its
    output with those factors."""
    from pagellm.kernels import native

    k = 576
    parts = [random_blocks(Q.Q4_1, 64, k, seed=3), random_blocks(Q.Q8_0, 64, k, seed=4)]
    exact = q32.Q32Linear(parts)
    s = _factors(k, 7)
    product = q32.Q32Linear.from_blocks(*exact.own_blocks(), block, s)
    assert product.block == block and torch.allclose(product.inv, 1 / s)
    files = torch.cat([p.dequantize() for p in parts]).double()
    stored = product.dequantize().double()  # w s, requantized
    g = torch.Generator().manual_seed(block)
    for rows in (1, 6, 13, 197):
        xb = (torch.randn(rows, k, generator=g) * 3).to(torch.bfloat16)
        one, two = outputs_on_one_and_two_threads(product, xb)
        assert torch.equal(one, two)
        xs = xb.double() * product.inv.double()  # what the quantizer rounds
        step = xs.abs().view(rows, k // block, block).amax(-1) / 127
        weight = stored.abs().view(-1, k // block, block).sum(-1)
        ref = xb.double() @ files.t()
        moved = xb.double().abs() @ (stored * (1 / s).double() - files).abs().t()
        bound = 0.5 * step @ weight.t() + moved + ref.abs() * 2 ** -8 + 1e-3
        assert bool(((one.double() - ref).abs() <= bound).all())

    # the gate|up product (128 gated outputs) feeding a smoothed down product of 128 inputs
    gu = q32.Q32Linear([random_blocks(Q.Q4_1, 128, k, seed=5),
                        random_blocks(Q.Q8_0, 128, k, seed=6)])
    inv = (1 / _factors(128, 9)).float()
    xb = (torch.randn(197, k, generator=g) * 3).to(torch.bfloat16)
    want = q32.quantize(gu.gated(xb), 64, inv)
    xq, dx, sx = q32.quantize(xb)
    aq = torch.empty(197, 128, dtype=torch.int8)
    adx, asx = torch.empty(197, 2), torch.empty(197, 2)
    for threads in (1, 2):
        aq.fill_(99), adx.fill_(-1.0), asx.fill_(-1.0)
        assert native.library().q32_linear_gated_q(
            xq.data_ptr(), dx.data_ptr(), sx.data_ptr(), 197, k, 32, gu.codes.data_ptr(),
            gu.d.data_ptr(), gu.m.data_ptr(), gu.zeros_ptr(), int(gu.nibbles), 256,
            aq.data_ptr(), adx.data_ptr(), asx.data_ptr(), 64, inv.data_ptr(), threads) == 0
        assert torch.equal(aq, want[0]) and torch.equal(adx, want[1]) and torch.equal(asx, want[2])


def test_smoothing_factors_follow_the_measured_ranges():
    """s_j = max|x_j|^ALPHA / max_i|w_ij|^(1 - ALPHA): an outlier channel gets the largest
    factor; a channel never seen (max 0) or with zero weights keeps 1; refusals."""
    k = 128
    parts = [random_blocks(Q.Q8_0, 32, k, seed=5)]
    form = q32.Q32Linear(parts)
    amax = torch.ones(k)
    amax[17] = 400.0
    amax[3] = 0.0
    w = form.dequantize().abs().amax(0)
    assert torch.equal(q32.column_max(*form.own_blocks()), w)
    s = q32_smooth.factors(amax, w)
    a = q32_smooth.ALPHA
    assert torch.allclose(s[5], amax[5] ** a / w[5] ** (1 - a))
    assert int(s.argmax()) == 17 and float(s[3]) == 1.0
    blocks = form.own_blocks()
    assert torch.allclose(q32.Q32Linear.from_blocks(*blocks, 64, s).inv, 1 / s)
    with pytest.raises(ValueError, match="smoothing"):
        q32.Q32Linear.from_blocks(*blocks, 64, -s)
    with pytest.raises(ValueError, match="smoothing"):
        q32.Q32Linear.from_blocks(*blocks, 64, torch.where(s > 2, torch.inf, s))
    with pytest.raises(ValueError, match="smoothing"):
        q32.Q32Linear.from_blocks(*blocks, 32, s)
    with pytest.raises(ValueError, match="file's own blocks"):
        q32.Q32Linear.from_blocks(*blocks, 64).own_blocks()


def test_the_calibration_text_fits_the_model():
    """The fixed text's ids, cut to the model's positions; fixed random ids (the same every
    load) where there is no tokenizer or the text's ids do not fit the vocabulary."""
    from pagellm.models.loader import load_model_files

    tok = load_model_files(None).tokenizer
    ids = q32_smooth.calibration_ids(tok, 49152, 10_000)
    assert ids == tok.encode(q32_smooth.CALIBRATION_TEXT) and 300 < len(ids) < 600
    assert q32_smooth.calibration_ids(tok, 49152, 100) == ids[:100]
    none = q32_smooth.calibration_ids(None, 1000, 10_000)
    assert len(none) == q32_smooth.RANDOM_TOKENS and max(none) < 1000
    assert none == q32_smooth.calibration_ids(None, 1000, 10_000)
    assert q32_smooth.calibration_ids(tok, 1000, 64) == none[:64]  # ids past the vocabulary


def _prompt_logprobs(monkeypatch, env: dict, prompt: list[int]) -> tuple[torch.Tensor, list]:
    from pagellm import LLM, SamplingParams

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    llm = LLM(dtype="auto", max_model_len=1024, enable_prefix_caching=False)
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1,
                                                    prompt_logprobs=1), use_tqdm=False)[0]
        forms = [m.q32 for m in llm.engine.model.modules() if getattr(m, "q32", None)]
    finally:
        llm.shutdown()
    for key in env:
        monkeypatch.delenv(key)
    lps = torch.tensor([e[t] for e, t in zip(out.prompt_logprobs[1:], prompt[1:])])
    return lps, forms


@needs_byte_codes
def test_smoothing_brings_the_default_models_requantized_products_back_to_its_accuracy(
        monkeypatch):
    """The default model on 900 tokens of this repository's README, each token's
    log-probability against float32 transformers on the same weights: with
    PAGELLM_Q32_BLOCK=64 the loader smooths every product (factors measured on
    q32_smooth.CALIBRATION_TEXT), which takes the requantized products from ~1.4x the
    file's own blocks' distance back to ~1x (measured here: 0.083 and 0.061 against 0.060;
    on 8 windows of the docs, `pagellm bench accuracy`: 0.086 and 0.059 against 0.060)."""
    import os

    from transformers import AutoModelForCausalLM

    from pagellm.models.loader import default_model_path, load_model_files

    readme = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
    tok = load_model_files(None).tokenizer
    prompt = tok.encode(open(readme, encoding="utf-8").read())[:900]
    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), dtype=torch.float32,
                                              gguf_file=os.path.basename(path)).eval()
    with torch.inference_mode():
        rows = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), -1)
    ref = rows.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    own, forms = _prompt_logprobs(monkeypatch, {}, prompt)
    assert all(f.block == 32 and f.inv is None for f in forms)
    plain, forms = _prompt_logprobs(monkeypatch, {"PAGELLM_Q32_BLOCK": "64",
                                                  "PAGELLM_Q32_SMOOTH": "0"}, prompt)
    assert all(f.block == 64 and f.inv is None for f in forms)
    smooth, forms = _prompt_logprobs(monkeypatch, {"PAGELLM_Q32_BLOCK": "64"}, prompt)
    assert len(forms) == 4 * 30 and all(f.block == 64 and f.inv is not None for f in forms)
    d_own, d_plain, d_smooth = ((x - ref).abs().mean().item() for x in (own, plain, smooth))
    print(f"mean |logprob - float32 transformers|: own blocks {d_own:.4f}, 64 {d_plain:.4f}, "
          f"64 smoothed {d_smooth:.4f}")
    assert d_smooth <= 1.15 * d_own and d_smooth <= 0.85 * d_plain, (d_own, d_plain, d_smooth)


@needs_byte_codes
def test_a_block_that_divides_no_products_inputs_is_said_at_load(monkeypatch, caplog):
    """PAGELLM_Q32_BLOCK=224 on the default model (inputs 576 and 1,536, neither a multiple
    of 224): every product keeps the file's blocks, and the load log says so, where it said
    nothing before."""
    import logging

    from pagellm import LLM

    monkeypatch.setenv("PAGELLM_Q32_BLOCK", "224")
    with caplog.at_level(logging.WARNING, logger="pagellm.layers.q32_smooth"):
        llm = LLM(dtype="auto", max_model_len=256, enable_prefix_caching=False)
    try:
        forms = [m.q32 for m in llm.engine.model.modules() if getattr(m, "q32", None)]
    finally:
        llm.shutdown()
    assert forms and all(f.block == 32 and f.inv is None for f in forms)
    assert any("PAGELLM_Q32_BLOCK=224 divides no product's inputs" in r.getMessage()
               for r in caplog.records), caplog.records
