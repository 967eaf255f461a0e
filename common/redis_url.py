"""Redis URLs and their credentials: one place that adds a password to a URL, takes it
out again, hides it when printed, and opens a client.

How a password travels. It is read once, at the command-line edge (``pdserve
worker|router|up``: ``--redis-password-file FILE``, else ``$PDSERVE_REDIS_PASSWORD``;
``pdserve up`` generates one for the Redis it starts), and merged into the URL the
component's config holds (:func:`with_password`). That URL is a :class:`RedisURL`: a
``str`` whose ``str()``, ``repr()`` and formatting show ``***`` for the password, so a
config or URL that ends up in a log line, a banner or an exception prints redacted;
only :func:`connect` (redis-py's ``from_url``) reads the real characters. Between
processes the password never rides in a command line (``/proc/PID/cmdline`` is world
readable): launchers pass :func:`without_password` of the URL in argv and the password
apart (a child's environment, a Ray actor's constructor argument). ``rediss://`` URLs
work as they are; ``?ssl_ca_certs=/path/ca.pem`` names the CA that signed the server's
certificate (redis-py passes the query argument to its TLS connection).
"""

from __future__ import annotations

from urllib.parse import quote, unquote, urlsplit, urlunsplit

import redis

PASSWORD_ENV = "PDSERVE_REDIS_PASSWORD"
"""The environment variable the CLI reads the password from (a Kubernetes Secret, via
``secretKeyRef``; a launcher's child)."""

_HIDDEN = "***"


def _split_netloc(netloc: str) -> tuple[str | None, str | None, str]:
    """``user:pass@host:port`` -> (user, password, host:port), still quoted."""
    if "@" not in netloc:
        return None, None, netloc
    userinfo, host = netloc.rsplit("@", 1)
    user, sep, password = userinfo.partition(":")
    return (user or None), (password if sep else None), host


def _with_netloc(url: str, user: str | None, password: str | None, host: str) -> str:
    parts = urlsplit(url)
    userinfo = (user or "") + (f":{password}" if password is not None else "")
    netloc = f"{userinfo}@{host}" if userinfo else host
    return urlunsplit(parts._replace(netloc=netloc))


def redact(url: str | None) -> str | None:
    """``url`` with its password (if any) shown as ``***``; what gets printed."""
    if url is None:
        return None
    raw = str.__str__(url)
    user, password, host = _split_netloc(urlsplit(raw).netloc)
    if password is None:
        return raw
    return _with_netloc(raw, user, _HIDDEN, host)


def password_of(url: str | None) -> str | None:
    """The password in ``url`` (unquoted), or None."""
    if url is None:
        return None
    password = _split_netloc(urlsplit(str.__str__(url)).netloc)[1]
    return unquote(password) if password else None


def without_password(url: str | None) -> str | None:
    """``url`` without its password (a username stays): what may go into a command
    line or a ConfigMap. A plain ``str``."""
    if url is None:
        return None
    raw = str.__str__(url)
    user, _, host = _split_netloc(urlsplit(raw).netloc)
    return _with_netloc(raw, user, None, host)


class RedisURL(str):
    """A Redis URL that carries a password and never prints it: ``str()``, ``repr()``,
    f-strings and ``%s`` show :func:`redact`'s form. Pickles as itself (a Ray actor
    gets it whole). Concatenation yields a plain ``str`` with the real characters; do
    not build messages that way."""

    __slots__ = ()

    def __str__(self) -> str:
        return redact(self) or ""

    def __repr__(self) -> str:
        return repr(redact(self))

    def __format__(self, spec: str) -> str:
        return format(redact(self) or "", spec)


def with_password(url: str | None, password: str | None) -> str | None:
    """``url`` carrying ``password`` (which replaces any in the URL) as a
    :class:`RedisURL`; ``url`` unchanged when there is no password to add (a URL that
    already holds one becomes a :class:`RedisURL` too, so it prints redacted)."""
    if url is None:
        return None
    if not password:
        return RedisURL(url) if password_of(url) else url
    raw = str.__str__(url)
    user, _, host = _split_netloc(urlsplit(raw).netloc)
    return RedisURL(_with_netloc(raw, user, quote(password, safe=""), host))


def connect(url: str, **kwargs: object) -> redis.Redis:
    """A client for ``url`` (``redis://`` or ``rediss://``, credentials included);
    ``kwargs`` go to ``redis.Redis`` (timeouts). Connects lazily, like redis-py."""
    return redis.Redis.from_url(str.__str__(url), **kwargs)  # type: ignore[arg-type]
