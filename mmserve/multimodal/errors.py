"""Typed, user-facing media errors.

Every failure to fetch, decode or preprocess a media item raises a subclass of `MediaError`. Its message
names the item and the problem in words a client can act on; `status` is the HTTP status the API server
answers with (400 by default, 413 when an item is too large). Nothing in the media path may let a raw
PIL/av/soundfile/httpx exception escape: wrap it in one of these.
"""

from __future__ import annotations


class MediaError(Exception):
    """Base class: bad media supplied by the client (HTTP 400)."""

    status: int = 400
    code: str = "invalid_media"

    def __init__(self, message: str, *, item: str | None = None) -> None:
        self.item = item
        super().__init__(f"{item}: {message}" if item else message)

    @property
    def failure(self):
        """This error as the Failure every boundary carries."""
        from mmserve.transport.messages import Failure

        return Failure(self.status, self.code, str(self))


class MediaFetchError(MediaError):
    """The media could not be retrieved (network error, HTTP error, timeout)."""

    code = "media_fetch_failed"


class MediaForbiddenError(MediaError):
    """The reference points somewhere we refuse to read (private address, file outside the allowed dir)."""

    code = "media_forbidden"


class MediaTooLargeError(MediaError):
    """The item exceeds a size limit (bytes, pixels, frames, seconds)."""

    status = 413
    code = "media_too_large"


class MediaDecodeError(MediaError):
    """The bytes are not a valid image / video / audio of a supported format."""

    code = "media_decode_failed"


class MediaNotCachedError(MediaError):
    """A part refers to an item by its uuid alone and no cache here holds it: the client must send the
    media."""

    code = "media_not_cached"


class UnsupportedMediaError(MediaError):
    """The modality or format is not supported by this model or server."""

    code = "unsupported_media"


class EncoderUnavailableError(MediaError):
    """No encoder can take this item: no healthy encoder service and no local tower (HTTP 503)."""

    status = 503
    code = "encoder_unavailable"
