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
. "$(dirname "$0")/../lib.sh"
tool=$1 src=$2
py=/usr/bin/python3
ref=$src/tests/train/bpe_ref.py
gen=$src/tests/train/gen_bpe_corpus.py
if ! $py -c 'import regex' 2>/dev/null; then
  echo "SKIPPED: /usr/bin/python3 with the regex module (Debian: python3-regex) is needed for the reference"
  exit 77
fi
tmp_dir bpe

# 1. The class table is what the installed regex module says.
if $py "$src/tools/gen_bpe_unicode.py" > "$TMP/bpe_unicode.h" &&
   cmp -s "$TMP/bpe_unicode.h" "$src/src/train/bpe_unicode.h"; then
  ok "src/train/bpe_unicode.h matches regex $($py -c 'import importlib.metadata as m; print(m.version("regex"))' 2>/dev/null)"
else
  fail "src/train/bpe_unicode.h differs from what tools/gen_bpe_unicode.py writes with this regex module; regenerate it"
fi

# 2. Inputs: seen text (trained on), unseen text, random bytes, long runs.
$py "$gen" text 500000 1 "$TMP/seen.txt"
$py "$gen" text 200000 7 "$TMP/unseen.txt"
$py "$gen" bytes 200000 3 "$TMP/random.bin"
$py - "$TMP/long.txt" "$TMP/mixed.bin" <<'EOF'
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
  "$tool" pieces "$TMP/$f" "$TMP/$f.pc" && $py "$ref" pieces "$TMP/$f" "$TMP/$f.pp" ||
    { fail "pieces of $f: a tool failed"; continue; }
  if cmp -s "$TMP/$f.pc" "$TMP/$f.pp"; then
    ok "pieces of $f ($(($(stat -c %s "$TMP/$f.pc") / 4)) pieces)"
  else
    fail "pieces of $f differ from the regex module's: $(cmp "$TMP/$f.pc" "$TMP/$f.pp" 2>&1)"
  fi
done

# 4. Tokens with a trained vocabulary, and decoding.
compare_tokens() { # VOCABDIR NAME
  local v=$1 name=$2 f
  for f in $inputs; do
    "$tool" encode "$v" "$TMP/$f" "$TMP/$f.tc" && $py "$ref" encode "$v" "$TMP/$f" "$TMP/$f.tp" ||
      { fail "$name tokens of $f: a tool failed"; continue; }
    if cmp -s "$TMP/$f.tc" "$TMP/$f.tp"; then
      ok "$name tokens of $f ($(($(stat -c %s "$TMP/$f.tc") / 4)) tokens)"
    else
      fail "$name tokens of $f differ from the reference's: $(cmp "$TMP/$f.tc" "$TMP/$f.tp" 2>&1) (byte offset / 4 = token index)"
    fi
    "$tool" decode "$v" "$TMP/$f.tc" "$TMP/$f.dec" && cmp -s "$TMP/$f.dec" "$TMP/$f" ||
      fail "$name: decoding the tokens of $f does not give $f back"
  done
}
if "$tool" train 2000 "$TMP/v2000" "$TMP/seen.txt" > "$TMP/train.log"; then
  ok "trained 2000 ids: $(cat "$TMP/train.log")"
  compare_tokens "$TMP/v2000" "vocab 2000"
else
  fail "bpe_tool train 2000"
fi

# 5. Training: the same merges and files as the reference's obvious trainer.
head -c 20000 "$TMP/seen.txt" > "$TMP/small.txt"
head -c 4000 "$TMP/random.bin" >> "$TMP/small.txt"
if "$tool" train 400 "$TMP/vc" "$TMP/small.txt" > /dev/null &&
   $py "$ref" train 400 "$TMP/vp" "$TMP/small.txt"; then
  if cmp -s "$TMP/vc/vocab.bpe" "$TMP/vp/vocab.bpe" &&
     cmp -s "$TMP/vc/encoder.json" "$TMP/vp/encoder.json"; then
    ok "training 400 ids: vocab.bpe and encoder.json equal the reference's"
  else
    fail "training 400 ids: files differ from the reference's ($(diff "$TMP/vc/vocab.bpe" "$TMP/vp/vocab.bpe" | head -3 | tr '\n' ' '))"
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

summary "all checks passed" "check(s) failed"
