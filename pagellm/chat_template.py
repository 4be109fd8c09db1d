"""Chat messages -> prompt token ids with the model's own chat template."""
from __future__ import annotations


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None) -> list[int]:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: this model has no chat template; use a completion prompt")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] must be an object with a 'role'")
    kw = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **kw)
    # The template writes any BOS itself; encoding must not add a second one.
    return tokenizer.encode(text, add_special_tokens=False)
