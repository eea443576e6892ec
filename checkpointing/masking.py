"""URLs fit to show: a URL's password never reaches a message, a log line or a file of the run.

Internal, shared by `checkpointing` and `elastic` (which re-exports it from elastic._credentials):
it lives here because `checkpointing` must not import `elastic`. A storage URL may carry
user-info (`http://user:password@host/...`, or a token as the whole user-info); so may every
path under it (fsspec keeps an HTTP URL whole as the path) and the text of a backend's error
that names either. `mask_url` masks one URL, `mask_text` every URL inside free text.
"""
from __future__ import annotations

import re

MASK = "***"

# scheme://, then the authority up to its last '@' (a password may hold an unescaped '@'): the
# authority ends at '/', '?', '#', whitespace or a quote, so an '@' in a path is no user-info.
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#\s'\"]*)@")


def _masked_userinfo(userinfo: str) -> str:
    user, colon, _password = userinfo.partition(":")
    return f"{user}:{MASK}" if colon else MASK


def mask_url(url: str) -> str:
    """`url` with the password of its user-info masked (`scheme://user:***@host/...`; a user-info
    without a password, often a token, is masked whole). Anything else is returned unchanged."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority, tail = rest[:end], rest[end:]
    userinfo, at, host = authority.rpartition("@")
    if not at:
        return url
    return f"{scheme}://{_masked_userinfo(userinfo)}@{host}{tail}"


def mask_text(text: str) -> str:
    """`text` (an error message, a wrapped backend error, a traceback) with every URL in it masked
    as `mask_url` masks one."""
    if "@" not in text:
        return text
    return _USERINFO.sub(lambda m: f"{m['scheme']}{_masked_userinfo(m['userinfo'])}@", text)
