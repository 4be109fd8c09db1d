"""Fill-in-the-middle (FIM): a code model's prompt for the text between a prefix and a suffix.

Code models trained for infilling (Qwen2.5-Coder, StarCoder, DeepSeek-Coder, CodeLlama) read
`<prefix token> prefix <suffix token> suffix <middle token>` and write the middle, ending it with
an end-of-text or FIM pad token (the GGUF loader lists those among the ids that end
generation). Repository-level models also read other files first, each after a file separator.
The tokens are found by their spelling among the tokenizer's special tokens, as llama.cpp finds
them when a file does not name them.
"""
from __future__ import annotations

from dataclasses import dataclass

# (prefix, suffix, middle, repository name, file separator) as each family spells them
_FORMS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<repo_name>", "<file_sep>"),
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>", None, None),
    ("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>",
     None, None),
    ("\u2581<PRE>", "\u2581<SUF>", "\u2581<MID>", None, None),
    ("<PRE>", "<SUF>", "<MID>", None, None),
)
# Between extra files when the model has no file separator (as llama.cpp joins such chunks).
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    repo_name: int | None = None
    file_sep: int | None = None
    # the vocabulary's special tokens that end an infill (END_TOKEN_NAMES: end of text, FIM
    # pad, separators): an infill request stops at them even where the model's EOS is another
    # (an HF folder's config names only its chat end)
    ends: tuple[int, ...] = ()


def fim_tokens(tokenizer) -> FimTokens | None:
    """The tokenizer's FIM tokens, or None when it has no complete set."""
    from pagellm.models.gguf_loader import END_TOKEN_NAMES

    if tokenizer is None:
        return None
    added = tokenizer.added_tokens_decoder.items()
    ids = {token.content: tid for tid, token in added}
    ends = tuple(sorted(tid for tid, token in added
                        if token.special and token.content in END_TOKEN_NAMES))
    for pre, suf, mid, repo, sep in _FORMS:
        if pre in ids and suf in ids and mid in ids:
            return FimTokens(ids[pre], ids[suf], ids[mid], ids.get(repo), ids.get(sep), ends)
    return None


@dataclass(frozen=True)
class ExtraFile:
    """Another file the model reads before the one being edited (repository context)."""
    filename: str
    text: str


def infill_prompt(tokenizer, fim: FimTokens, prefix: str | list[int], suffix: str | list[int],
                  files: list[ExtraFile] = (), filename: str = "", repo: str = "") -> list[int]:
    """The prompt ids of an infill (prefix-suffix-middle order): the tokenizer's BOS where it
    adds one; with `files`, the repository form (`<repo_name>repo`, then each file after a
    file separator as `name\ntext`, then the edited file's separator and name) or, without
    file separators, each file after SNIPPET_SEPARATOR; then the prefix, suffix and middle
    tokens. `prefix` / `suffix` may be token ids already."""
    return fit_infill(tokenizer, fim, prefix, suffix, files, filename, repo)[0]


def fit_infill(tokenizer, fim: FimTokens, prefix: str | list[int], suffix: str | list[int],
               files: list[ExtraFile] = (), filename: str = "", repo: str = "",
               budget: int | None = None) -> tuple[list[int], bool]:
    """infill_prompt's ids cut to at most `budget` tokens, and whether anything was cut: the
    extra files go first, the oldest (first) first; then the prefix loses its start and the
    suffix its end, the suffix keeping at least a quarter of the room (the code right after
    the gap matters most, then the code right before it). ValueError when even the FIM tokens
    do not fit."""
    def enc(text: str | list[int]) -> list[int]:
        # the code is text: a "<|fim_middle|>" written in it is not the token
        return list(text) if isinstance(text, list) else tokenizer.encode(
            text, add_special_tokens=False, split_special_tokens=True)

    bos = [t for t in tokenizer.encode("") if t == tokenizer.bos_token_id]
    head, pieces, tail = [], [], []
    if files and fim.file_sep is not None:
        head = [fim.repo_name] + enc(f"{repo}\n") if fim.repo_name is not None else []
        pieces = [[fim.file_sep] + enc(f"{f.filename}\n{f.text}") for f in files]
        tail = [fim.file_sep] + enc(f"{filename}\n")
    elif files:
        pieces = [enc(SNIPPET_SEPARATOR + f.text) for f in files]
        tail = enc(SNIPPET_SEPARATOR)
    pre, suf = enc(prefix), enc(suffix)
    fixed = len(bos) + 3  # BOS and the three FIM tokens
    # the extra files' tokens: their pieces, with the repository's and the edited file's names
    context = len(head) + sum(map(len, pieces)) + len(tail)
    truncated = False
    if budget is not None:
        first = 0  # the oldest files that go (a running count: many small files stay linear)
        while first < len(pieces) and fixed + context + len(pre) + len(suf) > budget:
            context -= len(pieces[first])
            first += 1
        pieces, truncated = pieces[first:], first > 0
        room = budget - fixed - (context if pieces else 0)
        if room < 0:
            raise ValueError(f"the context ({budget} tokens for the prompt) is too small for "
                             "an infill")
        if len(pre) + len(suf) > room:
            keep_suf = min(len(suf), max(room // 4, room - len(pre)))
            keep_pre = room - keep_suf
            pre, suf = (pre[len(pre) - keep_pre:] if keep_pre else []), suf[:keep_suf]
            truncated = True
    files_ids = head + [t for p in pieces for t in p] + tail if pieces else []
    return bos + files_ids + [fim.prefix] + pre + [fim.suffix] + suf + [fim.middle], truncated


def require_fim(fim: FimTokens | None, field: str) -> FimTokens:
    """`fim` (a model's fim_tokens); ValueError naming `field` when the model has none."""
    if fim is None:
        raise ValueError(f"{field}: this model has no fill-in-the-middle tokens (a code model "
                         "trained for infilling has them, e.g. Qwen2.5-Coder's <|fim_prefix|>)")
    return fim
