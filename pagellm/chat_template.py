"""Chat messages -> prompt token ids with the model's own chat template."""
from __future__ import annotations


# what render_chat itself passes to the template renderer: not a template variable to set
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "add_generation_prompt",
                                      "continue_final_message", "tokenize", "return_dict",
                                      "chat_template", "return_assistant_tokens_mask",
                                      "tokenizer_kwargs"})


def check_template_kwargs(kwargs: dict | None, field: str = "chat_template_kwargs") -> None:
    """ValueError naming the field for a key render_chat sets itself."""
    bad = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs or ()))
    if bad:
        prefix = f"{field}: " if field else ""
        raise ValueError(f"{prefix}{bad[0]!r} is not a template variable that can be set here")


def check_continuation(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """ValueError naming continue_final_message where both are set: a prompt cannot end
    inside the last message and after a new turn's opening at once."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message: cannot be combined with add_generation_prompt "
                         "(set add_generation_prompt to false)")


def load_chat_template(value: str, field: str = "--chat-template") -> str:
    """A chat template given as a file's path or as the Jinja text itself (vLLM's and
    llama.cpp's --chat-template / --chat-template-file in one): the text, checked to parse as
    transformers compiles it (its sandbox with loop controls and `{% generation %}`).
    ValueError naming the field for neither, or a template that does not parse."""
    import os

    import jinja2

    try:  # transformers' own compiler: the extensions render_chat's templates get
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_
    except ImportError:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
        compile_ = env.from_string
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            text = f.read()
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"{field}: {value!r} is neither a file nor a Jinja template")
    try:
        compile_(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{field}: the template does not parse: {e}") from None
    return text


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None,
                template_kwargs: dict | None = None,
                continue_final_message: bool = False,
                chat_template: str | None = None) -> list[int]:
    """template_kwargs: more variables for the template (vLLM's chat_template_kwargs, e.g.
    Qwen3's {"enable_thinking": False}). continue_final_message: the prompt ends inside the
    last message, which the model goes on writing (an assistant turn begun by the caller:
    "The answer is", an opening brace), as transformers renders it: no end-of-turn after it,
    and no generation prompt (the two exclude each other). chat_template: the Jinja text to
    use instead of the tokenizer's own."""
    check_template_kwargs(template_kwargs)
    check_continuation(add_generation_prompt, continue_final_message)
    if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise ValueError("messages: this model has no chat template; use a completion prompt, "
                         "or give one (`pagellm serve --chat-template FILE`)")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] must be an object with a 'role'")
    kw = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
    if continue_final_message:
        kw["continue_final_message"] = True
    if chat_template:
        kw["chat_template"] = chat_template
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **kw)
    # The template writes any BOS itself; encoding must not add a second one.
    return tokenizer.encode(text, add_special_tokens=False)
