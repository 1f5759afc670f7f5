"""The text the shipped models learn from and are judged on: the running Python's
standard library sources, split by file into a training side and a held-out side.

Every Python install ships its standard library as ``.py`` files
(``sysconfig.get_paths()["stdlib"]``): tens of megabytes of real code, comments and
docstrings, with no download. Installed third-party packages (``site-packages``,
``dist-packages``) are left out, so the text is the same for every install of one
Python version.

The held-out split is by file, decided by a hash of the file's path relative to the
library root: the same files are held out on every machine and in every run, and no
file contributes tokens to both sides (nearby lines of one file would otherwise make
the held-out loss look better than it is). ``replayssm train`` trains on one side; the
evaluation tools (``bench acceptance``, ``closed-loop``, ``drift``, the main job's
held-out loss) read the other, through :func:`heldout_files` and
:func:`heldout_stream`.

This module sits below both :mod:`replayssm.train` and :mod:`replayssm.bench` and
imports neither: it depends on nothing in the package.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import torch

#: Directory names below the library root that are not the standard library.
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
#: The token that joins files in a stream (training and held-out alike).
EOS_TOKEN = "<|endoftext|>"


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass
class SourceFile:
    """One ``.py`` file: its path relative to the library root (``/``-separated) and text."""

    rel: str
    text: str


@dataclass
class Corpus:
    """The files of one side of the split and what was skipped while reading."""

    train: list[SourceFile] = field(default_factory=list)
    heldout: list[SourceFile] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # files that are not UTF-8 text
    root: str = ""

    def summary(self) -> dict:
        def side(files):
            return {"files": len(files), "bytes": sum(len(f.text.encode()) for f in files)}

        return {"root": self.root, "train": side(self.train), "heldout": side(self.heldout),
                "skipped_not_utf8": len(self.skipped)}


def is_heldout(rel: str, percent: float) -> bool:
    """Whether the file at relative path ``rel`` is held out: the first 8 bytes of the
    SHA-256 of the path, as a fraction of 2^64, below ``percent / 100``. Stable across
    machines, runs and Python versions (no ``hash()`` randomisation)."""
    if not 0 <= percent < 100:
        raise ValueError(f"percent must be in [0, 100), got {percent!r}")
    h = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")
    return h < percent / 100 * 2**64


def list_sources(root: str | os.PathLike | None = None) -> list[str]:
    """Relative paths of the ``.py`` files under ``root`` (default: the standard
    library), sorted, without third-party package directories."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise ValueError(f"{os.fspath(root)!r} is not a directory")
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                out.append(Path(dirpath, name).relative_to(root).as_posix())
    return sorted(out)


#: The share of files ``replayssm train`` holds out by default; the evaluation tools
#: (acceptance, closed-loop, drift) read the same held-out files.
HELDOUT_PERCENT = 5.0


def load_corpus(root: str | os.PathLike | None = None, *, heldout_percent: float = HELDOUT_PERCENT,
                max_files: int | None = None) -> Corpus:
    """Read and split the sources under ``root``.

    Args:
        root: directory to read (default: the standard library).
        heldout_percent: share of files held out (by :func:`is_heldout`).
        max_files: read only the first ``max_files`` files in sorted path order (tests
            and quick runs).
    """
    root = Path(root) if root is not None else stdlib_root()
    rels = list_sources(root)
    if max_files is not None:
        rels = rels[:max_files]
    corpus = Corpus(root=os.fspath(root))
    for rel in rels:
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            # A few test files are deliberately not UTF-8 (encoding tests); they are
            # counted in the log, not guessed at.
            corpus.skipped.append(rel)
            continue
        if not text.strip():
            continue
        (corpus.heldout if is_heldout(rel, heldout_percent) else corpus.train).append(SourceFile(rel, text))
    if not corpus.train:
        raise ValueError(f"no training files under {os.fspath(root)!r}")
    return corpus


def encode_files(tokenizer, files: list[SourceFile]) -> torch.Tensor:
    """One int32 stream: each file's tokens followed by ``<|endoftext|>``, files in
    order."""
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    if eos is None:
        raise ValueError(f"the tokenizer has no {EOS_TOKEN!r} token")
    encs = tokenizer.backend_tokenizer.encode_batch([f.text for f in files], add_special_tokens=False)
    ids: list[int] = []
    for e in encs:
        ids.extend(e.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def heldout_files() -> list[SourceFile]:
    """The standard library's held-out files (:data:`HELDOUT_PERCENT`, the files the
    shipped models never trained on), in path order."""
    return load_corpus(heldout_percent=HELDOUT_PERCENT).heldout


def heldout_stream(tokenizer, files: list[SourceFile] | None = None) -> torch.Tensor:
    """``files`` (default :func:`heldout_files`) as one int64 token stream, joined by the
    end-of-text token as in training."""
    return encode_files(tokenizer, heldout_files() if files is None else files).long()


def heldout_windows(stream: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """Up to ``count`` windows spread evenly over the held-out stream (the same every
    evaluation, so the held-out curve has no sampling noise between points)."""
    n = stream.numel() - length
    if n <= 0:
        raise ValueError(f"the held-out stream ({stream.numel()} tokens) is shorter than a window; hold out more "
                         f"files (--heldout-percent) or shorten --seq-len")
    count = min(count, n)
    starts = torch.linspace(0, n - 1, count).long().unique()
    return torch.stack([stream[s : s + length] for s in starts.tolist()]).long()
