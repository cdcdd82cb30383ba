"""Credentials out of a location before it is shown or logged.

`redact_url("postgresql://leap:hunter2@db/leap?sslpassword=x")` is
`"postgresql://leap:***@db/leap?sslpassword=***"`: the password of the user part, and the value of any
query parameter whose name says it holds a secret (password, secret, token, key, signature, credential),
are replaced by `***`. Anything that is not a URL (a path) comes back unchanged.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "***"
_SECRET_PARAM = re.compile(r"pass|secret|token|key|signature|credential|auth", re.IGNORECASE)


def redact_url(location: object) -> str:
    """`location` as text with its password and secret query values masked."""
    text = str(location)
    try:
        parts = urlsplit(text)
    except ValueError:  # not a URL a parser accepts: show nothing that could hold a secret
        return MASK
    if not parts.scheme or not parts.netloc and not parts.query:
        return text
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:{MASK}@{host}" if colon else f"{user}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(name, MASK if _SECRET_PARAM.search(name) else value) for name, value in pairs],
                          safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/\s:@]*):(?P<password>[^@\s/]+)@")


def redact_text(text: object) -> str:
    """`text` (an error message, a log line) with the password of every URL in it masked."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", str(text))
