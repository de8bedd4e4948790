#!/usr/bin/python3
"""Builds the tokenizer benchmark's inputs from what a Debian system has
(compare.sh runs it):

    make_corpus.py OUTDIR [MB_PER_SOURCE]

OUTDIR/text.txt   varied text, MB_PER_SOURCE (default 12) MB from each of:
                  /usr/share/doc (README, changelogs; .gz decompressed),
                  /usr/include headers, the Python standard library's
                  sources, man pages (roff, .gz decompressed; localized
                  ones too), and generated text in many scripts
                  (tests/train/gen_bpe_corpus.py)
OUTDIR/english.txt the doc and man parts only (prose)
OUTDIR/train.txt  2 MB of each source: what the vocabulary learns from
OUTDIR/random.bin 10 MB of random bytes
Files are read in sorted order; files with NUL bytes are skipped.
"""
import glob
import gzip
import os
import random
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = os.path.join(HERE, "..", "..", "tests", "train", "gen_bpe_corpus.py")


def gather(patterns, limit):
    out, n = [], 0
    paths = sorted(set(p for pat in patterns for p in glob.glob(pat, recursive=True)))
    for p in paths:
        if n >= limit:
            break
        try:
            if not os.path.isfile(p) or os.path.islink(p):
                continue
            with open(p, "rb") as f:
                data = f.read(4 << 20)
            if p.endswith(".gz"):
                data = gzip.decompress(data)
        except (OSError, EOFError, gzip.BadGzipFile):
            continue
        if b"\0" in data or not data:
            continue
        data = data[:limit - n]
        out.append(data)
        n += len(data)
    return b"".join(out)


def main(argv):
    if len(argv) not in (2, 3):
        sys.exit(__doc__)
    outdir = argv[1]
    mb = int(argv[2]) if len(argv) == 3 else 12
    limit = mb << 20
    os.makedirs(outdir, exist_ok=True)
    gen = os.path.join(outdir, "generated.txt")
    subprocess.run([sys.executable, GEN, "text", str(limit), "11", gen], check=True)
    with open(gen, "rb") as f:
        generated = f.read()
    sources = [
        ("doc", gather(["/usr/share/doc/**/README*", "/usr/share/doc/**/*.txt",
                        "/usr/share/doc/**/changelog*.gz", "/usr/share/doc/**/NEWS*"], limit)),
        ("include", gather(["/usr/include/**/*.h"], limit)),
        ("python", gather(["/usr/lib/python3*/**/*.py"], limit)),
        ("man", gather(["/usr/share/man/*/man*/*.gz", "/usr/share/man/man*/*.gz"], limit)),
        ("generated", generated),
    ]
    with open(os.path.join(outdir, "text.txt"), "wb") as f:
        for _, data in sources:
            f.write(data)
    with open(os.path.join(outdir, "english.txt"), "wb") as f:
        f.write(sources[0][1] + sources[3][1])
    with open(os.path.join(outdir, "train.txt"), "wb") as f:
        for _, data in sources:
            f.write(data[:2 << 20])
    with open(os.path.join(outdir, "random.bin"), "wb") as f:
        f.write(random.Random(12).randbytes(10 << 20))
    for name, data in sources:
        print("%-9s %6.1f MB" % (name, len(data) / 1e6))


if __name__ == "__main__":
    main(sys.argv)
