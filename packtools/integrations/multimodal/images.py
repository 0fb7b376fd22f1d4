"""Images and messages of TRL's vision rows as the model's processor opens them, each bad one refused by name
(the row, ``row N`` or ``FILE:LINE``, and the image).
"""

from __future__ import annotations

import io
import os
from typing import Any

from ..._optional import require
from ...errors import PackingError


def where_of(row: int | str) -> str:
    """``row N`` for a row number, else the ``FILE:LINE`` given."""
    return f"row {row}" if isinstance(row, int) else str(row)


#: What a URL starts with: packtools opens local files only (it never fetches).
URL_SCHEMES = ("http://", "https://", "ftp://", "s3://", "gs://", "hf://")


def open_image(value: Any, row: int | str) -> Any:
    """A PIL image from a PIL image, a path, bytes, or ``datasets``' ``{"bytes": ..., "path": ...}``, opened as
    the model's processor opens it.

    A path or bytes is opened as ``transformers.image_utils.load_image`` opens a path (and ``datasets``' ``Image``
    feature a file): decoded at once (``load()``, so a truncated file fails here, naming it), turned by its EXIF
    orientation (``PIL.ImageOps.exif_transpose``: a phone photo stored sideways is seen upright) and converted
    to RGB (palettes and alpha as ``Image.convert("RGB")`` does).  A PIL image given as it is (a ``datasets``
    ``Image`` column, already decoded) is turned by its EXIF orientation only; the image processor converts
    its mode as it does for any PIL image.  ``row``: the row number, or ``"FILE:LINE"``, for the errors.

    >>> open_image(b"not an image", 3)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    packtools.errors.PackingError: row 3: cannot open image ...
    """
    Image = require("PIL.Image", "opening images (the images column)")
    ImageOps = require("PIL.ImageOps", "opening images (the images column)")
    if isinstance(value, Image.Image):
        return ImageOps.exif_transpose(value)
    source, name = _image_source(value, row)
    try:
        img = Image.open(source)
        img.load()  # decode now: a truncated or damaged file fails here, with its name
        return ImageOps.exif_transpose(img).convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
        raise PackingError(f"{where_of(row)}: cannot open image {name!r}: {err}", param="images") from err


def _image_source(value: Any, row: int | str) -> tuple[Any, str]:
    """What ``PIL.Image.open`` takes for a path, bytes or ``datasets``' ``{"bytes": ..., "path": ...}`` (bytes
    as a file object), and the image's name for errors; a URL or any other value is refused by name."""
    where = where_of(row)
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, str) and value.lower().startswith(URL_SCHEMES):
        raise PackingError(
            f"{where}: image {value[:80]!r} is a URL; packtools does not fetch images. Download it and name the "
            f"local file (a path relative to the JSON-lines file's folder, or absolute).",
            param="images",
        )
    if not isinstance(value, (bytes, bytearray, str, os.PathLike)):
        raise PackingError(
            f"{where}: an image must be a path, bytes or a PIL image, got {type(value).__name__}.",
            param="images",
        )
    if isinstance(value, (bytes, bytearray)):
        return io.BytesIO(value), "<bytes>"
    return value, str(value)[:120]


def image_list(images: Any, row: int | str) -> list[Any]:
    """A row's ``images`` as a list (None: no image); a single string or other non-list is refused by name."""
    if images is None:
        return []
    if isinstance(images, (str, bytes, bytearray, dict)) or not isinstance(images, (list, tuple)):
        raise PackingError(
            f"{where_of(row)}: 'images' must be a list (one entry per image part, in order), got "
            f"{type(images).__name__} {str(images)[:60]!r}; write [{str(images)[:40]!r}].",
            param="images",
        )
    return list(images)


def check_messages(messages: Any, row: int | str) -> None:
    """Refuse, by name, ``messages`` that are not a non-empty list of messages, and video content parts
    (packtools packs images only: a video part would be written as its placeholder with no video)."""
    where = where_of(row)
    if not isinstance(messages, (list, tuple)) or not messages:
        raise PackingError(
            f"{where}: 'messages' must be a non-empty list of messages, got {str(messages)[:60]!r}; remove the "
            f"row or give it its conversation.",
            param="messages",
        )
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and (part.get("type") == "video" or "video" in part):
                raise PackingError(
                    f"{where}: message {i} has a video part ({str(part)[:60]}); packtools packs images only "
                    f"(video positions are not verified). Remove the video samples, or train them unpacked.",
                    param="messages",
                )


def image_size(value: Any, row: int | str) -> tuple[int, int]:
    """``(height, width)`` of an image as :func:`open_image` gives it (EXIF orientation applied), read from the
    file's header without decoding its pixels."""
    Image = require("PIL.Image", "opening images (the images column)")
    if isinstance(value, Image.Image):
        img = value
    else:
        source, name = _image_source(value, row)
        try:
            img = Image.open(source)
        except (OSError, ValueError, SyntaxError) as err:
            raise PackingError(f"{where_of(row)}: cannot open image {name!r}: {err}", param="images") from err
    orientation = img.getexif().get(0x0112, 1)
    w, h = img.size
    return (w, h) if orientation in (5, 6, 7, 8) else (h, w)  # 5-8: turned by a quarter
