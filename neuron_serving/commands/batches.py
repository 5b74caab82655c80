"""`neuron-serving batches list|show|cancel|submit`: the proxy's OpenAI Batch API
(proxy/batch/) from the command line.

    batches list [--limit N] [--all]            newest first
    batches show ID [--output FILE] [--errors FILE]
    batches cancel ID
    batches submit FILE [--endpoint /v1/chat/completions] [--metadata KEY=VALUE ...]

It talks to the proxy's ``/v1/files`` and ``/v1/batches`` with the official ``openai``
client, as any OpenAI user would; the key is found as `status` finds it
(``--api-key``, ``NEURON_SERVING_API_KEY``, else the ``api-key`` file of the `up` run
directory of the proxy's port). Every call is bounded (``--timeout`` per read or
write; 5 s to connect). Reads are retried by the client (at most ``READ_RETRIES``
times: connection errors, 429, 5xx); uploads, creates and cancels are not, so a
timeout never creates a second batch.

Errors are one line on stderr, never a traceback, and the exit code says what kind
(neuron_serving/exitcodes.py): the proxy unreachable, silent or failing (5xx, 429)
is ``FAILED``; a request the proxy refused (401 key, 404 id, 409 not cancellable,
400) is ``USAGE``: retrying it as is fails the same way. ``submit`` prints the new
batch's id alone on stdout (``ID=$(neuron-serving batches submit in.jsonl)``); a
file that fails the proxy's line checks still makes a batch (status ``failed``,
OpenAI's behaviour): its id is printed, the bad lines go to stderr, and the exit
code is ``FAILED``. Tables fit the terminal as `status`'s do; ``--json`` prints the
API's objects as the proxy sent them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuron_serving.commands.status import add_api_key_arg
from neuron_serving.exitcodes import ExitCode

if TYPE_CHECKING:
    import openai

DEFAULT_PROXY = "http://127.0.0.1:8080"
READ_RETRIES = 1
CONNECT_TIMEOUT_S = 5.0
PAGE = 100  # the proxy's (and OpenAI's) largest page of batches
MAX_SHOWN_ERRORS = 10  # validation errors listed by `show` and `submit` (all in --json)
KEY_SOURCES = "--api-key, NEURON_SERVING_API_KEY, the run dir's api-key file"


class CommandError(Exception):
    """A failure worth one line on stderr, with its exit code."""

    def __init__(self, message: str, code: ExitCode = ExitCode.FAILED) -> None:
        super().__init__(message)
        self.code = code


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--proxy", default=DEFAULT_PROXY, help="proxy base URL")
    add_api_key_arg(p)
    p.add_argument(
        "--timeout", type=_seconds, default=30.0, metavar="S",
        help="bound on each read or write of a call (default 30)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the API's objects as JSON")
    p.add_argument(
        "--width", type=int, default=None,
        help="fit tables to this many columns (default: the terminal's; 0 = no limit)",
    )  # fmt: skip


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("batches", help="the proxy's Batch API: list, show, cancel, submit")
    cmds = p.add_subparsers(dest="batches_command", metavar="ACTION")
    cmds.required = True

    ls = cmds.add_parser("list", help="batches, newest first")
    ls.add_argument("--limit", type=_positive, default=20, help="at most N (default 20)")
    ls.add_argument("--all", action="store_true", help="every batch (overrides --limit)")
    _common(ls)
    ls.set_defaults(func=lambda a: _guard(a, run_list))

    show = cmds.add_parser("show", help="one batch: status, counts, timestamps, file ids")
    show.add_argument("id", help="batch id (batch_...)")
    show.add_argument("--output", metavar="FILE", help="download the output file to FILE")
    show.add_argument("--errors", metavar="FILE", help="download the error file to FILE")
    _common(show)
    show.set_defaults(func=lambda a: _guard(a, run_show))

    cancel = cmds.add_parser("cancel", help="cancel a batch (lines that finished are kept)")
    cancel.add_argument("id", help="batch id (batch_...)")
    _common(cancel)
    cancel.set_defaults(func=lambda a: _guard(a, run_cancel))

    submit = cmds.add_parser("submit", help="upload a JSONL file, create a batch; print its id")
    submit.add_argument("file", type=Path, help="the input: one request per line (OpenAI's)")
    submit.add_argument(
        "--endpoint", default="/v1/chat/completions",
        help="the lines' endpoint: /v1/chat/completions (default) or /v1/completions",
    )  # fmt: skip
    submit.add_argument("--completion-window", default="24h", help="default 24h (OpenAI's only)")
    submit.add_argument(
        "--metadata", action="append", default=[], metavar="KEY=VALUE",
        help="a metadata pair for the batch (repeatable, at most 16)",
    )  # fmt: skip
    _common(submit)
    submit.set_defaults(func=lambda a: _guard(a, run_submit))


# ---- the client and its errors ------------------------------------------------------------


def _key(args: argparse.Namespace) -> str | None:
    from neuron_serving.commands.status import api_key

    return api_key(args)


def client(args: argparse.Namespace, key: str | None) -> openai.OpenAI:
    import openai

    # openai's own Timeout: the client's HTTP library changed under it (httpx, then
    # httpx2 from openai 3.63), and it refuses the other library's Timeout.
    timeout = openai.Timeout(args.timeout, connect=min(CONNECT_TIMEOUT_S, args.timeout))
    # A proxy without client keys accepts any: the client needs one to send.
    return openai.OpenAI(
        base_url=f"{args.proxy.rstrip('/')}/v1", api_key=key or "none",
        timeout=timeout, max_retries=READ_RETRIES,
    )  # fmt: skip


def _one_line(text: object, limit: int = 300) -> str:
    from neuron_serving.logsafe import printable

    return printable(" ".join(str(text).split()), limit)


def _message(e: openai.APIStatusError) -> str:
    body = e.body
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return _one_line(body["message"])
    return _one_line(e.response.reason_phrase or "") or f"HTTP {e.status_code}"


def _status_error(e: openai.APIStatusError, base: str, key: str | None) -> CommandError:
    code, msg = e.status_code, _message(e)
    if code in (401, 403):
        why = f"none found ({KEY_SOURCES})" if key is None else "the one sent was not accepted"
        return CommandError(f"{base} refused the API key (HTTP {code}): {why}", ExitCode.USAGE)
    if code == 404 and msg == "Not Found":  # aiohttp's own: the route is not there
        return CommandError(
            f"{base} has no Batch API at {e.request.url.path} (HTTP 404: not the proxy, or "
            "its batch.enabled is false)",
            ExitCode.USAGE,
        )
    if code == 404:
        return CommandError(f"not found: {msg}", ExitCode.USAGE)
    if 400 <= code < 500 and code not in (408, 429):
        return CommandError(f"refused (HTTP {code}): {msg}", ExitCode.USAGE)
    return CommandError(f"{base} answered HTTP {code}: {msg}")


def _connection_error(e: openai.APIConnectionError, base: str, timeout: float) -> CommandError:
    import openai

    if isinstance(e, openai.APITimeoutError):
        return CommandError(f"no answer from {base} within {timeout:g} s")
    cause: BaseException = e.__cause__ or e  # httpx's error, which has the socket's text
    reason = re.sub(r"^\[Errno -?\d+\] ", "", str(cause)) or type(cause).__name__
    return CommandError(f"cannot reach the proxy at {base}: {_one_line(reason)}")


def _guard(args: argparse.Namespace, body: Callable[[Any, argparse.Namespace], int]) -> int:
    """Run ``body(client, args)``; every failure becomes one line on stderr and a code."""
    import openai

    base = args.proxy.rstrip("/")
    key = _key(args)
    try:
        with client(args, key) as c:
            return body(c, args)
    except CommandError as e:
        failure = e
    except openai.APIStatusError as e:
        failure = _status_error(e, base, key)
    except openai.APIConnectionError as e:
        failure = _connection_error(e, base, args.timeout)
    except openai.OpenAIError as e:  # an answer the client could not read: not the proxy?
        failure = CommandError(f"unexpected answer from {base}: {_one_line(e)}")
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 128 + 2  # what a shell reports for SIGINT
    print(f"error: {failure}", file=sys.stderr, flush=True)
    return failure.code


# ---- output -------------------------------------------------------------------------------


def _width(args: argparse.Namespace) -> int:
    from neuron_serving.commands.status import width

    return width(args)


def _print_lines(lines: list[Any]) -> None:
    from rich.console import Console

    console = Console(highlight=False, soft_wrap=True)
    for line in lines:
        console.print(line)


def _cut(text: str, width: int) -> Any:
    from rich.text import Text

    line = Text(text)
    if width:
        line.truncate(width, overflow="ellipsis")
    return line


def _json(obj: Any) -> None:
    print(json.dumps(obj))


def _counts(b: Any) -> str:
    rc = b.request_counts
    return "" if rc is None else f"{rc.completed}/{rc.failed}/{rc.total}"


def _relative(ts: float) -> str:
    """``5m ago``, or ``in 23h`` for a time to come (a batch's expiry)."""
    from neuron_serving.commands.status_view import age

    ahead = ts - time.time()
    if ahead < 1:
        return age(ts)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if ahead >= 2 * size:
            return f"in {ahead / size:.0f}{unit}"
    return f"in {ahead:.0f}s"


def _when(ts: int | None) -> str:
    if not ts:
        return ""
    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(ts))} ({_relative(ts)})"


def _endpoint(url: str) -> str:
    return url.removeprefix("/v1/")


# list: the id, status and counts are never dropped; a narrow terminal loses the
# endpoint first, then the age.
def _list_columns() -> tuple[Any, ...]:
    from neuron_serving.commands.status_view import Column

    return (
        Column("ID"),
        Column("STATUS"),
        Column("DONE/FAILED/TOTAL"),
        Column("CREATED", drop_rank=1),
        Column("ENDPOINT", drop_rank=2),
    )


def list_rows(batches: list[Any]) -> list[list[str]]:
    from neuron_serving.commands.status_view import age

    return [[b.id, b.status, _counts(b), age(b.created_at), _endpoint(b.endpoint)] for b in batches]


# ---- the actions ----------------------------------------------------------------------------


def run_list(c: openai.OpenAI, args: argparse.Namespace) -> int:
    from neuron_serving.commands.status_view import render

    want = None if args.all else args.limit
    got: list[Any] = []
    after: str | None = None
    more = True
    while more and (want is None or len(got) < want):
        n = PAGE if want is None else min(PAGE, want - len(got))
        page = c.batches.list(limit=n, after=after) if after else c.batches.list(limit=n)
        got += page.data
        more = bool(page.has_more) and bool(page.data)
        after = page.data[-1].id if page.data else None
    if args.json:
        _json({"object": "list", "data": [b.to_dict() for b in got], "has_more": more})
        return ExitCode.OK
    if not got:
        print("no batches")
        return ExitCode.OK
    lines = render(_list_columns(), list_rows(got), _width(args))
    if more:
        lines.append(_cut("(more batches: a higher --limit, or --all)", _width(args)))
    _print_lines(lines)
    return ExitCode.OK


def show_lines(b: Any, width: int) -> list[Any]:
    """`show`'s view of a batch object, one fact a line, each cut to ``width``."""
    rows: list[tuple[str, str]] = [
        ("status", b.status),
        ("endpoint", f"{b.endpoint}  (window {b.completion_window})"),
    ]
    rc = b.request_counts
    if rc is not None:
        rows.append(("requests", f"{rc.completed} completed, {rc.failed} failed, {rc.total} total"))
    rows += [
        ("input file", b.input_file_id or ""),
        ("output file", b.output_file_id or ""),
        ("error file", b.error_file_id or ""),
    ]
    for name, label in (
        ("created_at", "created"), ("in_progress_at", "in progress"),
        ("finalizing_at", "finalizing"), ("completed_at", "completed"),
        ("failed_at", "failed"), ("cancelling_at", "cancelling"),
        ("cancelled_at", "cancelled"), ("expired_at", "expired"), ("expires_at", "expires"),
    ):  # fmt: skip
        if ts := getattr(b, name, None):
            rows.append((label, _when(ts)))
    if b.metadata:
        rows.append(("metadata", ", ".join(f"{k}={v}" for k, v in b.metadata.items())))
    pad = max(len(k) for k, _ in rows) + 2
    lines = [_cut(b.id, width)]
    lines += [_cut(f"  {k.ljust(pad)}{_one_line(v, 1000) if k == 'metadata' else v}", width)
              for k, v in rows if v != ""]  # fmt: skip
    errors = list(b.errors.data or []) if b.errors else []
    if errors:
        lines.append(_cut(f"  {'errors'.ljust(pad)}{len(errors)} (input lines refused)", width))
        lines += [_cut(f"    {e}", width) for e in _error_texts(errors)]
    return lines


def _error_texts(errors: list[Any]) -> list[str]:
    out = [
        f"line {e.line}: {e.code}: {_one_line(e.message or '')}" if e.line
        else f"{e.code}: {_one_line(e.message or '')}"
        for e in errors[:MAX_SHOWN_ERRORS]
    ]  # fmt: skip
    if len(errors) > MAX_SHOWN_ERRORS:
        out.append(f"... and {len(errors) - MAX_SHOWN_ERRORS} more (--json lists them)")
    return out


def download(c: openai.OpenAI, file_id: str, dest: Path) -> int:
    """The file's bytes to ``dest`` (written beside it, then renamed); its size."""
    part = dest.with_name(f".{dest.name}.part")
    size = 0
    try:
        with c.files.with_streaming_response.content(file_id) as resp, open(part, "wb") as f:
            for chunk in resp.iter_bytes(1 << 20):
                f.write(chunk)
                size += len(chunk)
        os.replace(part, dest)
    except OSError as e:
        raise CommandError(f"{dest}: {e.strerror or e}") from None
    finally:
        part.unlink(missing_ok=True)
    return size


def run_show(c: openai.OpenAI, args: argparse.Namespace) -> int:
    b = c.batches.retrieve(args.id)
    if args.json:
        _json(b.to_dict())
    else:
        _print_lines(show_lines(b, _width(args)))
    rc = ExitCode.OK
    for dest, file_id, what in ((args.output, b.output_file_id, "output"),
                                (args.errors, b.error_file_id, "error")):  # fmt: skip
        if not dest:
            continue
        if not file_id:
            print(f"error: batch {b.id} has no {what} file (status {b.status})", file=sys.stderr)
            rc = ExitCode.FAILED
            continue
        size = download(c, file_id, Path(dest))
        print(f"{what} file {file_id}: {size} bytes to {dest}", file=sys.stderr)
    return rc


def run_cancel(c: openai.OpenAI, args: argparse.Namespace) -> int:
    b = c.with_options(max_retries=0).batches.cancel(args.id)
    if args.json:
        _json(b.to_dict())
    else:
        print(f"{b.id} {b.status}")
    return ExitCode.OK


def _metadata(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        k, sep, v = pair.partition("=")
        if not sep or not k:
            raise CommandError(f"--metadata expects KEY=VALUE, got {pair!r}", ExitCode.USAGE)
        out[k] = v
    return out


def run_submit(c: openai.OpenAI, args: argparse.Namespace) -> int:
    import openai

    metadata = _metadata(args.metadata)
    path: Path = args.file
    writer = c.with_options(max_retries=0)
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below; the upload streams from it)
    except OSError as e:
        raise CommandError(f"{path}: {e.strerror or e}", ExitCode.USAGE) from None
    with f:
        uploaded = writer.files.create(file=(path.name, f), purpose="batch")
    try:
        b = writer.batches.create(
            input_file_id=uploaded.id, endpoint=args.endpoint,
            completion_window=args.completion_window,
            # openai 2.x types the absent value as Omit; it still drops NOT_GIVEN, which
            # the openai 1.x this package allows needs.
            metadata=metadata or openai.NOT_GIVEN,  # type: ignore[arg-type]
        )  # fmt: skip
    except openai.OpenAIError:
        try:  # no batch: the upload is of no use to anyone
            writer.files.delete(uploaded.id)
        except openai.OpenAIError:
            pass
        raise
    if args.json:
        _json(b.to_dict())
    else:
        print(b.id)
    if b.status != "failed":
        return ExitCode.OK
    errors = list(b.errors.data or []) if b.errors else []
    print(f"error: batch {b.id} failed: {len(errors)} input lines refused", file=sys.stderr)
    for text in _error_texts(errors):
        print(f"  {text}", file=sys.stderr)
    return ExitCode.FAILED
