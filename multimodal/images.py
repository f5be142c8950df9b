"""Image references, cheap header probes, safe decoding and Qwen-VL resizing.

A dataset never holds decoded pixels: each row keeps :class:`ImageRef` objects (a path, the
encoded bytes of an in-memory row, a PIL image the user already had in memory, or a row of
a memory-mapped Arrow table). :func:`probe` reads only the image header (size and mode),
which is enough to know, before any pixel is decoded, how the image will be resized and how
many tokens it becomes. :func:`decode` opens the pixels when a rollout needs them.

Bad images never reach the model. Each problem is either a :class:`ImageError` that names
the file and the dataset row, or a fix that is documented here and counted by the dataset:

========================  ===================================================================
missing / unreadable file  error (or, with ``bad_images: skip``, the row is dropped, counted)
corrupt / truncated data   error naming the file and row at load time: headers are read, and
                           a JPEG or PNG whose data does not end (no end marker) is decoded
                           to confirm (:func:`check_complete`); with ``bad_images: skip``
                           every image is decoded once at load (:func:`check_pixels`) and such
                           a row is dropped, counted
``data:`` URI              decoded (base64 or percent-encoded) to the image's bytes; a URI
                           that is not an image, or bad base64, is an error
grayscale, RGBA, palette   converted to RGB (RGBA over white), counted as ``converted_rgb``
16-bit grey (``I;16``)     scaled to 8 bits (0..65535 -> 0..255, as viewers show it; a plain
                           conversion clips it to white), counted ``scaled_16bit``, logged
EXIF orientation           applied as viewers do (``ImageOps.exif_transpose``: rotated or
                           flipped, width and height swapped for 90-degree turns, before the
                           size is counted), counted ``exif_transposed``, logged
tiny (even 1x1)            upscaled to ``min_pixels`` by ``smart_resize``, counted ``upscaled``
over ``max_pixels``        downscaled to fit, counted ``downscaled``
over ``max_source_pixels`` error: decoding it would need too much memory (a 20000x20000
                           image is 1.2 GB of RGB); downscale it offline or raise the limit
aspect ratio over 200      error (Qwen-VL's resize rule cannot keep such an image)
========================  ===================================================================
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

DEFAULT_MAX_SOURCE_PIXELS = 64 * 1024 * 1024  # 64M pixels: 192 MB as RGB
MAX_ASPECT_RATIO = 200  # qwen_vl_utils.smart_resize refuses anything longer


class ImageError(ValueError):
    """An image cannot be used; the message names the file and the dataset row."""


@dataclass(frozen=True)
class ImageRef:
    """Where one image comes from, without its pixels.

    ``kind``: ``path`` (``source`` is the file path), ``bytes`` (``source`` holds the encoded
    file), ``pil`` (``source`` is a PIL image the caller keeps in memory anyway) or ``arrow``
    (``source`` is ``(table, row, column, index)`` of a memory-mapped ``datasets`` table whose
    image column is not decoded; ``index`` is None, an image's list index, or a video
    frame's ``(video, frame)``). ``where`` names the dataset row and image for messages;
    ``name`` is what transcripts show.
    """

    kind: str
    source: Any
    where: str
    name: str

    def __reduce__(self):  # keep pickles (Ray, checkpoints of records) small and explicit
        return (ImageRef, (self.kind, self.source, self.where, self.name))


@dataclass(frozen=True)
class Header:
    """The size the model sees (after the EXIF orientation) and the stored mode."""

    width: int
    height: int
    mode: str
    orientation: int = 1  # EXIF orientation (1: as stored; 5-8 swap width and height)

    @property
    def scaled_16bit(self) -> bool:
        """Integer grey pixels (16-bit PNG or TIFF) that :func:`to_rgb` scales to 8 bits."""
        return self.mode == "I" or self.mode.startswith("I;16")

    @property
    def transposed(self) -> bool:
        return self.orientation not in (0, 1)


EXIF_ORIENTATION = 0x0112


def _open(ref: ImageRef) -> Image.Image:
    """A lazily-decoded PIL image (only the header is read here)."""
    if ref.kind == "pil":
        return ref.source
    if ref.kind == "path":
        return Image.open(ref.source)
    if ref.kind == "bytes":
        return Image.open(io.BytesIO(ref.source))
    if ref.kind == "arrow":
        return _open(_from_arrow(ref))
    raise ImageError(f"{ref.where}: unknown image reference kind {ref.kind!r}")


def _from_arrow(ref: ImageRef) -> ImageRef:
    """The image value an ``arrow`` reference points at, as a reference of its own kind."""
    table, row, column, index = ref.source
    value = table[row][column]
    # ``index``: None (one image), an int (a list of images) or a tuple (video, frame)
    for i in index if isinstance(index, tuple) else (index,):
        if isinstance(value, list) and i is not None:
            value = value[i]
    return ImageRef(*_classify(value, ref.where, ref.name, root=None), ref.where, ref.name)


def _classify(value: Any, where: str, name: str, root: Path | None) -> tuple[str, Any]:
    """(kind, source) for one raw image value of a row."""
    if isinstance(value, Image.Image):
        return "pil", value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "bytes", bytes(value)
    if isinstance(value, dict):  # datasets' undecoded Image feature: {"bytes", "path"}
        if value.get("bytes"):
            return "bytes", bytes(value["bytes"])
        if value.get("path"):
            return _classify(value["path"], where, name, root)
        raise ImageError(f"{where}: image value {sorted(value)} has neither 'bytes' nor 'path'")
    if isinstance(value, str) and value[:5].lower() == "data:":
        return "bytes", _data_uri(value, where)
    if isinstance(value, (str, os.PathLike)):
        text = str(value)
        if text.startswith("file://"):
            text = text[len("file://") :]
        if text.startswith(("http://", "https://")):
            raise ImageError(
                f"{where}: image {text!r} is a URL; download the images and give "
                "local paths (rollouts never fetch from the network)"
            )
        path = Path(text).expanduser()
        if not path.is_absolute() and root is not None:
            path = root / path
        return "path", str(path)
    raise ImageError(
        f"{where}: an image must be a path, bytes or a PIL image, not {type(value).__name__}"
    )


def _data_uri(text: str, where: str) -> bytes:
    """The bytes of a ``data:[<media type>][;base64],<data>`` image URI (RFC 2397)."""
    header, comma, payload = text[5:].partition(",")
    if not comma:
        raise ImageError(
            f"{where}: the data: URI {text[:40]!r}... has no ',' before its data; write "
            "it as data:image/png;base64,<data>"
        )
    params = [p.strip().lower() for p in header.split(";")]
    media = params[0] or "text/plain"
    if not media.startswith("image/"):
        raise ImageError(f"{where}: the data: URI holds {media!r}, not an image (image/...)")
    if "base64" in params[1:]:
        try:
            return base64.b64decode("".join(payload.split()), validate=True)
        except (binascii.Error, ValueError) as e:
            raise ImageError(f"{where}: the data: URI's base64 data is invalid ({e})") from None
    return urllib.parse.unquote_to_bytes(payload)


def make_ref(value: Any, where: str, root: Path | None) -> ImageRef:
    kind, source = _classify(value, where, "", root)
    name = source if kind == "path" else f"<{kind} image, {where}>"
    return ImageRef(kind, source, where, name)


def _describe(ref: ImageRef) -> str:
    return f"{ref.where} ({ref.name})" if ref.kind == "path" else ref.where


def probe(ref: ImageRef, max_source_pixels: int = DEFAULT_MAX_SOURCE_PIXELS) -> Header:
    """Size and mode from the image header; no pixels are decoded."""
    if ref.kind == "path" and not os.path.isfile(ref.source):
        parent = Path(ref.source).parent
        hint = "" if parent.is_dir() else f" (its directory {str(parent)!r} does not exist either)"
        raise ImageError(
            f"{ref.where}: image file {ref.source!r} does not exist{hint}. Check "
            "the path and data.args.image_root (relative paths are read from it)."
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = _open(ref)
            try:
                turn = int(img.getexif().get(EXIF_ORIENTATION) or 1)
            except Exception:  # noqa: BLE001 (unreadable EXIF: shown as stored, as viewers do)
                turn = 1
            turn = turn if 1 <= turn <= 8 else 1
            w, h = int(img.width), int(img.height)
            header = Header(*((h, w) if turn >= 5 else (w, h)), str(img.mode), turn)
    except Image.DecompressionBombError as e:
        raise ImageError(
            f"{_describe(ref)}: the image is too large to decode safely ({e}). "
            "Downscale it offline or raise data.args.max_source_pixels."
        ) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ImageError(
            f"{_describe(ref)}: not a readable image ({type(e).__name__}: {e}). "
            "The file is corrupt or not an image; replace it or drop the row."
        ) from None
    check_size(ref, header, max_source_pixels)
    return header


def check_size(ref: ImageRef, header: Header, max_source_pixels: int) -> None:
    w, h = header.width, header.height
    if w < 1 or h < 1:
        raise ImageError(f"{_describe(ref)}: the image has no pixels ({w}x{h}).")
    if w * h > max_source_pixels:
        raise ImageError(
            f"{_describe(ref)}: the image is {w}x{h} = {w * h:,} pixels, over "
            f"data.args.max_source_pixels={max_source_pixels:,}; decoding it would "
            f"take {3 * w * h / 2**20:,.0f} MB. Downscale it offline, or raise the "
            "limit if the memory is there (it is resized to max_pixels anyway)."
        )
    if max(w, h) / min(w, h) > MAX_ASPECT_RATIO:
        raise ImageError(
            f"{_describe(ref)}: the image is {w}x{h}; an aspect ratio over "
            f"{MAX_ASPECT_RATIO} cannot be resized for Qwen-VL. Crop or pad it."
        )


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB pixels; transparent images are composited over white (as qwen_vl_utils does);
    16-bit (and 32-bit integer) grey is scaled from 0..65535 to 0..255 (PIL's own conversion
    clips it, so a 16-bit image would be all white)."""
    if img.mode == "RGB":
        return img
    if img.mode == "I" or img.mode.startswith("I;16"):
        wide = np.clip(np.asarray(img, dtype=np.int64), 0, 65535)
        img = Image.fromarray(((wide * 255 + 32767) // 65535).astype(np.uint8), mode="L")
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA"):
        rgba = img.convert("RGBA")
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    return img.convert("RGB")


def _undecodable(ref: ImageRef, e: BaseException) -> ImageError:
    return ImageError(
        f"{_describe(ref)}: the image header is fine but its pixel data cannot "
        f"be decoded ({type(e).__name__}: {e}); the file is truncated or "
        "corrupt. Replace it or drop the row."
    )


def check_pixels(ref: ImageRef) -> None:
    """Decode the image's pixels once and drop them: an ImageError when the data is
    truncated or corrupt beyond its header. A JPEG is decoded at 1/8 scale (its DCT allows
    it), which still reads every byte of its compressed data."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = _open(ref)
            if ref.kind == "pil":
                return  # already in memory: decoded by whoever made it
            if img.format == "JPEG":
                img.draft(img.mode, (max(1, img.width // 8), max(1, img.height // 8)))
            img.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise _undecodable(ref, e) from None


def _encoded(ref: ImageRef) -> ImageRef | None:
    """The path or bytes behind ``ref`` (an arrow row resolved); None for a PIL image."""
    if ref.kind == "arrow":
        return _encoded(_from_arrow(ref))
    return ref if ref.kind in ("path", "bytes") else None


_ENDS = {  # format: (how the file starts, how its data ends when complete)
    "JPEG": (b"\xff\xd8\xff", b"\xff\xd9"),
    "PNG": (b"\x89PNG\r\n\x1a\n", b"IEND\xaeB`\x82"),
}


def check_complete(ref: ImageRef) -> None:
    """An ImageError when the image's data is cut short. A JPEG or PNG that ends with its
    end marker (EOI, IEND) passes from 16 bytes read at each end; any other image (another
    format, or one with bytes after its marker) is decoded once to be sure
    (:func:`check_pixels`)."""
    found = _encoded(ref)
    if found is None:
        return
    if found.kind == "path":
        with open(found.source, "rb") as f:
            head = f.read(16)
            f.seek(max(0, os.fstat(f.fileno()).st_size - 16))
            tail = f.read()
    else:
        head, tail = found.source[:16], found.source[-16:]
    if any(head.startswith(start) and tail.endswith(end) for start, end in _ENDS.values()):
        return
    check_pixels(ref)


def decode(ref: ImageRef, max_source_pixels: int = DEFAULT_MAX_SOURCE_PIXELS) -> Image.Image:
    """The image's pixels as RGB, turned as its EXIF orientation says; errors name the file
    and row."""
    header = probe(ref, max_source_pixels)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = _open(ref)
            img.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise _undecodable(ref, e) from None
    if header.transposed:
        img = ImageOps.exif_transpose(img)
    if (img.width, img.height) != (header.width, header.height):  # pragma: no cover (defensive)
        raise ImageError(f"{_describe(ref)}: decoded size {img.size} differs from the header")
    return to_rgb(img)


@dataclass(frozen=True)
class ResizeRule:
    """How images are resized for the model (Qwen-VL's ``smart_resize``)."""

    min_pixels: int
    max_pixels: int
    patch_size: int = 14  # 16 for Qwen3-VL
    merge_size: int = 2
    temporal_patch_size: int = 2
    max_source_pixels: int = DEFAULT_MAX_SOURCE_PIXELS

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def __post_init__(self) -> None:
        if self.min_pixels < 1 or self.max_pixels < self.min_pixels:
            raise ValueError(
                f"pixel limits must satisfy 1 <= min_pixels <= max_pixels, got "
                f"min_pixels={self.min_pixels}, max_pixels={self.max_pixels}"
            )
        if self.max_pixels < self.factor**2:
            raise ValueError(
                f"max_pixels={self.max_pixels} is below one merged patch "
                f"({self.factor}x{self.factor}={self.factor**2} pixels)"
            )

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) after resizing, through ``qwen_vl_utils.smart_resize``."""
        from qwen_vl_utils import smart_resize

        h, w = smart_resize(
            height,
            width,
            factor=self.factor,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
        )
        return w, h

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """``image_grid_thw`` of one image of this source size."""
        w, h = self.resized(width, height)
        return 1, h // self.patch_size, w // self.patch_size

    def tokens(self, width: int, height: int) -> int:
        """Placeholder tokens the image takes in the prompt: t*h*w / merge^2."""
        t, gh, gw = self.grid(width, height)
        return t * gh * gw // self.merge_size**2

    def video_grid(self, frames: int, width: int, height: int) -> tuple[int, int, int]:
        """``video_grid_thw`` of ``frames`` frames of this source size. An odd count (for a
        temporal patch of 2) takes ceil(frames / temporal_patch_size) steps: the video
        processor repeats the last frame to fill the final step."""
        _, gh, gw = self.grid(width, height)
        return -(-frames // self.temporal_patch_size), gh, gw

    def video_tokens(self, frames: int, width: int, height: int) -> int:
        """Placeholder tokens a video takes: (T / temporal_patch_size)*h*w / merge^2."""
        t, gh, gw = self.video_grid(frames, width, height)
        return t * gh * gw // self.merge_size**2

    def apply(self, img: Image.Image) -> Image.Image:
        """Resize RGB pixels with ``qwen_vl_utils.fetch_image`` (the reference implementation)."""
        from qwen_vl_utils import fetch_image

        return fetch_image(
            {"image": img, "min_pixels": self.min_pixels, "max_pixels": self.max_pixels},
            image_patch_size=self.patch_size,
        )
