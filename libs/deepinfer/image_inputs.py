"""Image inputs of the offline API (``LLM.generate``'s ``multi_modal_data``, ``LLM.chat``'s ``image_url`` parts),
resolved to encoded bytes: the engine and the encoders take nothing else.

An image may be given as encoded bytes (PNG, JPEG, ...), a PIL image (encoded to PNG here), a ``data:`` URL with
base64 content, or — only when the ``LLM`` was given ``allowed_local_media_path`` — a local file path or ``file://``
URL inside that folder. Nothing is fetched over a network: ``http(s)://`` URLs are refused.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

MAX_IMAGE_BYTES = 64 << 20  # an encoded image larger than this is refused


def image_bytes(
    source: Any, where: str, local_root: Path | None = None, allow_with: str = "LLM(allowed_local_media_path=...)"
) -> bytes:
    """The encoded bytes of one image ``source``; ValueError naming ``where`` when it cannot be used (``allow_with``:
    what lets local files be read, named in the refusal of one)."""
    if isinstance(source, bytes | bytearray | memoryview):
        data = bytes(source)
    elif _is_pil(source):
        buf = io.BytesIO()
        source.save(buf, format="PNG")
        data = buf.getvalue()
    elif isinstance(source, str | Path):
        data = _from_reference(str(source), where, local_root, allow_with)
    else:
        raise ValueError(
            f"{where}: an image must be bytes, a PIL image, a data: URL or a local path, got {type(source).__name__}"
        )
    if not data:
        raise ValueError(f"{where}: the image is empty")
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"{where}: the image is {len(data)} bytes, the limit is {MAX_IMAGE_BYTES}")
    return data


def _is_pil(x: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - Pillow is a dependency of image input
        return False
    return isinstance(x, Image.Image)


def _from_reference(ref: str, where: str, local_root: Path | None, allow_with: str) -> bytes:
    scheme = urlparse(ref).scheme.lower() if "://" in ref or ref.startswith("data:") else ""
    if scheme == "data":
        head, sep, payload = ref.partition(",")
        if not sep or not head.endswith(";base64"):
            raise ValueError(f"{where}: a data: URL must be base64 (data:image/png;base64,...)")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"{where}: the data: URL's base64 content does not decode ({e})") from e
    if scheme in ("http", "https"):
        raise ValueError(f"{where}: images are not fetched from the network; pass the bytes or a data: URL")
    if scheme not in ("", "file"):
        raise ValueError(f"{where}: unsupported image URL scheme {scheme!r} (use a data: URL)")
    if local_root is None:
        raise ValueError(f"{where}: local image files are not allowed (set {allow_with})")
    path = Path(unquote(urlparse(ref).path) if scheme == "file" else ref).resolve()
    root = local_root.resolve()
    if not path.is_relative_to(root):
        raise ValueError(f"{where}: {str(path)!r} is outside allowed_local_media_path {str(root)!r}")
    if not path.is_file():
        raise ValueError(f"{where}: no image file at {str(path)!r}")
    return path.read_bytes()


def prompt_images(prompt: Any, where: str, local_root: Path | None) -> list[bytes] | None:
    """The images of a ``generate`` prompt dict (``{"prompt" | "prompt_token_ids": ..., "multi_modal_data":
    {"image": one or a list}}``), or None when it has none."""
    if not isinstance(prompt, dict) or prompt.get("multi_modal_data") is None:
        return None
    data = prompt["multi_modal_data"]
    if not isinstance(data, dict) or set(data) - {"image"}:
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{where}.multi_modal_data: only {{'image': ...}} is supported, got {got}")
    items = data.get("image")
    items = items if isinstance(items, list | tuple) else [items]
    if not items or items == [None]:
        raise ValueError(f"{where}.multi_modal_data.image: at least one image is required")
    return [image_bytes(x, f"{where}.multi_modal_data.image[{k}]", local_root) for k, x in enumerate(items)]


def chat_images(messages: list[dict], placeholder: str, local_root: Path | None) -> tuple[list[dict], list[bytes]]:
    """``messages`` with each ``{"type": "image_url", "image_url": {"url": ...}}`` content part replaced by a text
    part holding the image placeholder, and the images in order of appearance."""
    out, images = [], []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list) or not any(_is_image_part(p) for p in content):
            out.append(m)
            continue
        parts = []
        for k, part in enumerate(content):
            if not _is_image_part(part):
                parts.append(part)
                continue
            where = f"messages[{i}].content[{k}].image_url"
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise ValueError(f"{where}: expected {{'url': str}}, got {type(url).__name__}")
            images.append(image_bytes(url, where, local_root))
            parts.append({"type": "text", "text": placeholder})
        out.append({**m, "content": parts})
    return out, images


def _is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


__all__ = ["MAX_IMAGE_BYTES", "chat_images", "image_bytes", "prompt_images"]
