"""Reasoning models' thinking, apart from the answer (`pagellm serve --reasoning-parser`).

Models such as Qwen3, QwQ and the DeepSeek-R1 distills write their thinking between `<think>`
and `</think>` before the answer. With a parser named, a chat completion carries the thinking
in the message's `reasoning` (and `reasoning_content`, its older name, which clients still
read) and the answer in `content`, streamed the same way in deltas, as vLLM's reasoning
parsers give them:

- qwen3: the output thinks when it opens with `<think>`, or when the prompt ends inside an
  open `<think>` (templates that write it into the generation prompt); otherwise it is all
  answer (thinking switched off: `chat_template_kwargs: {"enable_thinking": false}`).
- deepseek_r1: the output thinks from its start, `<think>` written or not, until `</think>`;
  without `</think>` it is all thinking (a reply cut by max_tokens mid-thought).

White space at either end of the thinking and at the start of the answer (the templates' new
lines around the tags) is left out. Tool calls are read from the answer only.
"""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """Whether the rendered prompt ends inside an open <think> (its last tokens' text)."""
    return prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of text that is a proper start of tag (held back: the next
    delta may complete the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningStream:
    """One choice's text, fed as it grows: (thinking, answer) new in each piece."""

    def __init__(self, parser: str, opened: bool = False):
        """opened: the prompt left a <think> open (the output starts inside it)."""
        if parser not in PARSERS:
            raise ValueError(f"reasoning parser {parser!r}: known are {list(PARSERS)}")
        self.thinking = opened or parser == "deepseek_r1"
        self.at_start = True  # nothing but white space seen yet: an opening <think> may come
        self.after_close = False  # the answer's leading white space is dropped
        self.after_open = True  # and the thinking's
        self.buf = ""

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        self.buf += text
        thought, answer = [], []
        while self.buf:
            if self.at_start:
                head = self.buf.lstrip()
                if head.startswith(OPEN):
                    self.buf, self.thinking, self.at_start = head[len(OPEN):], True, False
                    continue
                if not finished and (not head or OPEN.startswith(head)):
                    break  # white space, or the start of <think>: wait for more
                self.at_start = False
                if not self.thinking:  # qwen3 with no <think>: all answer
                    continue
            if self.thinking:
                if self.after_open:
                    self.buf = self.buf.lstrip()
                    if not self.buf:
                        break
                    self.after_open = False
                i = self.buf.find(CLOSE)
                if i >= 0:
                    thought.append(self.buf[:i].rstrip())
                    self.buf, self.thinking, self.after_close = self.buf[i + len(CLOSE):], False, True
                    continue
                # held back: a start of </think>, and the white space before it (it may end
                # the thinking)
                keep = 0 if finished else _partial_suffix(self.buf, CLOSE)
                body = self.buf[: len(self.buf) - keep]
                if not finished:
                    keep += len(body) - len(body.rstrip())
                    body = body.rstrip()
                thought.append(body)
                self.buf = self.buf[len(self.buf) - keep:]
                break
            if self.after_close:
                stripped = self.buf.lstrip()
                if not stripped:
                    self.buf = ""
                    break
                self.buf, self.after_close = stripped, False
            answer.append(self.buf)
            self.buf = ""
        return "".join(thought), "".join(answer)


def split_reasoning(parser: str, text: str, opened: bool = False) -> tuple[str | None, str]:
    """A whole output -> (thinking or None when it has none, answer)."""
    stream = ReasoningStream(parser, opened)
    thought, answer = stream.feed(text, finished=True)
    return (thought or None), answer


def message_fields(thought: str | None) -> dict:
    """The thinking as a message (or delta) carries it: both names vLLM has used."""
    return {} if thought is None else {"reasoning": thought, "reasoning_content": thought}
