"""Checks of the router's TLS key pair before anything starts: the key matches the certificate,
every certificate of the chain is within its dates and issued by the next one, and a warning
some days before the server certificate expires.

Standard library only (``ssl`` loads the pair; the few DER fields read here, validity, issuer
and subject of each certificate, come from a minimal DER walk of RFC 5280's
``TBSCertificate``). Signatures are not verified: a client does that against its own roots.
"""

from __future__ import annotations

import base64
import re
import ssl
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from orchestrator.config.errors import ConfigError

EXPIRY_WARNING_DAYS = 14
_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----(.+?)-----END CERTIFICATE-----", re.S)
_SEQUENCE, _UTC_TIME, _GENERALIZED_TIME, _CONTEXT_0 = 0x30, 0x17, 0x18, 0xA0


@dataclass(frozen=True)
class CertInfo:
    """The fields of one certificate the checks read (``issuer``/``subject``: raw DER Names)."""

    not_before: datetime
    not_after: datetime
    issuer: bytes
    subject: bytes


def check_key_pair(cert_file: str, key_file: str, now: datetime | None = None) -> list[str]:
    """Check the server key pair as ``orch up`` will serve it; returns warnings (a certificate
    that expires within :data:`EXPIRY_WARNING_DAYS` days).

    Raises:
        ConfigError: the key does not match the certificate, the key is encrypted or
            unreadable, a certificate is expired or not yet valid, or the chain is out of
            order; the message names the file and the problem.
    """
    _check_key_matches(cert_file, key_file)
    with open(cert_file, "rb") as f:
        certs = [_parse_cert(base64.b64decode(m)) for m in _PEM_CERT.findall(f.read())]
    now = now or datetime.now(timezone.utc)
    warnings = []
    for i, cert in enumerate(certs):
        which = "the server certificate" if i == 0 else f"certificate {i + 1} of the chain"
        if now < cert.not_before:
            raise ConfigError(f"router.tls.cert_file: {which} in {cert_file} is not valid "
                              f"before {cert.not_before:%Y-%m-%d %H:%M} UTC: every client "
                              "would refuse it; check the host clock or issue it again")
        if now > cert.not_after:
            raise ConfigError(f"router.tls.cert_file: {which} in {cert_file} expired on "
                              f"{cert.not_after:%Y-%m-%d %H:%M} UTC: every client would refuse "
                              "it; renew it")
        if cert.not_after - now < timedelta(days=EXPIRY_WARNING_DAYS):
            warnings.append(f"router.tls.cert_file: {which} in {cert_file} expires on "
                            f"{cert.not_after:%Y-%m-%d %H:%M} UTC (in {_days(cert.not_after - now)}"
                            "): renew it soon")
        if i + 1 < len(certs) and cert.issuer != certs[i + 1].subject:
            raise ConfigError(f"router.tls.cert_file: certificate {i + 2} in {cert_file} did "
                              f"not issue {which}: put the server certificate first, then "
                              "each issuer in order")
    return warnings


def _check_key_matches(cert_file: str, key_file: str) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # NOTE: the password callback keeps OpenSSL from prompting on the terminal.
        context.load_cert_chain(cert_file, key_file, password=lambda: b"")
    except ssl.SSLError as exc:
        why = exc.reason or str(exc)
        if "KEY_VALUES_MISMATCH" in why:
            raise ConfigError(f"router.tls.key_file: {key_file} is not the private key of the "
                              f"certificate in {cert_file}: give the key the certificate was "
                              "issued for") from None
        raise ConfigError(f"router.tls: {cert_file} / {key_file} cannot be loaded as a key "
                          f"pair ({why}): give a PEM certificate and its unencrypted PEM "
                          "private key") from None


def _days(delta: timedelta) -> str:
    return f"{delta.days} days" if delta.days else f"{delta.seconds // 3600} hours"


def _parse_cert(der: bytes) -> CertInfo:
    """Validity, issuer and subject of one DER certificate (RFC 5280, 4.1)."""
    _, tbs_start, _ = _item(der, 0)  # Certificate ::= SEQUENCE { tbsCertificate, ... }
    tag, pos, end = _item(der, tbs_start)  # TBSCertificate ::= SEQUENCE
    fields = []
    while pos < end and len(fields) < 6:
        tag, body, nxt = _item(der, pos)
        if not (fields == [] and tag == _CONTEXT_0):  # [0] version is optional
            fields.append((tag, der[pos:nxt], body, nxt))
        pos = nxt
    # serial, signature, issuer, validity, subject
    _, issuer, _, _ = fields[2]
    _, _, validity, _ = fields[3]
    _, subject, _, _ = fields[4]
    before_tag, before, before_end = _item(der, validity)
    after_tag, after, after_end = _item(der, before_end)
    return CertInfo(_time(before_tag, der[before:before_end]),
                    _time(after_tag, der[after:after_end]), issuer, subject)


def _item(der: bytes, pos: int) -> tuple[int, int, int]:
    """(tag, start of contents, end of item) of the DER item at ``pos``."""
    tag, length = der[pos], der[pos + 1]
    pos += 2
    if length & 0x80:
        n = length & 0x7F
        length = int.from_bytes(der[pos:pos + n], "big")
        pos += n
    return tag, pos, pos + length


def _time(tag: int, contents: bytes) -> datetime:
    text = contents.decode("ascii").rstrip("Z")
    fmt = "%y%m%d%H%M%S" if tag == _UTC_TIME else "%Y%m%d%H%M%S"
    return datetime.strptime(text, fmt).replace(tzinfo=timezone.utc)
