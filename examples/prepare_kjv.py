"""Plain text of the King James Bible (public domain), split into a training and a held-out part.

Source: Debian's `bible-kjv-text` package (the text of Chip Chapin's Bible Retrieval System), read with its
`bible` program, which prints clean chapters: a "Genesis 1" heading, then one numbered verse a line.
Install them with `apt-get install bible-kjv-text bible-kjv`.

The text is split by chapter, deterministically: every `--every`-th chapter (the 40th, 80th, ... in Bible
order) is held out, the rest is for training. Held-out chapters come from the whole book, so the evaluation
sees the same mix of narrative, law, poetry and letters as training does.

    python examples/prepare_kjv.py --out data/kjv
        -> data/kjv/train.txt, data/kjv/heldout.txt
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from pathlib import Path

# The whole Bible in one verse range; -l sets a line width no verse reaches, so verses are never wrapped.
BIBLE_ARGS = ["-l", "100000", "Gen1:1-Rev22:21"]
HEADING = re.compile(r"^(?:[1-3] )?[A-Z][A-Za-z ]+ \d+$")
VERSE = re.compile(r"^\s*(\d+) (\S.*)$")


def read_bible(bible: str = "bible") -> str:
    exe = shutil.which(bible)
    if exe is None:
        raise SystemExit(f"{bible!r} not found: install it with `apt-get install bible-kjv-text bible-kjv`")
    return subprocess.run([exe, *BIBLE_ARGS], check=True, capture_output=True, text=True).stdout


def chapters(raw: str) -> list[str]:
    """The program's output -> one string per chapter: heading, blank line, "N verse" lines, blank line."""
    out, heading, verses = [], None, []
    for line in raw.splitlines():
        line = line.rstrip()
        if not line:
            continue
        if HEADING.match(line):
            if heading is not None:
                out.append(heading + "\n\n" + "\n".join(verses) + "\n\n")
            heading, verses = line, []
            continue
        m = VERSE.match(line)
        if m is None or heading is None:
            raise SystemExit(f"unexpected line in the bible program's output: {line[:80]!r}")
        verses.append(f"{m.group(1)} {m.group(2)}")
    if heading is not None:
        out.append(heading + "\n\n" + "\n".join(verses) + "\n\n")
    return out


def split(chs: list[str], every: int) -> tuple[str, str]:
    held = [c for i, c in enumerate(chs) if i % every == every - 1]
    train = [c for i, c in enumerate(chs) if i % every != every - 1]
    return "".join(train), "".join(held)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="data/kjv", help="folder for train.txt and heldout.txt (default: data/kjv)")
    p.add_argument("--every", type=int, default=40, help="hold out every N-th chapter (default: 40)")
    p.add_argument("--bible", default="bible", help="the bible-kjv program (default: bible on PATH)")
    args = p.parse_args(argv)
    chs = chapters(read_bible(args.bible))
    if len(chs) != 1189:  # the Protestant canon's chapter count: a cheap check the output was read right
        raise SystemExit(f"expected 1189 chapters, read {len(chs)}")
    train, held = split(chs, args.every)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.txt").write_text(train, encoding="utf-8")
    (out / "heldout.txt").write_text(held, encoding="utf-8")
    print(f"{len(chs)} chapters: train {len(train):,} characters, held out {len(held):,} characters "
          f"({len(chs) // args.every} chapters, every {args.every}th) -> {out}")


if __name__ == "__main__":
    main()
