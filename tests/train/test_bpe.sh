#!/usr/bin/env bash
# The tokenizer against the reference (tests/train/bpe_ref.py, Python's
# regex module): the same pre-split pieces and the same tokens, token for
# token, on generated text (many scripts, white space of every kind,
# contractions, numbers, code, long runs, malformed UTF-8) and on random
# bytes, with a vocabulary of 2000 that bpe_tool trains; decoding gives the
# input back; a small training gives the same files as the reference's
# obvious trainer; the committed Unicode table is what the regex module
# says today.  With CHORUS_GPT2_DIR (a folder with GPT-2's encoder.json and
# vocab.bpe) the same comparison runs with GPT-2's own vocabulary.
#   test_bpe.sh BPE_TOOL SOURCE_DIR
# Exit 77 (skipped) without /usr/bin/python3 and its regex module.
set -u
tool=$1 src=$2
py=/usr/bin/python3
ref=$src/tests/train/bpe_ref.py
gen=$src/tests/train/gen_bpe_corpus.py
if ! $py -c 'import regex' 2>/dev/null; then
  echo "SKIPPED: /usr/bin/python3 with the regex module (Debian: python3-regex) is needed for the reference"
  exit 77
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/test_bpe.XXXXXX")
trap 'rm -rf "$work"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
ok() { echo "ok   $*"; }

# 1. The class table is what the installed regex module says.
if $py "$src/tools/gen_bpe_unicode.py" > "$work/bpe_unicode.h" &&
   cmp -s "$work/bpe_unicode.h" "$src/src/train/bpe_unicode.h"; then
  ok "src/train/bpe_unicode.h matches regex $($py -c 'import importlib.metadata as m; print(m.version("regex"))' 2>/dev/null)"
else
  fail "src/train/bpe_unicode.h differs from what tools/gen_bpe_unicode.py writes with this regex module; regenerate it"
fi

# 2. Inputs: seen text (trained on), unseen text, random bytes, long runs.
$py "$gen" text 500000 1 "$work/seen.txt"
$py "$gen" text 200000 7 "$work/unseen.txt"
$py "$gen" bytes 200000 3 "$work/random.bin"
$py - "$work/long.txt" "$work/mixed.bin" <<'EOF'
import random, sys
r = random.Random(5)
parts = [b" " * 20000 + b"x", "\u3000 \t".encode() * 3000 + b"\n",
         "".join(r.choice("!@#$%^&*=-+") for _ in range(5000)).encode(),
         "".join(r.choice("abcdefgh") for _ in range(5000)).encode(),
         b"9" * 5000, b"'s" * 2000, bytes(range(256)) * 8]
open(sys.argv[1], "wb").write(b"".join(parts))
# Short pieces that repeat but seldom merge (the cache's many-token entries).
alpha = [b"\xff", b"\x80", b"a", b" ", b"1", b"\xc3\xa9", b"!", b"\xe4\xb8", b"\t", b"'s"]
open(sys.argv[2], "wb").write(b"".join(r.choice(alpha) for _ in range(60000)))
EOF
inputs="seen.txt unseen.txt random.bin long.txt mixed.bin"

# 3. Pre-split pieces.
for f in $inputs; do
  "$tool" pieces "$work/$f" "$work/$f.pc" && $py "$ref" pieces "$work/$f" "$work/$f.pp" ||
    { fail "pieces of $f: a tool failed"; continue; }
  if cmp -s "$work/$f.pc" "$work/$f.pp"; then
    ok "pieces of $f ($(($(stat -c %s "$work/$f.pc") / 4)) pieces)"
  else
    fail "pieces of $f differ from the regex module's: $(cmp "$work/$f.pc" "$work/$f.pp" 2>&1)"
  fi
done

# 4. Tokens with a trained vocabulary, and decoding.
compare_tokens() { # VOCABDIR NAME
  local v=$1 name=$2 f
  for f in $inputs; do
    "$tool" encode "$v" "$work/$f" "$work/$f.tc" && $py "$ref" encode "$v" "$work/$f" "$work/$f.tp" ||
      { fail "$name tokens of $f: a tool failed"; continue; }
    if cmp -s "$work/$f.tc" "$work/$f.tp"; then
      ok "$name tokens of $f ($(($(stat -c %s "$work/$f.tc") / 4)) tokens)"
    else
      fail "$name tokens of $f differ from the reference's: $(cmp "$work/$f.tc" "$work/$f.tp" 2>&1) (byte offset / 4 = token index)"
    fi
    "$tool" decode "$v" "$work/$f.tc" "$work/$f.dec" && cmp -s "$work/$f.dec" "$work/$f" ||
      fail "$name: decoding the tokens of $f does not give $f back"
  done
}
if "$tool" train 2000 "$work/v2000" "$work/seen.txt" > "$work/train.log"; then
  ok "trained 2000 ids: $(cat "$work/train.log")"
  compare_tokens "$work/v2000" "vocab 2000"
else
  fail "bpe_tool train 2000"
fi

# 5. Training: the same merges and files as the reference's obvious trainer.
head -c 20000 "$work/seen.txt" > "$work/small.txt"
head -c 4000 "$work/random.bin" >> "$work/small.txt"
if "$tool" train 400 "$work/vc" "$work/small.txt" > /dev/null &&
   $py "$ref" train 400 "$work/vp" "$work/small.txt"; then
  if cmp -s "$work/vc/vocab.bpe" "$work/vp/vocab.bpe" &&
     cmp -s "$work/vc/encoder.json" "$work/vp/encoder.json"; then
    ok "training 400 ids: vocab.bpe and encoder.json equal the reference's"
  else
    fail "training 400 ids: files differ from the reference's ($(diff "$work/vc/vocab.bpe" "$work/vp/vocab.bpe" | head -3 | tr '\n' ' '))"
  fi
else
  fail "training 400 ids: a tool failed"
fi

# 6. GPT-2's own files, where given.
if [[ -n "${CHORUS_GPT2_DIR:-}" ]]; then
  compare_tokens "$CHORUS_GPT2_DIR" "GPT-2"
else
  echo "skip GPT-2's own vocabulary: set CHORUS_GPT2_DIR to a folder with its encoder.json and vocab.bpe"
fi

if ((fails)); then
  echo "$fails check(s) failed"
  exit 1
fi
echo "all checks passed"
