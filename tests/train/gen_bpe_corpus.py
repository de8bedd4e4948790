#!/usr/bin/python3
"""Writes deterministic test text for the tokenizer (test_bpe.sh,
bench/bpe/compare.sh): what GPT-2's pre-split pattern finds hard.

    gen_bpe_corpus.py text  BYTES SEED OUT   varied text, about BYTES long
    gen_bpe_corpus.py bytes BYTES SEED OUT   uniformly random bytes

The text mixes: English-like prose and code; contractions in every case
('s 'S 'LL, doubled and curly quotes); numbers in many scripts; many
scripts with combining marks (Latin, Greek, Cyrillic, Arabic and Hebrew
right-to-left, Devanagari, Thai, CJK, Hangul, kana); emoji with
modifiers, joiners and flags; every white-space character the pattern's
\\s knows, and look-alikes it does not (ZWSP, BOM, U+001C..U+001F), in runs
at the start, middle and end of lines; code points drawn from all of
Unicode; malformed UTF-8 (overlong forms, surrogates, > U+10FFFF,
truncated sequences, stray continuation bytes); and long runs (past the
scanner's and the merge heap's thresholds) of each class.
"""
import random
import sys

WORDS = ("the of and to in is was that for it with as his on be at by had this not are but "
         "from or have an they which one you were her all she there would their we him been "
         "has when who will more no if out so said what up its about into than them can only "
         "other new some could time these two may then do first any my now such like our over "
         "man me even most made after also did many before must through back years where much "
         "your way well down should because each just those people how too little state good "
         "very make world still own see men work long get here between both life being under "
         "never day same another know while last might us great old year off come since "
         "against go came right used take three tokenizer gradient allreduce rank world_size "
         "checkpoint").split()
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ve", "'LL",
                "'D", "'M", "''s", "'''", "'", "\u2019s", "\u2019ll", "'x", "'r", "'l", "'v"]
NUMBERS = ["0123456789", "\u0660\u0661\u0662\u0663", "\u0966\u0967\u0968", "\uff11\uff12\uff13",
           "\u00b2\u00b3\u00b9", "\u2160\u2161\u216b", "\u00bd\u00bc", "\u2460\u2461",
           "\U0001d7ce\U0001d7cf", "\u3007\u4e00", "\u0e51\u0e52", "\u1040\u1041"]
SCRIPTS = [
    "caf\u00e9 na\u00efve \u00fcber \u00c5ngstr\u00f6m stra\u00dfe \u0153uvre",
    "cafe\u0301 nai\u0308ve u\u0308ber A\u030angstro\u0308m e\u0301\u0300\u0302",
    "\u03b1\u03bb\u03c6\u03ac\u03b2\u03b7\u03c4\u03bf \u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5",
    "\u043f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440 \u0401\u0436\u0438\u043a",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645 \u064b\u064c\u064d",
    "\u05e9\u05b8\u05c1\u05dc\u05d5\u05b9\u05dd \u05e2\u05d5\u05dc\u05dd \u202b\u05d0\u202c",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e \u0915\u093f",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e0a\u0e32\u0e27\u0e42\u0e25\u0e01",
    "\u4f60\u597d\u4e16\u754c\u3002\u6f22\u5b57\uff0c\u4e2d\u6587\uff01",
    "\u3053\u3093\u306b\u3061\u306f\u4e16\u754c \u30ab\u30bf\u30ab\u30ca\u30fc \uff76\uff80\uff76\uff85",
    "\uc548\ub155\ud558\uc138\uc694 \uc138\uacc4 \u1100\u1161\u11a8",
    "\U0001f600\U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467 "
    "\U0001f1fa\U0001f1f8\U0001f1ef\U0001f1f5 \u2764\ufe0f \u263a\ufe0e",
    "\U00010330\U00010331 \U0001d400\U0001d401 \U00020000\U0002a6d6 \U000e0041",
    "\u1e9b\u0323 \u0130stanbul \u0131 \ufb01\ufb02 \u2126 \u212b \u01c5",
]
SPACES = ["\t", "\n", "\r", "\x0b", "\x0c", " ", "\u00a0", "\u1680", "\u2000", "\u2003",
          "\u2007", "\u200a", "\u2028", "\u2029", "\u202f", "\u205f", "\u3000", "\u0085",
          "\r\n"]
NOT_SPACES = ["\u200b", "\ufeff", "\x1c", "\x1d", "\x1e", "\x1f", "\u180e", "\x00", "\x7f"]
CODE = [
    "for (int i = 0; i < n; i++) {\n\tsum += a[i] * b[i];\n}\n",
    "def f(x, *args, **kw):\n    return {k: v for k, v in kw.items() if v != x}\n",
    "    if (err != CHORUS_OK) goto fail;  // 0x7fffffff >> 3\n",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); }\n",
    "x=a&&b||!c; y-=z<<2; s = \"it's\"; t = 'don''t';\n",
    "<div class=\"a\">&nbsp;&lt;/div&gt;</div>\r\n",
    "SELECT * FROM t WHERE id IN (1,2,3) -- comment\n",
    "    \t  \n\n\n    return;;  \t\n",
]
BAD_UTF8 = [b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\x80", b"\xe0\x9f\xbf", b"\xed\xa0\x80",
            b"\xed\xbf\xbf", b"\xf0\x80\x80\x80", b"\xf0\x8f\xbf\xbf", b"\xf4\x90\x80\x80",
            b"\xf5\x80\x80\x80", b"\xff", b"\xfe", b"\x80", b"\xbf", b"\xc3", b"\xe2\x82",
            b"\xf0\x9f\x98", b"\xe2\x28\xa1", b"\xc3\x28", b"\xf8\x88\x80\x80\x80",
            b"\xed\x9f\xbf", b"\xee\x80\x80", b"\xf4\x8f\xbf\xbf", b"\xc2\xa0\xa0"]


def random_code_point(rnd):
    while True:
        plane = rnd.random()
        if plane < 0.6:
            c = rnd.randrange(0x80, 0x10000)
        elif plane < 0.9:
            c = rnd.randrange(0x10000, 0x30000)
        else:
            c = rnd.randrange(0x30000, 0x110000)
        if not 0xD800 <= c <= 0xDFFF:
            return chr(c)


def chunk(rnd):
    """One random bit of text, as bytes."""
    k = rnd.random()
    if k < 0.30:
        words = []
        for _ in range(rnd.randrange(3, 20)):
            w = rnd.choice(WORDS)
            r = rnd.random()
            if r < 0.1:
                w = w.capitalize()
            elif r < 0.13:
                w = w.upper()
            if rnd.random() < 0.15:
                w += rnd.choice(CONTRACTIONS)
            if rnd.random() < 0.1:
                w += rnd.choice(",.;:!?\"')(")
            words.append(w)
        return (" ".join(words) + rnd.choice([". ", ".\n", "\n\n", "? ", "! "])).encode()
    if k < 0.40:
        return rnd.choice(CODE).encode()
    if k < 0.52:
        return (rnd.choice(SCRIPTS) + rnd.choice([" ", "\n", "", "  ", "\u3000"])).encode()
    if k < 0.58:
        n = rnd.choice(NUMBERS)
        s = "".join(rnd.choice(n) for _ in range(rnd.randrange(1, 12)))
        return (rnd.choice(["", " ", "$", "-", "x"]) + s + rnd.choice([" ", ".5", ",", "%", "\n"])).encode()
    if k < 0.70:
        pool = SPACES if rnd.random() < 0.8 else SPACES + NOT_SPACES
        run = "".join(rnd.choice(pool) for _ in range(rnd.randrange(1, 8)))
        after = rnd.choice(["word", "1", "!", "", "\u00e9", " x", "'s", "\U0001f600"])
        return (run + after).encode()
    if k < 0.80:
        s = "".join(random_code_point(rnd) for _ in range(rnd.randrange(1, 10)))
        return (s + rnd.choice([" ", "", "\n"])).encode("utf-8", "surrogatepass")
    if k < 0.88:
        out = b""
        for _ in range(rnd.randrange(1, 4)):
            out += rnd.choice(BAD_UTF8) + rnd.choice([b"", b"a", b" ", b"1", b"\xc3\xa9", b"  "])
        return out
    if k < 0.93:
        return rnd.choice(CONTRACTIONS).encode() + rnd.choice([b"", b" ", b"s", b"x", b"'"])
    if k < 0.995:
        return "".join(rnd.choice("!@#$%^&*()[]{}<>/\\|~`-_=+.,;:") for _ in
                       range(rnd.randrange(1, 6))).encode() + rnd.choice([b"", b" "])
    # Long runs of one class: past 128 bytes (the merge heap) and longer.
    n = rnd.choice([130, 300, 1000, 4000])
    kind = rnd.randrange(6)
    if kind == 0:
        return b" " * n + rnd.choice([b"x", b"", b"\n"])
    if kind == 1:
        return "".join(rnd.choice(SPACES) for _ in range(n // 2)).encode() + b"y"
    if kind == 2:
        return "".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n)).encode()
    if kind == 3:
        return "".join(rnd.choice("0123456789") for _ in range(n)).encode()
    if kind == 4:
        return "".join(rnd.choice("!@#$%^&*=-+") for _ in range(n)).encode()
    return "".join(rnd.choice("\u4e00\u4e8c\u4e09\u56db\u00e9\u00e8") for _ in range(n // 3)).encode()


def main(argv):
    if len(argv) != 5 or argv[1] not in ("text", "bytes"):
        sys.exit(__doc__)
    size, rnd = int(argv[2]), random.Random(int(argv[3]))
    with open(argv[4], "wb") as f:
        if argv[1] == "bytes":
            f.write(rnd.randbytes(size))
            return
        # Text starts and ends with white space runs on purpose.
        f.write(" \t\u3000\n  ".encode())
        n = 0
        while n < size:
            c = chunk(rnd)
            f.write(c)
            n += len(c)
        f.write(" \u00a0\n\t ".encode())


if __name__ == "__main__":
    main(sys.argv)
