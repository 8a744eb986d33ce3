"""Prepared corpora: tokenise raw files once into memory-mappable token files with a manifest.

A prepared directory holds
- `tokens.bin`: every document's tokens, each document closed by EOS, concatenated; uint16 when the
  tokenizer has at most 65535 ids, else uint32 (raw little-endian, read with np.memmap);
- `documents.bin`: int64 offsets, documents[i]..documents[i+1] is document i (num_documents + 1 values);
- `mask.bin`: uint8 loss mask, 1 where the token is a training target; only when records carry masks
  (prompt/completion or chat fine-tuning data), absent for plain text (every target trains);
- `manifest.json`: format, tokenizer fingerprint, dtype, token and document counts, the source files
  (path, size, mtime, sha256) and every written file (size, sha256).

Writing is atomic: everything goes into `<dir>.tmp-<host>-<pid>` and is renamed to its final name only
once complete and fsynced, so a killed prepare leaves no directory that looks complete, and a directory
in use is never written into; the next prepare of that directory on the same host deletes the temp
directories whose writer is no longer alive. Preparing is idempotent: a directory whose manifest exists
is returned as is. Raw data is prepared under `<cache_dir>/prepared-<key>`, the key hashing the source
files (path, size, mtime), text field and tokenizer fingerprint, so edited data gets a new directory.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from pipetrain.config import ConfigError, clip
from pipetrain.data.checks import check_json_depth, check_utf8, unreadable
from pipetrain.data.sources import refuse_links_outside, source_files
from pipetrain.folders import refuse_folder_links_outside
from pipetrain.procs import pid_alive
from pipetrain.sft import encode_record

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_HASH_BLOCK = 1 << 24


def load_tokenizer(path: str, where: str = "data.tokenizer"):
    """A Hugging Face tokenizer from a local directory (or a hub name when online). where: the recipe key or
    flag that named path, for errors."""
    from transformers import AutoTokenizer  # heavy: imported only when a tokenizer is needed

    if not path:
        raise ConfigError(f"{where} is empty; set it to a tokenizer directory such as pipetrain/assets/tokenizer")
    if os.path.sep in path and not os.path.isdir(path):
        raise ConfigError(f"{where}: directory {path!r} not found; point it at a folder with tokenizer.json")
    if os.path.isdir(path):
        refuse_folder_links_outside(path, where)
    try:
        # never run code shipped in the folder: with False, transformers neither asks on stdin nor imports
        # an auto_map module, and a folder whose auto_map names a class it ships still loads with that class
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as exc:  # a malformed folder fails anywhere in transformers / tokenizers (KeyError, TypeError,
        # their bare Exception): whatever it is, the folder is the input at fault
        custom = _custom_code_file(path)
        if custom:
            raise ConfigError(f"{where}: {custom} names custom code (auto_map) that pipetrain will not run; "
                              "use a tokenizer whose class transformers ships (tokenizer.json + "
                              "tokenizer_config.json without auto_map)") from None
        first = clip(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
        raise ConfigError(f"{where}: cannot load {path!r} ({first}); "
                          "use a local directory with tokenizer.json") from None
    if tok.eos_token_id is None:
        raise ConfigError(f"{where}: {path!r} has no EOS token; documents need one as separator")
    return tok


def _custom_code_file(path: str) -> str:
    """The folder's config file whose auto_map points at code in the folder ("" when none does)."""
    for name in ("tokenizer_config.json", "config.json"):
        file = os.path.join(path, name)
        try:
            with open(file) as f:
                if "auto_map" in json.load(f):
                    return file
        except (OSError, ValueError, TypeError, RecursionError):  # unreadable: it names no code
            continue
    return ""


def tokenizer_fingerprint(tokenizer) -> str:
    """Identifies what tokenising means: vocabulary, EOS and chat template (chat data renders through it)."""
    h = hashlib.sha256(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    h.update(str(tokenizer.eos_token_id).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return h.hexdigest()[:16]


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max else np.uint32)


def is_prepared(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def prepared_dir_for(path: str, text_field: str, tokenizer, cache_dir: Optional[str]) -> str:
    """Where raw data at `path` is (or will be) prepared; `path` itself when it is a prepared directory."""
    if is_prepared(path):
        return path
    _, files = source_files(path)
    h = hashlib.sha256(f"v{FORMAT_VERSION}|{path}|{text_field}|{tokenizer_fingerprint(tokenizer)}".encode())
    for f in files:
        st = os.stat(f)
        h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}".encode())
    root = os.path.expanduser(cache_dir or "~/.cache/pipetrain")
    return os.path.join(root, f"prepared-{h.hexdigest()[:20]}")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def _load_dataset(path: str, builder: str, files: list[str], cache_dir: str, progress: bool):
    """The documents as a datasets.Dataset (local files through the generic builders)."""
    import datasets  # heavy: only preparing needs it

    if progress:
        datasets.enable_progress_bars()
    else:
        datasets.disable_progress_bars()

    if builder == "text":  # one document per file
        return datasets.load_dataset("text", data_files=files, sample_by="document", split="train",
                                     cache_dir=os.path.join(cache_dir, "datasets"))
    if builder:
        return datasets.load_dataset(builder, data_files=files, split="train",
                                     cache_dir=os.path.join(cache_dir, "datasets"))
    return datasets.load_dataset(path, split="train")


# A tokenizer's working memory grows with its input (about 140 bytes a character for the shipped fast
# tokenizer: a 200 MB one-line file needed over 24 GB), so longer documents are tokenised in pieces of at
# most this many characters, cut where a pre-tokenizer would split anyway: before a single space that
# follows a non-space (never inside a run of whitespace, which pre-tokenizers keep together).
PIECE_CHARS = 1 << 18


def text_pieces(text: str, limit: int = PIECE_CHARS) -> list[str]:
    """text cut into pieces of at most `limit` characters whose tokens, concatenated, are the text's."""
    pieces, start = [], 0
    while len(text) - start > limit:
        cut = text.rfind(" ", start + 1, start + limit)
        while cut > start and text[cut - 1].isspace():
            cut = text.rfind(" ", start + 1, cut)
        if cut <= start:  # no clean boundary (one giant word): cut at the limit
            cut = start + limit
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


class _EncodeText:
    """datasets.map function (picklable for num_proc > 1): text column -> ids closed by EOS (int32 arrays:
    a quarter of the memory of Python lists for long documents)."""

    def __init__(self, tokenizer, text_field: str):
        self.tokenizer, self.text_field = tokenizer, text_field

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        eos = self.tokenizer.eos_token_id
        texts = batch[self.text_field]
        for index, text in zip(indices, texts):
            if not isinstance(text, str):  # a jsonl/parquet field holding null or a number
                raise ConfigError(f"data.text_field={self.text_field!r}: record {index} holds {clip(repr(text))}, "
                                  "not text; fix or remove that record")
        out = []
        for text in texts:  # one piece at a time: the tokenizer's memory is bounded by PIECE_CHARS
            out.append(np.concatenate([np.asarray(self.tokenizer(piece, add_special_tokens=False)["input_ids"],
                                                  dtype=np.int32) for piece in text_pieces(text)])
                       if len(text) > PIECE_CHARS else None)
        short = [t for t, ids in zip(texts, out) if ids is None]
        encoded = iter(self.tokenizer(short, add_special_tokens=False)["input_ids"] if short else [])
        tail = np.array([eos], dtype=np.int32)
        return {"ids": [np.concatenate([np.asarray(next(encoded), dtype=np.int32) if ids is None else ids, tail])
                        for ids in out]}


class _EncodeRecords:
    """datasets.map function: prompt/completion or chat records -> ids and loss mask (sft.encode_record)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, batch: dict) -> dict:
        keys = list(batch)
        out = {"ids": [], "mask": []}
        for i in range(len(batch[keys[0]])):
            ids, mask = encode_record({k: batch[k][i] for k in keys}, self.tokenizer)
            out["ids"].append(ids)
            out["mask"].append([int(m) for m in mask])
        return out


class _HashedWriter:
    """A binary file written sequentially, hashed on the way (so the manifest costs no second read)."""

    def __init__(self, path: str):
        self.path, self.file, self.hash, self.size = path, open(path, "wb"), hashlib.sha256(), 0

    def write(self, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array).tobytes()
        self.file.write(data)
        self.hash.update(data)
        self.size += len(data)

    def close(self) -> dict:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return {"size": self.size, "sha256": self.hash.hexdigest()}


def _temp_prefix(out_dir: str) -> str:
    """`<out_dir>.tmp-<host>-`: this host's writers of out_dir append their pid."""
    return f"{out_dir}.tmp-{socket.gethostname()}-"


def remove_dead_temps(out_dir: str) -> list[str]:
    """Delete the temp directories of out_dir left by this host's killed prepares; the deleted paths.
    A temp directory whose pid is alive may be in use and is kept (a reused pid only keeps garbage, never
    deletes a live writer's files); another host's pids cannot be checked from here, so those are kept too."""
    parent, prefix = os.path.split(_temp_prefix(out_dir))
    parent = parent or "."
    removed = []
    for name in sorted(os.listdir(parent)) if os.path.isdir(parent) else []:
        pid = name[len(prefix):] if name.startswith(prefix) else ""
        if pid.isascii() and pid.isdigit() and not pid_alive(int(pid)):  # isdigit alone takes "\u00b2"
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
            removed.append(os.path.join(parent, name))
    return removed


def prepare(path: str, tokenizer, *, text_field: str = "text", cache_dir: Optional[str] = None,
            num_proc: int = 1, progress: bool = True, out_dir: Optional[str] = None, where: str = "data.path") -> str:
    """Tokenise the raw data at `path` into a prepared directory and return it (at once when it exists).
    where: the recipe key that named path, for errors."""
    out_dir = out_dir or prepared_dir_for(path, text_field, tokenizer, cache_dir)
    if is_prepared(out_dir):
        return out_dir
    builder, files = source_files(path, where)
    check_utf8(files, where)
    check_json_depth(files, where)
    if files and all(os.path.getsize(f) == 0 for f in files):
        raise ConfigError(f"data.path: {path!r} holds no documents (empty files); add data or remove this source")
    empty = [f for f in files if builder != "text" and os.path.getsize(f) == 0]
    if empty:  # the json/parquet readers cannot infer columns from an empty file
        raise ConfigError(f"data.path: {empty[0]!r} is empty; remove it or add records")
    root = os.path.expanduser(cache_dir or "~/.cache/pipetrain")
    try:  # the cache's own fault named as the cache's, not blamed on data.path's files below
        os.makedirs(os.path.join(root, "datasets"), exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"data.cache_dir={root!r} cannot be used ({exc.strerror or exc}: {exc.filename}); point "
                          "data.cache_dir at a folder you can write") from None
    try:
        ds = _load_dataset(path, builder, files, root, progress)
    except Exception as exc:  # noqa: BLE001  (datasets and pyarrow raise many kinds; each is bad input here)
        raise unreadable(where, path, builder or "a datasets name", exc) from None
    columns = set(ds.column_names)
    records = {"prompt", "completion"} <= columns or "messages" in columns
    if not records and text_field not in columns:
        raise ConfigError(f"data.text_field={text_field!r} is not a column of {path!r} (columns: {sorted(columns)}); "
                          "set data.text_field or use prompt/completion or messages records")
    if len(ds) == 0:
        raise ConfigError(f"data.path: {path!r} holds no documents; add data or remove this source")
    fn = _EncodeRecords(tokenizer) if records else _EncodeText(tokenizer, text_field)
    start = time.perf_counter()
    mapped = ds.map(fn, batched=True, batch_size=64, num_proc=num_proc if num_proc > 1 else None,
                    with_indices=not records, remove_columns=ds.column_names, desc="tokenising")

    tmp = f"{_temp_prefix(out_dir)}{os.getpid()}"
    remove_dead_temps(out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    dtype = token_dtype(len(tokenizer))
    tokens = _HashedWriter(os.path.join(tmp, "tokens.bin"))
    docs = _HashedWriter(os.path.join(tmp, "documents.bin"))
    mask = _HashedWriter(os.path.join(tmp, "mask.bin")) if records else None
    docs.write(np.zeros(1, dtype=np.int64))
    num_tokens = num_docs = trained = 0
    bar = _progress_bar(progress)
    for table in mapped.with_format("arrow").iter(batch_size=1024):
        ids = table.column("ids").combine_chunks()
        flat = ids.flatten().to_numpy()
        if flat.size and int(flat.max()) > np.iinfo(dtype).max:
            raise ConfigError(f"data.tokenizer: token id {int(flat.max())} does not fit {dtype.name}")
        tokens.write(flat.astype(dtype))
        lengths = ids.value_lengths().to_numpy().astype(np.int64)
        docs.write(num_tokens + np.cumsum(lengths))
        if mask is not None:
            trains = table.column("mask").combine_chunks().flatten().to_numpy().astype(np.uint8)
            mask.write(trains)
            trained += int(trains.sum())
        num_tokens += int(flat.size)
        num_docs += len(lengths)
        if bar is not None:
            bar.update(int(flat.size))
    if bar is not None:
        bar.close()
    if num_tokens <= num_docs:  # nothing but the EOS closing each (empty) document
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"data.path: {path!r} holds no text (only empty documents); add data or remove this source")
    if mask is not None and not trained:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"data.path: {path!r} has no token to train on: no record has a completion or an "
                          "assistant turn with text; give each record one")
    written = {"tokens.bin": tokens.close(), "documents.bin": docs.close()}
    if mask is not None:
        written["mask.bin"] = mask.close()
    seconds = time.perf_counter() - start
    manifest = {
        "format": FORMAT_VERSION,
        "tokenizer": {"fingerprint": tokenizer_fingerprint(tokenizer), "name": tokenizer.name_or_path,
                      "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id},
        "dtype": dtype.name, "num_tokens": num_tokens, "num_documents": num_docs, "has_mask": mask is not None,
        "text_field": text_field, "path": path,
        "sources": [{"path": f, "size": os.stat(f).st_size, "mtime_ns": os.stat(f).st_mtime_ns,
                     "sha256": _sha256(f)} for f in files] or [{"name": path}],
        "files": written, "prepare_seconds": round(seconds, 3),
    }
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.rename(tmp, out_dir)
    except OSError:  # another process (another node on a shared disk) finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
        if not is_prepared(out_dir):
            raise
    if progress:
        print(f"prepared {out_dir}: {num_tokens:,} tokens in {num_docs:,} documents, {seconds:.1f} s "
              f"({num_tokens / max(seconds, 1e-9):,.0f} tokens/s)", flush=True)
    return out_dir


def _progress_bar(enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm  # only the preparing rank draws a bar

    return tqdm(desc="writing tokens", unit="tok", unit_scale=True, mininterval=1.0)


@dataclass
class Corpus:
    """A prepared directory opened read-only: memory maps, shared with every process of the machine."""
    path: str
    tokens: np.ndarray              # (N,) uint16 | uint32 memmap
    documents: np.ndarray           # (num_documents + 1,) int64 memmap of offsets
    mask: Optional[np.ndarray]      # (N,) uint8 memmap, or None when every target trains
    manifest: dict


def open_prepared(path: str, tokenizer=None, verify: bool = False, sources: bool = False) -> Corpus:
    """Open a prepared directory, checking it against the tokenizer and (verify) its file hashes; sources: also
    that the raw files it was prepared from, where still present, are unchanged (only for a directory this
    cache made from data.path: a prepared folder handed over stands alone, and its manifest may name any path,
    which must not be read)."""
    if not is_prepared(path):
        raise ConfigError(f"data.path: {path!r} has no {MANIFEST}; run python -m pipetrain.data prepare --recipe R")
    manifest_path = os.path.join(path, MANIFEST)
    refuse_links_outside(path, [manifest_path], "data.path")  # the folder stands alone, its manifest too
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep to parse
        raise ConfigError(f"data.path: {manifest_path} cannot be read ({type(exc).__name__}: "
                          f"{str(exc)[:200]}); delete {path} and prepare again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        got = manifest.get("format") if isinstance(manifest, dict) else f"a JSON {type(manifest).__name__}"
        raise ConfigError(f"data.path: {manifest_path} has format {got}, this pipetrain reads "
                          f"{FORMAT_VERSION}; delete {path} and prepare again")
    damage = _manifest_damage(manifest)
    if damage:
        raise ConfigError(f"data.path: {manifest_path} is damaged ({damage}); delete {path} and prepare again")
    if tokenizer is not None:
        have, want = manifest["tokenizer"]["fingerprint"], tokenizer_fingerprint(tokenizer)
        if have != want:
            raise ConfigError(f"data.path: {path} was prepared with tokenizer {manifest['tokenizer']['name']!r} "
                              f"(fingerprint {have}), but data.tokenizer {tokenizer.name_or_path!r} is {want}; "
                              "set data.tokenizer to the one it was made with or prepare the raw data again")
    dtype = np.dtype(manifest["dtype"])
    n_tok, n_doc = manifest["num_tokens"], manifest["num_documents"]
    expected = {"tokens.bin": n_tok * dtype.itemsize, "documents.bin": (n_doc + 1) * 8}
    if manifest["has_mask"]:
        expected["mask.bin"] = n_tok
    refuse_links_outside(path, [os.path.join(path, n) for n in expected], "data.path")
    for name, size in expected.items():
        file = os.path.join(path, name)
        actual = os.path.getsize(file) if os.path.isfile(file) else None
        if actual != size or manifest["files"][name]["size"] != size:
            raise ConfigError(f"data.path: {file} is truncated or damaged ({actual} bytes, manifest says {size}); "
                              f"delete {path} and prepare again")
        if verify and _sha256(file) != manifest["files"][name]["sha256"]:
            raise ConfigError(f"data.path: {file} does not match the sha256 in {manifest_path}; "
                              f"delete {path} and prepare again")
    if verify and sources:
        _check_sources(manifest, manifest_path, path)
    if n_tok < 2:
        raise ConfigError(f"data.path: {path} holds {n_tok} tokens; add data")
    tokens = np.memmap(os.path.join(path, "tokens.bin"), dtype=dtype, mode="r", shape=(n_tok,))
    top = int(tokens.max()) if verify and tokenizer is not None else None  # one pass, cheaper than the hash
    if top is not None and top >= len(tokenizer):
        raise ConfigError(f"data.path: {os.path.join(path, 'tokens.bin')} holds token id {top}, past "
                          f"the tokenizer's {len(tokenizer)} tokens; delete {path} and prepare again")
    documents = np.memmap(os.path.join(path, "documents.bin"), dtype=np.int64, mode="r", shape=(n_doc + 1,))
    if documents[0] != 0 or documents[-1] != n_tok or (n_doc and bool((np.diff(documents) < 0).any())):
        raise ConfigError(f"data.path: {os.path.join(path, 'documents.bin')} does not hold document offsets from 0 "
                          f"to num_tokens={n_tok}, rising; delete {path} and prepare again")
    mask = (np.memmap(os.path.join(path, "mask.bin"), dtype=np.uint8, mode="r", shape=(n_tok,))
            if manifest["has_mask"] else None)
    return Corpus(path, tokens, documents, mask, manifest)


def _manifest_damage(manifest: dict) -> str | None:
    """What is wrong with the fields open_prepared reads (None: nothing): a hand-edited or damaged manifest gets
    one line, not a KeyError or TypeError deep in the loader."""
    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    tok, files = manifest.get("tokenizer"), manifest.get("files")
    if not (isinstance(tok, dict) and isinstance(tok.get("fingerprint"), str) and isinstance(tok.get("name"), str)):
        return "tokenizer must hold a name and a fingerprint"
    if manifest.get("dtype") not in ("uint16", "uint32"):
        return f"dtype must be uint16 or uint32, got {str(manifest.get('dtype'))[:40]!r}"
    for key in ("num_tokens", "num_documents"):
        if not count(manifest.get(key)):
            return f"{key} must be an integer >= 0, got {str(manifest.get(key))[:40]!r}"
    if not isinstance(manifest.get("has_mask"), bool):
        return "has_mask must be true or false"
    names = ["tokens.bin", "documents.bin"] + (["mask.bin"] if manifest["has_mask"] else [])
    if not isinstance(files, dict) or not all(isinstance(files.get(n), dict) and count(files[n].get("size")) and
                                              isinstance(files[n].get("sha256"), str) for n in names):
        return f"files must give the size and sha256 of {', '.join(names)}"
    sources = manifest.get("sources", [])
    def source(s) -> bool:  # a file (what _check_sources reads) or a dataset's name
        return isinstance(s, dict) and (isinstance(s.get("name"), str) if "path" not in s else
                                        isinstance(s["path"], str) and count(s.get("size")) and
                                        isinstance(s.get("mtime_ns"), int) and isinstance(s.get("sha256"), str))
    if not isinstance(sources, list) or not all(source(s) for s in sources):
        return "sources must be a list of mappings of path, size, mtime_ns and sha256 (or a dataset's name)"
    return None


def _check_sources(manifest: dict, manifest_path: str, path: str) -> None:
    """Sources still present must be what was tokenised (hashed only when size or mtime moved)."""
    for src in manifest["sources"]:
        file = src.get("path")
        if file is None or not os.path.isfile(file):
            continue  # prepared elsewhere or raw data removed: the prepared files stand alone
        st = os.stat(file)
        if st.st_size == src["size"] and st.st_mtime_ns == src["mtime_ns"]:
            continue
        if st.st_size != src["size"] or _sha256(file) != src["sha256"]:
            raise ConfigError(f"data.path: source {file} changed since {path} was prepared (hash in {manifest_path} "
                              f"does not match); prepare again or restore the file")
