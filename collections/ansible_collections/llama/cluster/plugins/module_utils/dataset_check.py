"""A dataset file checked record by record, as LLaMA-Factory 0.9.5 reads it: the entry's
columns and tags (`build_spec`), each record (`check_record`), the file read as a stream
(`read_records`) and the whole check with its valid records (`check_file`, `summary`). The
module llama_dataset_check runs it on the controller."""

from __future__ import annotations

import codecs
import json
import os
import re
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import IO, Any

CHUNK_BYTES = 1 << 20
# A value nested deeper than Python's JSON reader follows (its recursion limit, about 1,000).
TOO_DEEP = (
    "has a value nested deeper than a JSON reader follows (about 1,000 levels of lists or "
    "objects): no dataset record nests like that, and LLaMA-Factory could not load it either"
)
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_BOM = "\ufeff"

# LLaMA-Factory 0.9.5's DatasetAttr defaults (data/parser.py). An entry that gives `columns`
# (or `tags`) replaces all of them: what it leaves out becomes None, i.e. is not read.
DEFAULT_COLUMNS: dict[str, str | None] = {
    "prompt": "instruction",
    "query": "input",
    "response": "output",
    "history": None,
    "messages": "conversations",
    "system": None,
    "tools": None,
    "images": None,
    "videos": None,
    "audios": None,
    "chosen": None,
    "rejected": None,
    "kto_tag": None,
}
DEFAULT_TAGS: dict[str, str | None] = {
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "observation_tag": "observation",
    "function_tag": "function_call",
    "system_tag": "system",
}
# Columns that the converters read with example[column] whenever they are mapped: a mapped column
# that no record has stops LLaMA-Factory with a KeyError.
READ_COLUMNS = {
    "alpaca": (
        "prompt",
        "query",
        "response",
        "history",
        "system",
        "tools",
        "images",
        "videos",
        "audios",
    ),
    "sharegpt": ("messages", "tools", "images", "videos", "audios"),
}
# Keys worth a warning when records carry them but the entry does not map them.
OPTIONAL_KEYS = {
    "alpaca": ("system", "history", "tools", "images", "videos", "audios"),
    "sharegpt": ("system", "tools", "images", "videos", "audios"),
}


# What a path that is not a regular file is, for the message (stat's S_IS* tests).
FILE_KINDS = (
    (stat.S_ISFIFO, "is a named pipe (FIFO), not a file: reading it would wait for a writer"),
    (stat.S_ISDIR, "is a directory, not a file"),
    (stat.S_ISCHR, "is a character device, not a file"),
    (stat.S_ISBLK, "is a block device, not a file"),
    (stat.S_ISSOCK, "is a socket, not a file"),
)


def file_problem(path: str) -> str | None:
    """Why `path` cannot be a dataset file (it does not exist, or it is a FIFO, a directory, a
    device), or None for a regular file (a link is followed)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist on the controller"
    except OSError as err:
        return f"cannot be read ({err.strerror})"
    return next((what for test, what in FILE_KINDS if test(mode)), None)


class DatasetFileError(Exception):
    """The file as a whole cannot be read as records (syntax, encoding, top-level value)."""


class EntryError(Exception):
    """The dataset_info entry cannot be checked or trained with (formatting, columns, tags)."""


@dataclass(frozen=True)
class Spec:
    """What LLaMA-Factory reads from each record of one dataset_info entry."""

    formatting: str
    columns: dict[str, str | None]
    tags: dict[str, str | None]

    def column(self, name: str) -> str | None:
        """The record key read for one of LLaMA-Factory's columns, or None."""
        return self.columns[name]

    @cached_property
    def roles(self) -> _Roles:
        """The roles a sharegpt message may have."""
        return _Roles.of(self.tags)


def _resolve(defaults: dict[str, str | None], given: dict[str, Any] | None, what: str) -> dict:
    """DatasetAttr.join's rule: a given mapping replaces every default."""
    if given is None:
        return dict(defaults)
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise EntryError(
            f"{what} has {', '.join(repr(k) for k in unknown)}, which LLaMA-Factory does not read "
            f"(it knows {', '.join(defaults)}): a typo there is silently ignored."
        )
    resolved = {key: given.get(key) for key in defaults}
    bad = sorted(k for k, v in resolved.items() if v is not None and not isinstance(v, str))
    if bad:
        raise EntryError(f"{what}: {', '.join(bad)} must be strings (record keys or role names).")
    return resolved


def build_spec(
    formatting: str,
    columns: dict[str, Any] | None = None,
    tags: dict[str, Any] | None = None,
    ranking: bool = False,
) -> Spec:
    """The checks for one dataset_info entry; raises EntryError for one train.yml cannot use."""
    if formatting == "openai":
        raise EntryError(
            "formatting openai is LLaMA-Factory's OpenAI converter, which appends 'detailed "
            "thinking off' to every system prompt. Use formatting sharegpt with the OpenAI "
            "tags instead (demo_sharegpt_openai in group_vars/all/datasets.yml shows them)."
        )
    if formatting not in READ_COLUMNS:
        raise EntryError(f"formatting must be alpaca or sharegpt (got {formatting!r}).")
    if ranking:
        raise EntryError(
            "ranking (preference) datasets need stage rm or dpo; train.yml trains stage sft."
        )
    spec = Spec(
        formatting,
        _resolve(DEFAULT_COLUMNS, columns, "columns"),
        _resolve(DEFAULT_TAGS, tags, "tags"),
    )
    if formatting == "alpaca" and not spec.column("response"):
        raise EntryError(
            "the entry's columns map no response: every record would train on nothing (map "
            "response, e.g. response: output)."
        )
    if formatting == "sharegpt":
        if not spec.column("messages"):
            raise EntryError("the entry's columns map no messages (e.g. messages: conversations).")
        missing = [
            t for t in ("role_tag", "content_tag", "user_tag", "assistant_tag") if not spec.tags[t]
        ]
        if missing:
            raise EntryError(f"the entry's tags set no {', '.join(missing)}.")
    return spec


def _kind(value: Any) -> str:  # noqa: ANN401 - any JSON value
    """A JSON value's type, as a message says it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, list):
        return "a list"
    return "an object"


def _text_problem(record: dict, key: str, required: bool, empty_ok: bool = False) -> str | None:
    """Why record[key] is not a string LLaMA-Factory can use, or None."""
    if key not in record or record[key] is None:
        return f'has no "{key}"' if required else None
    value = record[key]
    if not isinstance(value, str):
        return f'"{key}" is {_kind(value)}, not a string'
    if not empty_ok and required and not value.strip():
        return f'"{key}" is empty'
    return None


def _check_alpaca(record: dict, spec: Spec) -> str | None:
    """Why an alpaca record is skipped or breaks LLaMA-Factory's AlpacaDatasetConverter, or None."""
    prompt, query = spec.column("prompt"), spec.column("query")
    for key, required in ((prompt, True), (query, False), (spec.column("system"), False)):
        if key:
            problem = _text_problem(record, key, required, empty_ok=key in (prompt, query))
            if problem:
                return problem
    if not any(
        key and isinstance(record.get(key), str) and record[key].strip() for key in (prompt, query)
    ):
        names = " and ".join(f'"{key}"' for key in (prompt, query) if key)
        return f"{names} {'are' if query and prompt else 'is'} empty: the prompt would be empty"
    response = spec.column("response")
    problem = _text_problem(record, response, required=True)
    if problem:
        return problem
    history = spec.column("history")
    if history and record.get(history) is not None:
        turns = record[history]
        if not isinstance(turns, list):
            return f'"{history}" is {_kind(turns)}, not a list of [query, response] pairs'
        for number, pair in enumerate(turns):
            if not (
                isinstance(pair, list)
                and len(pair) == 2
                and all(isinstance(text, str) and text.strip() for text in pair)
            ):
                return (
                    f'"{history}" item {number} is {json.dumps(pair, ensure_ascii=False)[:60]}, '
                    "not a [query, response] pair of non-empty strings"
                )
    return None


@dataclass(frozen=True)
class _Roles:
    """The role names a sharegpt entry's tags allow, by the side of the conversation."""

    user_side: tuple[str, ...]
    assistant_side: tuple[str, ...]
    system: str | None
    known: tuple[str, ...]  # every role a message may have

    @classmethod
    def of(cls, tags: dict[str, str | None]) -> _Roles:
        """LLaMA-Factory's accept_tags: user/observation at even turns, assistant at odd ones."""
        user = tuple(t for t in (tags["user_tag"], tags["observation_tag"]) if t)
        assistant = tuple(t for t in (tags["assistant_tag"], tags["function_tag"]) if t)
        system = tags["system_tag"]
        return cls(user, assistant, system, (*user, *assistant, *([system] if system else [])))


def _not_text(number: int, tag: str, value: Any) -> str:  # noqa: ANN401 - any JSON value
    """A message's role or content that is missing or not a string."""
    if value is None:
        return f'message {number} has no "{tag}"'
    return f'message {number}: "{tag}" is {_kind(value)}, not a string'


def _message_problem(number: int, message: Any, roles: _Roles, tags: dict) -> str | None:  # noqa: ANN401
    """Why one message cannot be read, or None."""
    role_tag, content_tag = tags["role_tag"], tags["content_tag"]
    if not isinstance(message, dict):
        return f"message {number} is {_kind(message)}, not an object"
    role = message.get(role_tag)
    if not isinstance(role, str):
        return _not_text(number, role_tag, role)
    if role not in roles.known:
        hint = (
            " (the entry's tags set no system_tag)" if role == "system" and not roles.system else ""
        )
        return (
            f'message {number} has the role "{role}", which is not a role of this dataset '
            f"({', '.join(roles.known)}){hint}"
        )
    content = message.get(content_tag)
    if not isinstance(content, str):
        return _not_text(number, content_tag, content)
    if not content.strip() and not (number == 0 and role == roles.system):
        return f'message {number} has an empty "{content_tag}"'
    return None


def _order_problem(roles_in_order: list[str], roles: _Roles) -> str | None:
    """Why the roles' order is not the one LLaMA-Factory accepts, or None."""
    offset = 1 if roles_in_order[0] == roles.system else 0
    turns = roles_in_order[offset:]
    for turn, role in enumerate(turns):
        expected = roles.user_side if turn % 2 == 0 else roles.assistant_side
        if role in expected:
            continue
        if role == roles.system:
            return f'message {turn + offset} is a "{role}" message: only the first may be one'
        side = "a user" if turn % 2 == 0 else "an assistant"
        return (
            f'message {turn + offset} is "{role}" where LLaMA-Factory expects {side} turn '
            f"({' or '.join(expected)}): turns alternate user, assistant, user, ..."
        )
    if not turns:
        return "holds only a system message"
    if len(turns) % 2:
        return (
            f"has {len(turns)} turns{' after the system message' if offset else ''}: "
            "LLaMA-Factory needs user/assistant pairs, ending with an assistant turn"
        )
    return None


def _check_sharegpt(record: dict, spec: Spec) -> str | None:
    """Why a sharegpt record is skipped or breaks LLaMA-Factory's SharegptDatasetConverter."""
    key = spec.column("messages")
    messages = record.get(key)
    if messages is None:
        return f'has no "{key}"'
    if not isinstance(messages, list):
        return f'"{key}" is {_kind(messages)}, not a list of messages'
    if not messages:
        return f'"{key}" holds no messages'
    roles = spec.roles
    for number, message in enumerate(messages):
        problem = _message_problem(number, message, roles, spec.tags)
        if problem:
            return problem
    order = [message[spec.tags["role_tag"]] for message in messages]
    problem = _order_problem(order, roles)
    system = spec.column("system")
    if not problem and system and order[0] != roles.system:
        problem = _text_problem(record, system, required=False)
    return problem


def check_record(record: Any, spec: Spec) -> str | None:  # noqa: ANN401 - any JSON value
    """Why LLaMA-Factory would skip this record or stop on it, or None when it trains on it."""
    if not isinstance(record, dict):
        return f"is {_kind(record)}, not an object"
    if spec.formatting == "alpaca":
        return _check_alpaca(record, spec)
    return _check_sharegpt(record, spec)


@dataclass
class Item:
    """One record as read from the file: its index, its first line, its value or why not."""

    index: int
    line: int
    value: Any = None
    error: str | None = None


class _Buffer:
    """Text of a file read in chunks, with the line number of any position still held."""

    def __init__(self, stream: IO[bytes], chunk_bytes: int, max_chars: int) -> None:
        self._stream = stream
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._chunk = chunk_bytes
        self._max = max_chars
        self._bytes = 0
        self._line = 1
        self._line_pos = 0
        self._column = 0  # characters of the first held line that were dropped
        self.text = ""
        self.pos = 0
        self.eof = False

    def more(self) -> bool:
        """Drop what was consumed and append the next chunk (at least doubling what is held)."""
        if self.eof:
            return False
        self._line += self.text.count("\n", self._line_pos, self.pos)
        last = self.text.rfind("\n", 0, self.pos)
        self._column = self.pos - last - 1 if last >= 0 else self._column + self.pos
        self.text, self._line_pos, self.pos = self.text[self.pos :], 0, 0
        data = self._stream.read(max(self._chunk, len(self.text)))
        try:
            self.text += self._decoder.decode(data, final=not data)
        except UnicodeDecodeError as err:
            raise DatasetFileError(
                f"is not UTF-8 text (byte {self._bytes + err.start}: {err.reason})"
            ) from None
        self._bytes += len(data)
        self.eof = not data
        return True

    def line_at(self, pos: int) -> int:
        """The line number of a position in the text held."""
        if pos >= self._line_pos:
            self._line += self.text.count("\n", self._line_pos, pos)
            self._line_pos = pos
            return self._line
        return self._line - self.text.count("\n", pos, self._line_pos)

    def where(self, pos: int) -> str:
        """'line L column C' of a position in the text held."""
        last = self.text.rfind("\n", 0, pos)
        column = pos - last if last >= 0 else self._column + pos + 1
        return f"line {self.line_at(pos)} column {column}"

    def peek(self) -> str:
        """The next character that is not white space, or '' at the end of the file."""
        while True:
            self.pos = _WHITESPACE.match(self.text, self.pos).end()
            if self.pos < len(self.text) or not self.more():
                return self.text[self.pos : self.pos + 1]

    def value(self, decoder: json.JSONDecoder, index: int) -> Any:  # noqa: ANN401
        """Decode the JSON value that starts at pos, reading on while it is cut by the buffer."""
        while True:
            try:
                value, end = decoder.raw_decode(self.text, self.pos)
            except RecursionError:
                where = self.where(self.pos)
                raise DatasetFileError(f"{TOO_DEEP} (record {index}, from {where})") from None
            except json.JSONDecodeError as err:
                cut = err.pos >= len(self.text) - 64 or err.msg.startswith("Unterminated string")
                if cut and not self.eof:
                    self._grow(index)
                    continue
                raise DatasetFileError(
                    f"is not valid JSON ({err.msg} at {self.where(err.pos)}, in record {index})"
                ) from None
            if end >= len(self.text) and not self.eof:  # a number may go on in the next chunk
                self._grow(index)
                continue
            self.pos = end
            return value

    def _grow(self, index: int) -> None:
        if len(self.text) - self.pos > self._max:
            raise DatasetFileError(
                f"has a record over {self._max >> 20} MiB, or one that is never closed "
                f"(record {index}, from {self.where(self.pos)})"
            )
        self.more()


def _json_list(stream: IO[bytes], chunk_bytes: int, max_chars: int) -> Iterator[Item]:
    """The records of a JSON list, decoded one at a time."""
    buf = _Buffer(stream, chunk_bytes, max_chars)
    decoder = json.JSONDecoder()
    if buf.peek() == _BOM:
        raise DatasetFileError(
            "starts with a UTF-8 byte-order mark, which LLaMA-Factory cannot read in a JSON list: "
            "save it as UTF-8 without one"
        )
    buf.pos += 1  # the opening [ (the caller saw it)
    index = 0
    if buf.peek() == "]":
        buf.pos += 1
    else:
        while True:
            buf.peek()
            line = buf.line_at(buf.pos)
            yield Item(index, line, buf.value(decoder, index))
            index += 1
            after = buf.peek()
            buf.pos += 1
            if after == "]":
                break
            if after != ",":
                problem = "Expecting ',' delimiter" if after else "The file ends inside the list"
                raise DatasetFileError(
                    f"is not valid JSON ({problem} at {buf.where(buf.pos - 1)}, "
                    f"after record {index - 1})"
                )
    if buf.peek():
        raise DatasetFileError(
            f"is not valid JSON (Extra data at {buf.where(buf.pos)}, after the list's closing ])"
        )


def _json_lines(stream: IO[bytes], max_bytes: int) -> Iterator[Item]:
    """The records of a JSON Lines file; a line that is not one JSON value is a bad record."""
    index = line = 0
    while True:
        raw = stream.readline(max_bytes + 1)
        if not raw:
            return
        line += 1
        if line == 1 and raw.startswith(codecs.BOM_UTF8):
            raw = raw[len(codecs.BOM_UTF8) :]
        if len(raw) > max_bytes and not raw.endswith(b"\n"):
            while (rest := stream.readline(max_bytes)) and not rest.endswith(b"\n"):
                pass
            yield Item(index, line, error=f"is longer than {max_bytes >> 20} MiB")
            index += 1
            continue
        if not raw.strip():
            continue  # LLaMA-Factory (pyarrow) skips blank lines
        try:
            yield Item(index, line, json.loads(raw.decode("utf-8").rstrip("\r\n")))
        except RecursionError:
            yield Item(index, line, error=TOO_DEEP)
        except UnicodeDecodeError as err:
            yield Item(index, line, error=f"is not UTF-8 text (byte {err.start} of the line)")
        except json.JSONDecodeError as err:
            if index == 0:  # most likely not JSON Lines at all, e.g. one pretty-printed object
                raise DatasetFileError(
                    "is neither a JSON list of records ([{...}, ...]) nor JSON Lines: its first "
                    f"line is not a complete JSON record ({err.msg} at line {line} column "
                    f"{err.pos + 1}). A JSON file must hold a list of records"
                ) from None
            yield Item(index, line, error=f"is not valid JSON ({err.msg} at column {err.pos + 1})")
        index += 1


def read_records(
    path: str, chunk_bytes: int = CHUNK_BYTES, max_record_bytes: int = 64 << 20
) -> tuple[str, Iterator[Item]]:
    """The file's format (json or jsonl) and its records, read as a stream.

    A JSON list is decoded one record at a time from a sliding buffer; a file whose first
    character is '{' is read as JSON Lines, one record per line.
    """
    stream = open(path, "rb")  # noqa: SIM115 - the iterator owns it and closes it at its end
    head = b""
    while not head and (data := stream.read(4096)):
        head = data.removeprefix(codecs.BOM_UTF8).lstrip(b" \t\r\n")
    first = head[:1]
    stream.seek(0)
    if first == b"[":
        return "json", _closing(stream, _json_list(stream, chunk_bytes, max_record_bytes))
    if first == b"{":
        return "jsonl", _closing(stream, _json_lines(stream, max_record_bytes))
    stream.close()
    if not first:
        raise DatasetFileError("is empty: it holds no records")
    # Nothing of the file is quoted: a path given as a dataset may be any file the controller
    # can read (a link to /etc/shadow), and only a dataset's own records are shown.
    raise DatasetFileError(
        "is neither a JSON list of records ([{...}, ...]) nor JSON Lines (one {...} record "
        "per line): its first character is neither '[' nor '{'"
    )


def _closing(stream: IO[bytes], items: Iterator[Item]) -> Iterator[Item]:
    with stream:
        yield from items


@dataclass
class Report:
    """What the check found in one file."""

    file_format: str = ""
    records: int = 0
    valid: int = 0
    invalid: int = 0
    errors: list[str] = field(default_factory=list)
    invalid_indexes: list[int] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # file-level, not skippable
    written: bool = False


class _ValidRecords:
    """The valid records, written to a temporary file beside dest; kept at dest only if wanted."""

    def __init__(self, dest: str | None) -> None:
        self._dest = dest
        self._out: IO[str] | None = None
        if dest:
            folder = os.path.dirname(dest) or "."
            os.makedirs(folder, exist_ok=True)
            self._out = tempfile.NamedTemporaryFile(  # noqa: SIM115 - finish() closes it
                "w", encoding="utf-8", dir=folder, delete=False, suffix=".part"
            )

    def write(self, value: Any) -> None:  # noqa: ANN401 - any JSON value
        """Add one record (one line of JSON)."""
        if self._out:
            self._out.write(json.dumps(value, ensure_ascii=False) + "\n")

    def finish(self, keep: bool) -> bool:
        """Move the file to dest when keep, else remove it; True when dest was written."""
        if not self._out:
            return False
        self._out.close()
        if keep:
            os.replace(self._out.name, self._dest)
        else:
            os.unlink(self._out.name)
        return keep


def check_file(
    path: str,
    spec: Spec,
    *,
    valid_out: str | None = None,
    max_errors: int = 5,
    chunk_bytes: int = CHUNK_BYTES,
    max_record_bytes: int = 64 << 20,
) -> Report:
    """Check every record of a file; with valid_out, also write the valid ones there (JSON Lines).

    Raises DatasetFileError when the file cannot be read as records. valid_out is written only
    when some records are invalid and some valid; otherwise it is left as it was.
    """
    report = Report()
    report.file_format, items = read_records(path, chunk_bytes, max_record_bytes)
    seen: set[str] = set()
    watched = {spec.column(c) for c in READ_COLUMNS[spec.formatting] if spec.column(c)}
    watched |= set(OPTIONAL_KEYS[spec.formatting])
    if spec.column("system"):
        watched.add(spec.column("system"))
    needs_system_column = False
    valid = _ValidRecords(valid_out)
    try:
        for item in items:
            report.records += 1
            problem = item.error or check_record(item.value, spec)
            if problem:
                report.invalid += 1
                if len(report.errors) < max_errors:
                    report.errors.append(f"record {item.index} (line {item.line}): {problem}")
                    report.invalid_indexes.append(item.index)
                continue
            report.valid += 1
            if len(seen) < len(watched):
                seen.update(watched.intersection(item.value))
            if spec.formatting == "sharegpt" and not needs_system_column:
                first = item.value[spec.column("messages")][0]
                needs_system_column = first[spec.tags["role_tag"]] != spec.tags["system_tag"]
            valid.write(item.value)
    except BaseException:
        valid.finish(keep=False)
        raise
    _column_problems(report, spec, seen, needs_system_column)
    report.written = valid.finish(
        keep=bool(report.invalid and report.valid and not report.problems)
    )
    return report


def _column_problems(report: Report, spec: Spec, seen: set[str], needs_system_column: bool) -> None:
    """Mapped columns that no valid record has (a KeyError in LLaMA-Factory), and unmapped keys."""
    if not report.valid:
        return
    for name in READ_COLUMNS[spec.formatting]:
        key = spec.column(name)
        if key and key not in seen:
            report.problems.append(
                f'no record has "{key}", which the entry maps as the {name} column: LLaMA-Factory '
                f'0.9.5 stops with KeyError: \'{key}\'. Add "{key}": "" (or the value) to the '
                "records, or leave that column out of the entry's columns"
            )
    system = spec.column("system")
    if spec.formatting == "sharegpt" and system and needs_system_column and system not in seen:
        report.problems.append(
            f'no record has "{system}", which the entry maps as the system column: '
            f"LLaMA-Factory 0.9.5 stops with KeyError: '{system}'"
        )
    mapped = {key for key in spec.columns.values() if key}
    for key in OPTIONAL_KEYS[spec.formatting]:
        if key in seen and key not in mapped:
            report.warnings.append(
                f'records carry "{key}", which the entry does not map: LLaMA-Factory ignores it '
                f"(map it under columns, e.g. {key}: {key}, to train on it)"
            )


def summary(name: str, path: str, report: Report, skip_invalid: bool, spec: Spec) -> str:
    """The message for a file with invalid records, or the note that some were left out."""
    fmt = spec.formatting
    shown = "; ".join(report.errors)
    more = report.invalid - len(report.errors)
    listed = f"{shown}{f'; and {more} more' if more > 0 else ''}"
    read_as = " (read as JSON Lines: one record per line)" if report.file_format == "jsonl" else ""
    head = (
        f"Dataset {name}: {report.invalid} of {report.records} records in {path}{read_as} are not "
        f"valid {fmt} records (indexes count from 0): {listed}."
    )
    if skip_invalid:
        return (
            f"{head} Training on the {report.valid} valid records; "
            f"{report.invalid} left out (first indexes: "
            f"{', '.join(str(i) for i in report.invalid_indexes)})."
        )
    if not report.valid:
        return f"{head} None is valid: fix the file (the format is in group_vars/all/datasets.yml)."
    return (
        f"{head} LLaMA-Factory would skip some of these silently and stop on others. Fix them, "
        f"or train on the {report.valid} valid records with -e dataset_skip_invalid=true."
    )
