"""OpenAI's Batch API shapes: ids, the file and batch objects, input-line checks and
output lines, exactly as OpenAI's API reference gives them (and as the official
``openai`` client's ``FileObject``, ``Batch`` and ``BatchRequestOutput`` types read
them).

Input lines (one JSON object per line)::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

Checked when the batch is created, as OpenAI does: a file with any bad line fails
the batch (status ``failed``, ``errors.data`` naming each bad line, up to
``MAX_REPORTED_ERRORS``). A line's body is checked as the OpenAI front end checks a
request (``protocol.parse_openai``: a served model, the fields the proxy reads);
the rest is vLLM's, whose 4xx answer becomes that line's result in the error file.
So does the 400 of a line over the proxy's own bounds (``admission.max_n``),
checked when the line runs (``runner.py``), against the config of that time.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from proxy.errors import APIError
from proxy.protocol import Endpoint, parse_openai

ENDPOINTS: dict[str, Endpoint] = {
    "/v1/chat/completions": "chat/completions",
    "/v1/completions": "completions",
}
COMPLETION_WINDOWS = {"24h": 24 * 3600}
MAX_REPORTED_ERRORS = 100
MAX_CUSTOM_ID_CHARS = 512
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": row["id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": row["created_at"],
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


def batch_object(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": row["id"],
        "object": "batch",
        "endpoint": row["endpoint"],
        "errors": json.loads(row["errors"]) if row["errors"] else None,
        "input_file_id": row["input_file_id"],
        "completion_window": row["completion_window"],
        "status": row["status"],
        "output_file_id": row["output_file_id"],
        "error_file_id": row["error_file_id"],
        "created_at": row["created_at"],
        "in_progress_at": row["in_progress_at"],
        "expires_at": row["expires_at"],
        "finalizing_at": row["finalizing_at"],
        "completed_at": row["completed_at"],
        "failed_at": row["failed_at"],
        "expired_at": row["expired_at"],
        "cancelling_at": row["cancelling_at"],
        "cancelled_at": row["cancelled_at"],
        "request_counts": {
            "total": row["total"],
            "completed": row["completed"],
            "failed": row["failed"],
        },
        "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
    }


def check_metadata(value: Any) -> dict[str, str] | None:
    """OpenAI's metadata rule: at most 16 string pairs, keys <= 64 and values <= 512."""
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or len(value) > MAX_METADATA_PAIRS
        or not all(
            isinstance(k, str)
            and isinstance(v, str)
            and len(k) <= MAX_METADATA_KEY
            and len(v) <= MAX_METADATA_VALUE
            for k, v in value.items()
        )
    ):
        raise APIError(
            400,
            f"metadata: at most {MAX_METADATA_PAIRS} string pairs, keys at most "
            f"{MAX_METADATA_KEY} and values at most {MAX_METADATA_VALUE} characters",
            param="metadata",
            code="invalid_metadata",
        )
    return value


def _error(line: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def parse_input(
    path: Path, url: str, served: list[str], max_lines: int
) -> tuple[list[tuple[int, str, str]], list[dict[str, Any]]]:
    """The lines of an input file as (index, custom_id, body JSON), and the errors
    (empty when the file is good). Blocking: called on a thread."""
    endpoint = ENDPOINTS[url]
    lines: list[tuple[int, str, str]] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    for n, raw in _numbered_lines(path):
        if len(errors) >= MAX_REPORTED_ERRORS:
            break
        if len(lines) >= max_lines:
            errors.append(_error(n, "too_many_requests",
                                 f"a batch may hold at most {max_lines} requests"))  # fmt: skip
            break
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            errors.append(_error(n, "invalid_json_line", "this line is not valid JSON"))
            continue
        if not isinstance(obj, dict):
            errors.append(_error(n, "invalid_json_line", "a line must be a JSON object"))
            continue
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            errors.append(_error(n, "missing_required_parameter",
                                 "custom_id must be a non-empty string", "custom_id"))  # fmt: skip
            continue
        if len(custom_id) > MAX_CUSTOM_ID_CHARS:
            errors.append(_error(n, "invalid_custom_id",
                                 f"custom_id exceeds {MAX_CUSTOM_ID_CHARS} characters",
                                 "custom_id"))  # fmt: skip
            continue
        if custom_id in seen:
            errors.append(_error(n, "duplicate_custom_id",
                                 f"custom_id {custom_id!r} appears more than once",
                                 "custom_id"))  # fmt: skip
            continue
        if obj.get("method") != "POST":
            errors.append(_error(n, "invalid_method", "method must be POST", "method"))
            continue
        if obj.get("url") != url:
            errors.append(_error(n, "invalid_url",
                                 f"url must be the batch's endpoint, {url}", "url"))  # fmt: skip
            continue
        body = obj.get("body")
        try:
            parse_openai(body, endpoint, served)
        except APIError as e:  # vLLM's model-not-found has the status as its code
            code = e.code if isinstance(e.code, str) and e.code else None
            code = code or ("model_not_found" if e.status == 404 else "invalid_request")
            errors.append(_error(n, code, e.message, e.param))
            continue
        seen.add(custom_id)
        lines.append((len(lines), custom_id, json.dumps(body, separators=(",", ":"))))
    if not lines and not errors:
        errors.append(_error(0, "empty_file", "the input file holds no requests"))
    return lines, errors


def _numbered_lines(path: Path) -> Iterator[tuple[int, str]]:
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                yield n, raw.decode("utf-8")
            except UnicodeDecodeError:
                yield n, "\x00"  # not JSON: reported as an invalid line


def output_line(custom_id: str, status: int, body: Any) -> dict[str, Any]:
    """One line of the output (status 200) or error file: the request's answer."""
    request_id = body.get("id") if isinstance(body, dict) else None
    return {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": {
            "status_code": status,
            "request_id": request_id or new_id("req_"),
            "body": body,
        },
        "error": None,
    }


def error_line(custom_id: str, code: str, message: str) -> dict[str, Any]:
    """One line of the error file for a request that got no answer from a model."""
    return {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
