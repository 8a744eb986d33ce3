"""data.checks.check_utf8: the offset it names past its first 4 MiB read, a multi-byte character split
across two reads, and a file that ends inside one. tests/unit/test_prepare.py and test_config.py check a bad
byte within the first read only. At the end, check_json_depth: what it counts as nesting."""
import pytest

from pipetrain.config import ConfigError
from pipetrain.data.checks import MAX_JSON_DEPTH, check_json_depth, check_utf8

BLOCK = 1 << 22  # check_utf8 reads this many bytes at a time


def test_the_offset_of_a_bad_byte_past_the_first_read_counts_the_reads_before_it(tmp_path):
    path = tmp_path / "big.txt"
    path.write_bytes(b"a" * (BLOCK + 10) + b"\xff" + b"b" * 5)
    with pytest.raises(ConfigError, match=rf"big.txt is not UTF-8 text \(byte 0xff at offset {BLOCK + 10}\)"):
        check_utf8([str(path)], "data.path")


def test_a_character_split_between_two_reads_is_text_and_a_bad_byte_after_it_is_placed_exactly(tmp_path):
    good = tmp_path / "good.txt"
    good.write_bytes(b"a" * (BLOCK - 1) + "é".encode() + b"b" * 5)  # 0xc3 ends the first read, 0xa9 starts the next
    check_utf8([str(good)], "data.path")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"a" * (BLOCK - 1) + "é".encode() + b"b" * 5 + b"\xff")
    with pytest.raises(ConfigError, match=rf"bad.txt is not UTF-8 text \(byte 0xff at offset {BLOCK + 6}\)"):
        check_utf8([str(bad)], "data.path")


def test_a_file_that_ends_inside_a_multi_byte_character_is_refused(tmp_path):
    path = tmp_path / "cut.jsonl"
    path.write_bytes('{"text": "caf'.encode() + "é".encode()[:1])
    with pytest.raises(ConfigError, match=r"cut.jsonl is not UTF-8 text \(it ends inside a multi-byte character\)"):
        check_utf8([str(path)], "data.sources")


def test_a_parquet_folder_is_not_checked_as_text_and_prepares(tmp_path):
    """Parquet is binary: check_utf8 reads .txt/.jsonl/.json only. No other test prepares a valid parquet file,
    so a check that read every file (refusing every parquet corpus) passed the suite."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipetrain.data import load_tokenizer, open_prepared, prepare
    from tests.unit.test_prepared_offsets import TOKENIZER

    raw = tmp_path / "raw"
    raw.mkdir()
    texts = [f"Document {i}. " + "To be, or not to be. " * (3 + i) for i in range(3)]
    pq.write_table(pa.table({"text": texts, "id": pa.array([-1] * 3, pa.int64())}), str(raw / "part-0.parquet"))
    assert b"\xff" in (raw / "part-0.parquet").read_bytes()  # not UTF-8 text
    check_utf8([str(raw / "part-0.parquet")], "data.path")
    tokenizer = load_tokenizer(TOKENIZER)
    out = prepare(str(raw), tokenizer, cache_dir=str(tmp_path / "cache"), progress=False)
    corpus = open_prepared(out, tokenizer, verify=True)
    assert corpus.manifest["num_documents"] == 3


@pytest.mark.parametrize("text,deep", [
    ('{"t": ' + "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH + "}\n", True),  # the object's own level is one more
    ('{"t": ' + "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1) + "}\n", False),
    ('{"t": "' + "[{" * 500 + '"}\n', False),  # brackets inside a string are text
    ('{"t": "a \\" ' + "[" * 500 + '"}\n', False),  # an escaped quote does not end the string
    ("[\n" + '{"t":\n[\n' * 60 + "1" + "]}" * 60 + "\n]\n", True),  # a .json document nests across lines
])
def test_json_depth_counts_brackets_outside_strings_only(tmp_path, text, deep):
    path = tmp_path / "a.json"
    path.write_text(text)
    if deep:
        with pytest.raises(ConfigError, match=rf"a.json nests arrays/objects more than {MAX_JSON_DEPTH} deep"):
            check_json_depth([str(path)], "data.path")
    else:
        check_json_depth([str(path)], "data.path")
