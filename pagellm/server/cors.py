"""Cross-origin requests (CORS): which web pages' scripts may call the server. A chat UI served
from another origin (another port of localhost, an internal site) sends a preflight OPTIONS
before its POST; without the answer the browser blocks the call. The defaults are vLLM's and
llama.cpp's (any origin, method and header, no credentials): the API key, where one is set,
still guards every route but the open ones. `--allowed-origins '[]'` (or `none`) turns CORS
off."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from starlette.middleware.cors import CORSMiddleware

ANY = ("*",)
logger = logging.getLogger("pagellm.server")


@dataclass(frozen=True)
class CorsPolicy:
    origins: tuple[str, ...] = ANY
    methods: tuple[str, ...] = ANY
    headers: tuple[str, ...] = ANY
    credentials: bool = False

    @classmethod
    def from_args(cls, args) -> CorsPolicy:
        # browsers send methods upper-case, and the middleware compares them as given
        methods = tuple(m.upper() for m in parse_list(args.allowed_methods, "--allowed-methods"))
        return cls(origins=parse_list(args.allowed_origins, "--allowed-origins"),
                   methods=methods,
                   headers=parse_list(args.allowed_headers, "--allowed-headers"),
                   credentials=args.allow_credentials)

    def install(self, app) -> None:
        """Outermost middleware but Starlette's own (call it last): a preflight is answered
        before the API-key gate, which browsers never send credentials to, and every answer,
        the 4xx errors included (not an unexpected 500), carries the headers the browser needs
        to read it."""
        if not self.origins:
            return
        if self.credentials and "*" in self.origins:
            logger.warning("--allow-credentials with any origin ('*'): every web page a user "
                           "opens may call this server with the user's cookies; name the "
                           "origins with --allowed-origins")
        app.add_middleware(CORSMiddleware, allow_origins=list(self.origins),
                           allow_methods=list(self.methods), allow_headers=list(self.headers),
                           allow_credentials=self.credentials)


def parse_list(value: str | None, flag: str) -> tuple[str, ...]:
    """A JSON list of strings (vLLM's form: '["http://localhost:3000"]'), a comma-separated
    list, or none / '' / '[]' for an empty one; None (the flag not given) is '*'."""
    if value is None:
        return ANY
    text = value.strip()
    if text.lower() in ("", "none", "[]"):
        return ()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag}: {value!r} is not a JSON list ({e.msg})") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ValueError(f"{flag}: {value!r} is not a JSON list of strings")
    else:
        items = text.split(",")
    items = [i.strip() for i in items]
    if any(not i for i in items):
        raise ValueError(f"{flag}: {value!r} has an empty entry")
    return tuple(items)
