"""The router's TLS key pair and bearer token, read from the files ``router.tls`` and
``router.auth`` name (docs/router.md, Security).

Read once by ``orch up`` before the slow bring-up (before Ray starts), so a wrong path, a key
that does not match its certificate or a certificate out of its dates fails in seconds
(:mod:`orchestrator.api.tls_check`).
"""

from __future__ import annotations

import hmac
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from engine import envs
from orchestrator.config.sections import AuthSection, RouterSection, TLSSection
from orchestrator.config.errors import ConfigError
from orchestrator.api.tls_check import check_key_pair

log = logging.getLogger(__name__)

MIN_TOKEN_CHARS = 16
# NOTE: a gRPC metadata value is printable ASCII; the token follows "Bearer ".
_TOKEN = re.compile(r"[\x21-\x7e]+")


@dataclass(frozen=True)
class EdgeSecurity:
    """What the listening side needs.

    Attributes:
        tls_key_pair: (private key PEM, certificate chain PEM), or None for plaintext.
        token: the bearer token every call but health must carry, or None for no auth.
    """

    tls_key_pair: tuple[bytes, bytes] | None = None
    token: str | None = None

    def describe(self) -> str:
        """For the start-up line: "TLS, token", "TLS, no token", "plaintext, token", ..."""
        return (f"{'TLS' if self.tls_key_pair else 'plaintext'}, "
                f"{'token' if self.token else 'no token'}")


def load_security(router: RouterSection) -> EdgeSecurity:
    """Read what ``router.tls`` and ``router.auth`` point at.

    Raises:
        ConfigError: a file is unreadable or not what it should be, the token is unset, short
            or not printable ASCII; the message names the key path and what to do.
    """
    return EdgeSecurity(tls_key_pair=_key_pair(router.tls) if router.tls else None,
                        token=_token(router.auth) if router.auth else None)


def configured_token(router: RouterSection) -> str | None:
    """The token ``router.auth`` points at (None without auth), for clients such as
    `orch scale` that read the server's config. Raises ConfigError as :func:`load_security`."""
    return _token(router.auth) if router.auth else None


def _read(key: str, path: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path} ({exc.strerror}): fix the path or "
                          "the file's permissions") from None


def _key_pair(tls: TLSSection) -> tuple[bytes, bytes]:
    cert = _read("router.tls.cert_file", tls.cert_file)
    key = _read("router.tls.key_file", tls.key_file)
    if b"-----BEGIN CERTIFICATE-----" not in cert:
        raise ConfigError(f"router.tls.cert_file: {tls.cert_file} is not a PEM certificate: "
                          "give the server certificate (chain) in PEM form")
    if b"PRIVATE KEY-----" not in key:
        raise ConfigError(f"router.tls.key_file: {tls.key_file} is not a PEM private key: "
                          "give the certificate's private key in PEM form")
    for warning in check_key_pair(str(Path(tls.cert_file).expanduser()),
                                  str(Path(tls.key_file).expanduser())):
        log.warning(warning)
    return key, cert


def _token(auth: AuthSection) -> str:
    if auth.token_file:
        key = "router.auth.token_file"
        token = _read(key, auth.token_file).decode(errors="replace").strip()
    else:
        key = "router.auth.token_env"
        token = envs.read_configured(auth.token_env).strip()
        if not token:
            raise ConfigError(f"{key}: environment variable {auth.token_env} is unset or "
                              "empty: export the token there before `orch up`")
    if len(token) < MIN_TOKEN_CHARS or _TOKEN.fullmatch(token) is None:
        raise ConfigError(f"{key}: the token must be at least {MIN_TOKEN_CHARS} printable "
                          "ASCII characters without spaces: make one with "
                          "`openssl rand -hex 32`")
    return token


def bearer_matches(presented: str | None, token: str) -> bool:
    """True when an ``authorization`` value carries ``token`` with the Bearer scheme.

    The scheme is case-insensitive (RFC 9110 section 11.1; RFC 6750 "Bearer"), spaces after
    it are skipped, and the token is compared in constant time.
    """
    if presented is None:
        return False
    scheme, _, credentials = presented.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        credentials.strip().encode(), token.encode())
