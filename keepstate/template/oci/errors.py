"""What a pull can fail with, each a keepstate.errors class so the API renders it as {"code", "message"}.

    ImageNotFound        404  the repository, tag or digest does not exist
    RegistryAuthFailed   401  credentials needed and not given, or refused
    DigestMismatch       422  a blob, manifest or layer is not what its digest says
    UnsafeLayer          422  a layer writes outside the root (`..`, a hardlink out)
    UnsupportedImage     501  a media type or platform we do not unpack
    RegistryUnavailable  503  the registry cannot be reached, or answers 5xx
"""

from __future__ import annotations

from keepstate.errors import NotFound, Refused, Unauthorized, Unavailable, Unsupported


class ImageNotFound(NotFound):
    pass


class RegistryAuthFailed(Unauthorized):
    pass


class DigestMismatch(Refused):
    pass


class UnsafeLayer(Refused):
    pass


class UnsupportedImage(Unsupported):
    pass


class RegistryUnavailable(Unavailable):
    pass
