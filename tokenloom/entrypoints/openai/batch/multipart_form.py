"""multipart/form-data bodies (file uploads), parsed with the standard library's MIME parser.

The body guard has already read the whole body within the upload limit, so a parser that works on bytes
in memory is enough, and the server needs no extra package for its one upload route.
"""
from __future__ import annotations

import email.parser
import email.policy
from dataclasses import dataclass
from email.message import EmailMessage


@dataclass(frozen=True)
class FormPart:
    name: str
    filename: str | None
    content: bytes


class MultipartError(ValueError):
    """The body is not a well-formed multipart/form-data body."""


def parse_form(content_type: str, body: bytes) -> dict[str, FormPart]:
    """The form's parts by field name (the first of each name)."""
    if not content_type.lower().startswith("multipart/form-data") or "boundary=" not in content_type:
        raise MultipartError("expected a multipart/form-data body with a boundary")
    header = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(header + body)
    if not isinstance(message, EmailMessage) or not message.is_multipart():
        raise MultipartError("the multipart body has no parts")
    parts: dict[str, FormPart] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str) or name in parts:
            continue
        payload = part.get_payload(decode=True)
        content = payload if isinstance(payload, bytes) else b""
        parts[name] = FormPart(name, part.get_filename(), content)
    return parts
