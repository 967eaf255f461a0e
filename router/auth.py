"""API keys: who is calling, for which tenant, with which rights.

The key file (``pdserve router --api-keys FILE``; the path may be on a command line, the
keys never are) has one key per line::

    # KEY                                TENANT   [admin] [NAME=VALUE ...]
    sk-0f4c1e9a7b2d4c1f8e3a9b7c6d5e4f3a    acme
    sk-9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d    ops      admin
    sk-1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d    bigco    max_concurrency=8 tokens_per_minute=200000

``#`` starts a comment, blank lines are skipped. A key is 16 to 256 visible ASCII
characters (no spaces); a tenant 1 to 64 of ``A-Z a-z 0-9 . _ -``. ``admin`` lets the key
see routing details (worker addresses, indexed cached tokens) and ``GetStatus`` /
admin-only HTTP routes. ``max_concurrency`` and ``tokens_per_minute`` override the
router's defaults for the tenant (:mod:`router.limits`); lines of one tenant must not
disagree about them. Several keys may name one tenant (rotation: add the new key, move
clients, delete the old line).

Parsing errors name the file and the line, never a key (nor any word of the line that
could be one). Keys are held as SHA-256 digests in a dict: a lookup compares digests,
so its time says nothing about how much of a guessed key was right, and the file's
contents do not linger in memory.

Lifecycle of a :class:`KeyStore`: loaded at construction (a bad file stops the router
from starting); then :meth:`KeyStore.authenticate` checks the file's mtime, size and
inode at most once per ``check_interval_s`` (one ``stat``) and, when they changed,
reloads it. A reload that fails (unreadable, malformed, empty) keeps the keys in force
and logs why, once per change of the file. So a key added or removed works or stops
working within about a second, without a restart.

Without a key file, the router serves without authentication: every caller is
:data:`OPEN` (no tenant salt, admin rights, the default limits), as a loopback
``make run`` needs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .limits import TenantLimits

log = logging.getLogger(__name__)

MIN_KEY_CHARS, MAX_KEY_CHARS = 16, 256
"""A key shorter than 16 characters is guessable; longer than 256 is no key anyone made."""

CHECK_INTERVAL_S = 1.0
"""How often the key file's metadata is looked at (one ``stat``)."""

_KEY_RE = re.compile(r"[\x21-\x7e]+")
_TENANT_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
_LIMIT_OPTIONS = ("max_concurrency", "tokens_per_minute")
_ORDINAL = {1: "1st", 2: "2nd", 3: "3rd"}


class KeyFileError(ValueError):
    """A key file that cannot be used; the message names the file and line, no key."""


@dataclass(frozen=True)
class Principal:
    """An authenticated caller."""

    tenant: str
    """Its prefix-cache namespace and the unit of its limits; "" only for :data:`OPEN`."""
    admin: bool = False
    limits: TenantLimits | None = None
    """The key line's overrides; None: the router's defaults."""
    key_id: str = ""
    """A short fingerprint of the key (SHA-256, 8 hex digits), safe to log."""


OPEN = Principal(tenant="", admin=True, key_id="open")
"""Every caller of a router without a key file."""


def tenant_salt(tenant: str, client_salt: str | None) -> str | None:
    """The cache salt a request of ``tenant`` runs with: its tenant and its client's own
    salt, length-prefixed (``"4:acme:x"`` and ``"5:acme:"`` never meet) and hashed, so
    the salt has a fixed size and workers never see tenant names. Tenants never share a
    cached block; requests of one tenant with the same client salt do. The open
    principal's tenant "" keeps the client's salt as it is (today's behaviour)."""
    if not tenant:
        return client_salt or None
    inner = f"{len(tenant)}:{tenant}:{client_salt or ''}"
    return "tenant-" + hashlib.sha256(inner.encode("utf-8")).hexdigest()


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def parse_keys(text: str, source: str = "the key file") -> dict[bytes, Principal]:
    """The file's keys, by SHA-256 digest. Raises :class:`KeyFileError` naming
    ``source`` and the line (never echoing a key)."""
    keys: dict[bytes, tuple[int, Principal]] = {}
    limits_of: dict[str, tuple[int, TenantLimits | None]] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}, line {n}"
        words = line.split()
        if len(words) < 2:
            raise KeyFileError(f"{where}: expected `KEY TENANT [admin] [NAME=VALUE ...]`, "
                               "got one word")
        key, tenant, rest = words[0], words[1], words[2:]
        if not MIN_KEY_CHARS <= len(key) <= MAX_KEY_CHARS or not _KEY_RE.fullmatch(key):
            raise KeyFileError(f"{where}: the key (1st word) must be {MIN_KEY_CHARS} to "
                               f"{MAX_KEY_CHARS} visible ASCII characters (e.g. "
                               "`openssl rand -hex 24`)")
        if not _TENANT_RE.fullmatch(tenant):
            raise KeyFileError(f"{where}: the tenant (2nd word) must be 1 to 64 of A-Z a-z "
                               "0-9 . _ -")
        admin, options = False, {}
        for i, word in enumerate(rest, 3):
            name, eq, value = word.partition("=")
            if word == "admin":
                admin = True
            elif eq and name in _LIMIT_OPTIONS:
                if not value.isdigit():
                    raise KeyFileError(f"{where}: {name} must be an integer >= 0 "
                                       "(0: unlimited)")
                options[name] = int(value)
            else:
                nth = _ORDINAL.get(i, f"{i}th")
                raise KeyFileError(f"{where}: the {nth} word is not `admin` or one of "
                                   f"{', '.join(f'{o}=N' for o in _LIMIT_OPTIONS)}")
        limits = TenantLimits(**options) if options else None
        seen = limits_of.setdefault(tenant, (n, limits))
        if seen[1] != limits:
            raise KeyFileError(f"{where}: tenant {tenant!r} has other limits on line "
                               f"{seen[0]}; give every line of a tenant the same limits")
        d = digest(key)
        if d in keys:
            raise KeyFileError(f"{where}: the same key as line {keys[d][0]}")
        keys[d] = (n, Principal(tenant, admin, limits, d.hex()[:8]))
    if not keys:
        raise KeyFileError(f"{source}: no keys (expected lines `KEY TENANT [admin]`); "
                           "without keys, start the router without --api-keys")
    return {d: p for d, (_, p) in keys.items()}


def bearer_key(value: str | None) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` value; None when absent or malformed."""
    if not value:
        return None
    scheme, _, key = value.strip().partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        return None
    return key


class KeyStore:
    """The keys of one key file, reloaded when it changes (see the module docstring).

    ``authenticate`` may stat and read the file (at most once per ``check_interval_s``);
    call it from the event loop, never from several threads.
    """

    def __init__(self, path: str | os.PathLike[str], *,
                 clock: Callable[[], float] = time.monotonic,
                 check_interval_s: float = CHECK_INTERVAL_S) -> None:
        self.path = Path(path)
        self._clock = clock
        self._interval = check_interval_s
        self._signature = self._stat()  # raises KeyFileError: a router must not start
        self._keys = self._read()
        self._checked = clock()
        self._warn_if_readable_by_others()

    @property
    def tenants(self) -> set[str]:
        return {p.tenant for p in self._keys.values()}

    def __len__(self) -> int:
        return len(self._keys)

    def authenticate(self, key: str | None) -> Principal | None:
        """The principal of ``key``; None for a missing or unknown key."""
        self.maybe_reload()
        if not key:
            return None
        return self._keys.get(digest(key))

    def maybe_reload(self) -> bool:
        """Reload when the file changed and the last look is ``check_interval_s`` old;
        True when new keys took effect."""
        now = self._clock()
        if now - self._checked < self._interval:
            return False
        self._checked = now
        try:
            signature = self._stat()
        except KeyFileError as e:
            if self._signature is not None:
                log.warning("%s; keeping the %d keys loaded before", e, len(self._keys))
                self._signature = None
            return False
        if signature == self._signature:
            return False
        self._signature = signature
        try:
            keys = self._read()
        except KeyFileError as e:
            log.warning("API key file changed but cannot be used: %s; keeping the %d keys "
                        "loaded before", e, len(self._keys))
            return False
        self._keys = keys
        log.info("API keys reloaded from %s: %d keys, %d tenants", self.path, len(keys),
                 len(self.tenants))
        return True

    def _stat(self) -> tuple[int, int, int, int]:
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise KeyFileError(f"{self.path}: cannot read the API key file: "
                               f"{e.strerror}") from None
        return (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)

    def _read(self) -> dict[bytes, Principal]:
        try:
            data = self.path.read_bytes()
        except OSError as e:
            raise KeyFileError(f"{self.path}: cannot read the API key file: "
                               f"{e.strerror}") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data[:e.start].count(b"\n") + 1
            raise KeyFileError(f"{self.path}, line {line}: the API key file is not UTF-8 "
                               "text") from None
        return parse_keys(text, str(self.path))

    def _warn_if_readable_by_others(self) -> None:
        try:
            mode = os.stat(self.path).st_mode
        except OSError:
            return
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("API key file %s is readable by other users (mode %o); "
                        "chmod 600 it", self.path, stat.S_IMODE(mode))
