"""The dataset checker (module_utils/dataset_check.py, the llama_dataset_check module's): what it
accepts is what LLaMA-Factory 0.9.5 trains on, it says which record is wrong and why, and it
reads any size in bounded memory.

The record cases are checked against LLaMA-Factory's own converters too (in the training venv):
every record the checker accepts converts into a prompt and one response of strings; every
record it refuses is one LLaMA-Factory skips, stops on, or would train on an empty turn.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest
from ansible_collections.llama.cluster.plugins.module_utils import dataset_check as check

from tests.conftest import DATA

ROOT = Path(__file__).resolve().parents[3]
TRAIN_PYTHON = Path(
    os.environ.get("LLAMA_CLUSTER_TRAIN_PYTHON", "/var/cache/llama-cluster/venv-train/bin/python")
)

HISTORY = {"prompt": "instruction", "query": "input", "response": "output", "history": "history"}
SYSTEM = {"prompt": "instruction", "query": "input", "response": "output", "system": "system"}
OPENAI_TAGS = {
    "role_tag": "role",
    "content_tag": "content",
    "user_tag": "user",
    "assistant_tag": "assistant",
    "observation_tag": "tool",
    "system_tag": "system",
}
# Entries: (formatting, columns, tags), as a dataset_info entry gives them.
ENTRIES = {
    "alpaca": ("alpaca", None, None),
    "alpaca_history": ("alpaca", HISTORY, None),
    "alpaca_system": ("alpaca", SYSTEM, None),
    "sharegpt": ("sharegpt", None, None),
    # the tags of an entry that lists only four: no system, observation or function roles
    "sharegpt_four_tags": (
        "sharegpt",
        {"messages": "conversations"},
        {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt"},
    ),
    "openai": ("sharegpt", {"messages": "messages"}, OPENAI_TAGS),
}


def _sg(*turns: tuple[str, object]) -> dict:
    return {"conversations": [{"from": role, "value": value} for role, value in turns]}


def _oa(*turns: tuple[str, object]) -> dict:
    return {"messages": [{"role": role, "content": value} for role, value in turns]}


A = {"instruction": "Add 2 and 3.", "input": "", "output": "5"}
# (entry, record, what the checker says: None when valid, else a part of its message)
CASES = [
    ("alpaca", A, None),
    ("alpaca", {**A, "input": "2, 3", "instruction": ""}, None),
    ("alpaca", {"input": "", "output": "5"}, 'has no "instruction"'),
    ("alpaca", {**A, "instruction": 7}, '"instruction" is a number, not a string'),
    ("alpaca", {**A, "input": ["2", "3"]}, '"input" is a list, not a string'),
    ("alpaca", {**A, "output": "  "}, '"output" is empty'),
    ("alpaca", {**A, "output": None}, 'has no "output"'),
    ("alpaca", {**A, "output": {"text": "5"}}, '"output" is an object, not a string'),
    ("alpaca", {**A, "instruction": " ", "input": ""}, '"instruction" and "input" are empty'),
    ("alpaca", ["Add 2 and 3.", "5"], "is a list, not an object"),
    ("alpaca_history", {**A, "history": [["Hi", "Hello"]]}, None),
    ("alpaca_history", {**A, "history": None}, None),
    ("alpaca_history", {**A, "history": [["Hi"]]}, '"history" item 0 is ["Hi"], not a [query'),
    ("alpaca_history", {**A, "history": [["Hi", 3]]}, '"history" item 0 is ["Hi", 3]'),
    ("alpaca_history", {**A, "history": "Hi"}, '"history" is a string, not a list of'),
    ("alpaca_system", {**A, "system": "Be brief."}, None),
    ("alpaca_system", {**A, "system": 1}, '"system" is a number, not a string'),
    ("sharegpt", _sg(("human", "Hi"), ("gpt", "Hello")), None),
    ("sharegpt", _sg(("system", ""), ("human", "Hi"), ("gpt", "Hello")), None),
    (
        "sharegpt",
        _sg(("human", "2+2?"), ("function_call", "calc(2+2)"), ("observation", "4"), ("gpt", "4")),
        None,
    ),
    (
        "sharegpt",
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt"}]},
        'message 1 has no "value"',
    ),
    (
        "sharegpt",
        {"conversations": [{"value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
        'message 0 has no "from"',
    ),
    (
        "sharegpt",
        _sg(("human", "Hi"), ("robot", "Beep")),
        'message 1 has the role "robot", which is not a role',
    ),
    (
        "sharegpt",
        _sg(("gpt", "Hello"), ("human", "Hi")),
        'message 0 is "gpt" where LLaMA-Factory expects a user turn',
    ),
    (
        "sharegpt",
        _sg(("human", "Hi"), ("human", "Hi?")),
        'message 1 is "human" where LLaMA-Factory expects an assistant turn',
    ),
    ("sharegpt", _sg(("human", "Hi"), ("gpt", "")), 'message 1 has an empty "value"'),
    ("sharegpt", _sg(("human", "Hi"), ("gpt", 42)), 'message 1: "value" is a number, not a string'),
    (
        "sharegpt",
        _sg(("human", "Hi"), ("gpt", "Hello"), ("human", "Bye")),
        "has 3 turns: LLaMA-Factory needs user/assistant pairs",
    ),
    (
        "sharegpt",
        _sg(("human", "Hi"), ("system", "Be brief."), ("human", "Hi"), ("gpt", "Hello")),
        'message 1 is a "system" message: only the first',
    ),
    ("sharegpt", _sg(("system", "Be brief.")), "holds only a system message"),
    ("sharegpt", {"conversations": []}, '"conversations" holds no messages'),
    ("sharegpt", {"conversations": "Hi"}, '"conversations" is a string, not a list of messages'),
    ("sharegpt", {"messages": []}, 'has no "conversations"'),
    ("sharegpt", {"conversations": ["Hi", "Hello"]}, "message 0 is a string, not an object"),
    ("sharegpt_four_tags", _sg(("human", "Hi"), ("gpt", "Hello")), None),
    (
        "sharegpt_four_tags",
        _sg(("system", "Be brief."), ("human", "Hi"), ("gpt", "Hello")),
        "(the entry's tags set no system_tag)",
    ),
    ("openai", _oa(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello")), None),
    (
        "openai",
        _oa(("user", "2+2?"), ("assistant", "calc(2+2)"), ("tool", "4"), ("assistant", "4")),
        None,
    ),
    (
        "openai",
        _oa(("user", "2+2?"), ("tool", "4")),
        'message 1 is "tool" where LLaMA-Factory expects an assistant turn',
    ),
    (
        "openai",
        _oa(("user", "Hi"), ("human", "Hello")),
        'the role "human", which is not a role of this dataset (user, tool, assistant, system)',
    ),
]


def _spec(entry: str) -> check.Spec:
    formatting, columns, tags = ENTRIES[entry]
    return check.build_spec(formatting, columns, tags)


@pytest.mark.parametrize(("entry", "record", "said"), CASES)
def test_each_record_is_judged_as_llamafactory_reads_it(entry: str, record, said) -> None:
    problem = check.check_record(record, _spec(entry))
    if said is None:
        assert problem is None
    else:
        assert problem is not None
        assert said in problem


def _write(tmp: Path, name: str, content: str | bytes) -> str:
    path = tmp / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return str(path)


def test_bad_records_are_listed_with_index_line_and_total(tmp_path: Path) -> None:
    bad = _sg(("human", "Hi"), ("robot", "Beep"))
    records = [_sg(("human", "Hi"), ("gpt", "Hello"))] * 3 + [bad] * 8
    path = _write(tmp_path, "many.json", json.dumps(records, indent=1))
    report = check.check_file(path, _spec("sharegpt"), max_errors=5)
    assert (report.records, report.valid, report.invalid) == (11, 3, 8)
    assert report.invalid_indexes == [3, 4, 5, 6, 7]
    assert report.errors[0].startswith("record 3 (line 38): message 1 has the role")
    text = check.summary("mine", path, report, False, _spec("sharegpt"))
    assert f"Dataset mine: 8 of 11 records in {path} are not valid sharegpt records" in text
    assert "; and 3 more." in text
    assert "train on the 3 valid records with -e dataset_skip_invalid=true" in text


def test_valid_records_are_written_only_when_some_are_left_out(tmp_path: Path) -> None:
    good = _sg(("human", "Hi"), ("gpt", "Hello"))
    out = tmp_path / "out" / "valid.jsonl"
    mixed = _write(tmp_path, "mixed.json", json.dumps([good, {"conversations": []}, good]))
    report = check.check_file(mixed, _spec("sharegpt"), valid_out=str(out))
    assert report.written
    assert [json.loads(line) for line in out.read_text().splitlines()] == [good, good]
    out.unlink()
    clean = _write(tmp_path, "clean.json", json.dumps([good, good]))
    assert not check.check_file(clean, _spec("sharegpt"), valid_out=str(out)).written
    assert not out.exists()
    assert list(out.parent.iterdir()) == [], "a partial file was left behind"


def test_a_mapped_column_that_no_record_has_is_a_problem(tmp_path: Path) -> None:
    # LLaMA-Factory 0.9.5 reads example["input"] for every record: KeyError when no record has it.
    path = str(DATA / "alpaca_no_input.json")
    report = check.check_file(path, _spec("alpaca"))
    assert report.invalid == 0
    assert report.problems == [
        'no record has "input", which the entry maps as the query column: LLaMA-Factory 0.9.5 '
        'stops with KeyError: \'input\'. Add "input": "" (or the value) to the records, or '
        "leave that column out of the entry's columns"
    ]


def test_keys_the_entry_does_not_map_are_a_warning() -> None:
    report = check.check_file(str(DATA / "alpaca_history_good.json"), _spec("alpaca"))
    assert report.warnings == [
        'records carry "history", which the entry does not map: LLaMA-Factory ignores it (map '
        "it under columns, e.g. history: history, to train on it)"
    ]
    assert (
        check.check_file(str(DATA / "alpaca_history_good.json"), _spec("alpaca_history")).warnings
        == []
    )


@pytest.mark.parametrize(
    ("formatting", "columns", "tags", "ranking", "said"),
    [
        ("openai", None, None, False, "appends 'detailed thinking off' to every system prompt"),
        (
            "sharegpt",
            None,
            {"role": "from"},
            False,
            "tags has 'role', which LLaMA-Factory does not read",
        ),
        ("alpaca", {"prompt": "q", "query": "i"}, None, False, "columns map no response"),
        ("sharegpt", {"system": "system"}, None, False, "columns map no messages"),
        (
            "sharegpt",
            None,
            {"role_tag": "from"},
            False,
            "tags set no content_tag, user_tag, assistant_tag",
        ),
        ("alpaca", None, None, True, "ranking (preference) datasets need stage rm or dpo"),
        ("csv", None, None, False, "formatting must be alpaca or sharegpt"),
    ],
)
def test_entries_train_yml_cannot_use_are_refused(formatting, columns, tags, ranking, said) -> None:
    with pytest.raises(check.EntryError) as err:
        check.build_spec(formatting, columns, tags, ranking)
    assert said in str(err.value)


def _records(path: str, chunk: int) -> list:
    _, items = check.read_records(path, chunk_bytes=chunk)
    return [item.value for item in items]


def test_a_json_list_is_decoded_alike_whatever_the_chunk_boundaries(tmp_path: Path) -> None:
    rng = random.Random(13)
    values = [
        {
            "instruction": "é" * rng.randrange(0, 9),
            "n": rng.randrange(-(10**12), 10**12),
            "x": rng.random() * 10 ** rng.randrange(-5, 20),
            "nested": [[1, 2.5e-3], {"k": None}],
            "t": 'quote " backslash \\ tab \t',
            "u": "\u4e2d\u6587 \U0001f600",
        }
        for _ in range(60)
    ]
    for indent in (None, 2):
        path = _write(tmp_path, "list.json", json.dumps(values, indent=indent, ensure_ascii=False))
        for chunk in (1, 2, 3, 7, 64, 1 << 20):
            assert _records(path, chunk) == values, f"chunk {chunk}, indent {indent}"


@pytest.mark.parametrize(
    "text",
    [
        '[{"instruction": "hi", "output": "there"},',
        '[{"instruction": "hi", "output": "there"},\n  {"instruction": "hi" "output": "x"}]',
        '[{"instruction": "hi", "output": "there"}] x',
        '[\n {"a": 1},\n {"a": tru}\n]',
        '[\n {"a": "line\nbreak"}\n]',
        '[\n {"a": 1}\n {"a": 2}\n]',
        '[{"a": 1}, {"a": "never closed',
    ],
)
def test_syntax_errors_are_located_where_python_json_locates_them(tmp_path: Path, text) -> None:
    path = _write(tmp_path, "bad.json", text)
    with pytest.raises(json.JSONDecodeError) as expected:
        json.loads(text)
    where = f"line {expected.value.lineno} column {expected.value.colno}"
    for chunk in (1, 5, 1 << 20):
        with pytest.raises(check.DatasetFileError) as err:
            _records(path, chunk)
        assert str(err.value).startswith("is not valid JSON (")
        assert where in str(err.value), f"chunk {chunk}: {err.value} (python: {expected.value})"


def test_json_lines_skip_blank_lines_and_a_broken_line_is_one_bad_record(tmp_path: Path) -> None:
    path = str(DATA / "alpaca_broken_line.jsonl")
    report = check.check_file(path, _spec("alpaca"))
    assert (report.file_format, report.records, report.valid) == ("jsonl", 6, 5)
    assert report.errors == ["record 3 (line 4): is not valid JSON (Expecting value at column 68)"]
    spaced = _write(tmp_path, "spaced.jsonl", json.dumps(A) + "\n\n  \n" + json.dumps(A) + "\n")
    assert check.check_file(spaced, _spec("alpaca")).valid == 2


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"", "is empty: it holds no records"),
        (b" \n\t\n", "is empty: it holds no records"),
        (b'"records"', "is neither a JSON list of records ([{...}, ...]) nor JSON Lines"),
        (b'{\n  "data": []\n}\n', "its first line is not a complete JSON record"),
        (b'\xef\xbb\xbf[{"a": 1}]', "starts with a UTF-8 byte-order mark"),
        (b'[{"instruction": "caf\xe9"}]', "is not UTF-8 text (byte 21: invalid continuation byte)"),
    ],
)
def test_a_file_that_is_not_records_is_named_with_the_reason(tmp_path: Path, content, said) -> None:
    path = _write(tmp_path, "file.json", content)
    with pytest.raises(check.DatasetFileError) as err:
        check.check_file(path, _spec("alpaca"))
    assert said in str(err.value)


def test_a_file_that_is_not_a_dataset_is_never_quoted(tmp_path: Path) -> None:
    # The lab's probe (issue 40): a dataset path linked to /etc/shadow had its first bytes in
    # the error. Only a dataset's own records are ever shown.
    secret = "root:$6$FAKEsaltFAKEhash:19000:0:99999:7:::"
    shadow = _write(tmp_path, "shadow", f"{secret}\ndaemon:*:19000:0:99999:7:::\n".encode())
    linked = tmp_path / "data.json"
    linked.symlink_to(shadow)
    with pytest.raises(check.DatasetFileError) as err:
        check.check_file(str(linked), _spec("alpaca"))
    said = str(err.value)
    assert "is neither a JSON list of records" in said
    assert not [part for part in ("root", "$6$", "FAKE", "daemon") if part in said]


def test_json_lines_with_a_byte_order_mark_are_read(tmp_path: Path) -> None:
    # pyarrow (LLaMA-Factory's JSON Lines reader) skips a BOM; a JSON list with one fails there.
    path = _write(tmp_path, "bom.jsonl", b"\xef\xbb\xbf" + json.dumps(A).encode() + b"\n")
    assert check.check_file(path, _spec("alpaca")).valid == 1


def test_a_record_over_the_size_limit_is_refused_not_read_whole(tmp_path: Path) -> None:
    big = json.dumps([{"instruction": "x" * 5000, "input": "", "output": "y"}])
    path = _write(tmp_path, "big.json", big)
    with pytest.raises(check.DatasetFileError, match="has a record over 0 MiB"):
        check.check_file(path, _spec("alpaca"), chunk_bytes=64, max_record_bytes=1024)
    lines = _write(tmp_path, "big.jsonl", big[1:-1] + "\n" + json.dumps(A) + "\n")
    report = check.check_file(lines, _spec("alpaca"), max_record_bytes=1024)
    assert (report.valid, report.errors) == (1, ["record 0 (line 1): is longer than 0 MiB"])


def test_the_demo_datasets_are_valid() -> None:
    for name, formatting, columns, tags in (
        ("demo_alpaca.json", "alpaca", None, None),
        ("demo_sharegpt.json", *ENTRIES["sharegpt"]),
        ("demo_sharegpt_openai.jsonl", *ENTRIES["openai"]),
    ):
        report = check.check_file(
            str(ROOT / "data" / name), check.build_spec(formatting, columns, tags)
        )
        assert report.records > 0
        assert report.invalid == 0
        assert not report.problems


# Runs in the training venv: LLaMA-Factory's converter on every case, each record on its own
# (as load_dataset would give it: absent keys of the entry's columns are None).
_CONVERT = r"""
import json, sys, types
from llamafactory.data.converter import get_dataset_converter
from llamafactory.data.parser import DatasetAttr

data_args = types.SimpleNamespace(media_dir="")
verdicts = []
for formatting, columns, tags, record in json.load(sys.stdin):
    attr = DatasetAttr("file", dataset_name="case")
    attr.join({"formatting": formatting, **({"columns": columns} if columns is not None else {}),
               **({"tags": tags} if tags is not None else {})})
    columns = ("prompt", "query", "response", "history", "messages", "system")
    example = {k: record.get(k) for k in (getattr(attr, c) for c in columns) if k}
    try:
        out = get_dataset_converter(formatting, attr, data_args)(example)
    except Exception as err:
        verdicts.append(f"raises {type(err).__name__}")
        continue
    turns = out["_prompt"] + out["_response"]
    history = example.get(attr.history) if attr.history else None
    if len(out["_prompt"]) % 2 != 1 or len(out["_response"]) != 1:
        verdicts.append("skipped")
    elif not all(isinstance(t["content"], str) for t in turns):
        verdicts.append("non-string content")
    elif history is not None and not isinstance(history, list):
        verdicts.append("history ignored")
    elif not isinstance(out["_system"], str):
        verdicts.append("non-string system")
    elif not all(t["content"].strip() for t in turns):
        verdicts.append("empty turn")
    else:
        verdicts.append("trains")
print(json.dumps(verdicts))
"""


def test_llamafactory_trains_on_exactly_the_records_the_checker_accepts() -> None:
    if not TRAIN_PYTHON.exists():
        pytest.skip(f"no training venv at {TRAIN_PYTHON}: run scripts/setup-train-venv.sh")
    cases = [(*ENTRIES[entry], record) for entry, record, _ in CASES if isinstance(record, dict)]
    done = subprocess.run(
        [str(TRAIN_PYTHON), "-c", _CONVERT],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    verdicts = json.loads(done.stdout.splitlines()[-1])
    for (formatting, columns, tags, record), verdict in zip(cases, verdicts, strict=True):
        ours = check.check_record(record, check.build_spec(formatting, columns, tags))
        assert (ours is None) == (verdict == "trains"), (record, ours, verdict)


# Bad datasets given to train.yml fail in its first play, on the controller, naming the file, the
# records and what is wrong with them; no node is contacted and nothing is written anywhere.
#
# The inventory points at TEST-NET addresses (192.0.2.0/24) that nothing answers: a request that
# got past the dataset check would fail on "unreachable" instead of the message asserted here.
# All cases run at once (a few ansible-playbook processes side by side), then each is asserted.


def test_a_json_lines_record_nested_too_deep_is_one_bad_record(tmp_path: Path) -> None:
    path = tmp_path / "deep.jsonl"
    good = '{"instruction": "a", "input": "", "output": "b"}'
    deep = '{"instruction": ' + "[" * 100_000
    path.write_text(f"{good}\n{deep}\n{good}\n")
    report = check.check_file(str(path), check.build_spec("alpaca"))
    assert (report.records, report.valid, report.invalid) == (3, 2, 1)
    assert report.errors[0].startswith("record 1 (line 2): has a value nested deeper than")


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (os.mkfifo, "is a named pipe (FIFO), not a file: reading it would wait for a writer"),
        (os.mkdir, "is a directory, not a file"),
        (lambda path: None, "does not exist on the controller"),
        (lambda path: Path(path).write_text("[]"), None),
    ],
)
def test_a_dataset_path_that_is_not_a_file_says_what_it_is(tmp_path: Path, make, said) -> None:
    make(tmp_path / "data.json")
    assert check.file_problem(str(tmp_path / "data.json")) == said
