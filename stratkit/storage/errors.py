"""What a store's failure means, said the same way for every backend (and without credentials).

s3fs, gcsfs, adlfs and pyarrow raise their own exceptions (botocore's,
aiohttp's, azure-core's, OSError with codes); `translate` sorts them into the
few things a user can act on: the bucket or object is missing, the
credentials were refused or are missing, the store cannot be reached, or
something else. `StoreError.kind` is that sort; `StoreError.transient` says
whether trying again later can help (an upload beside training retries those).
"""

from __future__ import annotations

import errno

from stratkit.storage import urls

#: StoreError kinds.
MISSING, DENIED, NO_CREDENTIALS, UNREACHABLE, OTHER = "missing", "denied", "no credentials", "unreachable", "other"

_DENIED_WORDS = ("AccessDenied", "Access Denied", "Forbidden", "SignatureDoesNotMatch", "signature we calculated",
                 "InvalidAccessKeyId", "AuthorizationFailure", "AuthenticationFailed", "Unauthorized",
                 "ClientAuthenticationError", "ExpiredToken", "invalid_grant", "PermissionDenied")
_NO_CREDENTIALS_WORDS = ("Unable to locate credentials", "NoCredentialsError", "DefaultCredentialsError",
                         "could not automatically determine credentials", "No credentials")
_UNREACHABLE_WORDS = ("Could not connect", "Cannot connect", "Connection refused", "ConnectionRefused",
                      "EndpointConnectionError", "Connect timeout", "ConnectTimeout", "timed out", "Timeout",
                      "Name or service not known", "ServerDisconnected", "Connection reset", "ClientConnectorError",
                      "ServiceUnavailable", "Service Unavailable", "Bad Gateway", "Failed to establish")
_MISSING_WORDS = ("NoSuchBucket", "NoSuchKey", "does not exist", "ContainerNotFound", "BlobNotFound",
                  "ResourceNotFoundError", "Not Found")


class StoreError(OSError):
    """A store operation failed: `kind` (missing, denied, no credentials, unreachable, other), the URL, the cause."""

    def __init__(self, message: str, kind: str, url: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.url = url

    @property
    def transient(self) -> bool:
        """Trying again later may succeed (the store was down or overloaded)."""
        return self.kind in (UNREACHABLE, OTHER)


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and exc not in seen and len(seen) < 10:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return seen


def _text(exc: BaseException) -> str:
    return " | ".join(f"{type(e).__name__}: {e}" for e in _chain(exc))


def kind_of(exc: BaseException) -> str:
    """Which of the kinds `exc` (and what caused it) is."""
    text = _text(exc)
    chain = _chain(exc)
    if any(word in text for word in _NO_CREDENTIALS_WORDS):
        return NO_CREDENTIALS
    if any(isinstance(e, PermissionError) for e in chain) or any(word in text for word in _DENIED_WORDS):
        return DENIED
    if any(isinstance(e, FileNotFoundError) for e in chain) or any(word in text for word in _MISSING_WORDS):
        return MISSING
    if any(isinstance(e, (ConnectionError, TimeoutError)) for e in chain) or \
            any(isinstance(e, OSError) and e.errno in (errno.ECONNREFUSED, errno.ECONNRESET, errno.ETIMEDOUT,
                                                        errno.EHOSTUNREACH, errno.ENETUNREACH) for e in chain) or \
            any(word in text for word in _UNREACHABLE_WORDS):
        return UNREACHABLE
    return OTHER


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def translate(exc: BaseException, action: str, url: str) -> OSError:
    """`exc` (raised while trying to `action` `url`) as a `StoreError`, or a `FileNotFoundError` for a missing object.

    The message names the action, the URL (redacted) and the backend's own first
    line (backends do not put secrets in their messages; URLs are redacted).
    """
    shown = urls.redact(url)
    kind = kind_of(exc)
    cause = f"{type(exc).__name__}: {_first_line(exc)}"
    if kind == MISSING:
        missing = FileNotFoundError(errno.ENOENT, f"{shown} does not exist ({cause})")
        missing.filename = shown
        return missing
    told = {DENIED: "the store refused the credentials", NO_CREDENTIALS: "no credentials were found for the store",
            UNREACHABLE: "the store could not be reached", OTHER: "the store failed"}[kind]
    return StoreError(f"could not {action} {shown}: {told} ({cause})", kind, shown)

