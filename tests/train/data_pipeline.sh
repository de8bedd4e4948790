#!/usr/bin/env bash
# Data from text to training: chorus-data prepare learns a BPE vocabulary
# and writes llm.c shards (the same bytes with 1 and 2 threads; llm.c's
# header as llm.c reads it); bad input is refused naming the file and the
# offset or line; a shard written the way llm.c's scripts write them
# trains; and the loader's position resumes exactly: a 2-rank run SIGKILLed
# mid-epoch and resumed on 3 ranks sees every sequence of the epoch once
# (none skipped, none twice), resumed on 2 it ends with the uninterrupted
# run's weights, bit for bit, with or without prefetch workers.
#   data_pipeline.sh CHORUSRUN CHORUS_TRAIN CHORUS_DATA CMP_WEIGHTS TEXT BPE_TOOL
set -u
. "$(dirname "$0")/../lib.sh"
run=$1 train=$2 data=$3 cmp=$4 text=$5 bpe=$6
tmp_dir data
py=/usr/bin/python3

# --- prepare: a vocabulary of 512 on 300 KB of the text, small shards.
head -c 300000 "$text" >"$TMP/in.txt"
printf '{"text": "First document\\nwith two lines."}\n{"text": "Second: caf\\u00e9 \\u65e5\\u672c"}\n' \
  >"$TMP/in.jsonl"
prep() { # OUT THREADS
  "$data" prepare "$TMP/in.txt" "$TMP/in.jsonl" -o "$TMP/$1" --vocab-size 512 \
    --shard-tokens 40000 --threads "$2" >"$TMP/$1.log" 2>&1
}
if prep d1 1 && prep d2 2; then ok "prepare ran with 1 and 2 threads"
else fail "prepare failed"; tail -n 5 "$TMP"/d*.log; fi
if diff -r "$TMP/d1" "$TMP/d2" >/dev/null; then ok "the shards and the vocabulary do not depend on the threads"
else fail "1 and 2 threads made different files"; fi
ls "$TMP/d1" >"$TMP/d1.ls"
if grep -qx data_val_000000.bin "$TMP/d1.ls" && grep -qx data_train_000001.bin "$TMP/d1.ls" &&
   grep -qx data_train_000002.bin "$TMP/d1.ls" && grep -qx encoder.json "$TMP/d1.ls" &&
   grep -qx vocab.bpe "$TMP/d1.ls" && ! grep -q tmp "$TMP/d1.ls"; then
  ok "llm.c's names (val shard 0, train 1..), the tokenizer beside them, no temporaries"
else fail "unexpected files: $(tr '\n' ' ' <"$TMP/d1.ls")"; fi
grep -q "prepared .*tokens.*vocabulary 512 (trained here)" "$TMP/d1.log" &&
  ok "the summary names tokens, shards and vocabulary" || fail "no summary line"
# llm.c's own reading of a header (dev/data/data_common.py, train_gpt2.c).
if $py - "$TMP/d1" <<'EOF'
import sys, os, glob, numpy as np
total = 0
for f in sorted(glob.glob(sys.argv[1] + "/data_*.bin")):
    h = np.fromfile(f, dtype=np.int32, count=256)
    assert h[0] == 20240520, (f, "magic", h[0])
    assert h[1] == 1, (f, "version", h[1])
    ntok = int(h[2])
    assert os.path.getsize(f) == 256 * 4 + 2 * ntok, (f, "size")
    with open(f, "rb") as fh:
        fh.seek(256 * 4)
        toks = np.frombuffer(fh.read(), dtype=np.uint16)
    assert len(toks) == ntok and toks.max() < 512, (f, "tokens")
    if "_val_" in f:
        assert toks[0] == 511, (f, "a document starts with <|endoftext|>", toks[0])
    total += ntok
print("llm.c header check: %d tokens" % total)
EOF
then ok "llm.c's header check reads every shard"; else fail "a shard fails llm.c's header check"; fi
"$data" check "$TMP/d1" --tokenizer "$TMP/d1" >"$TMP/check.log" 2>&1 &&
  grep -q "train: 4 shard(s), [0-9]* tokens, every one below 512" "$TMP/check.log" &&
  ok "chorus-data check passes them" ||
  { fail "chorus-data check"; cat "$TMP/check.log"; }

# --- cut anywhere: CRLF lines, one long line and Chinese text are cut into
# units of 256 KiB like any text, and the tokens are those of the whole file.
tr '\n' ' ' <"$TMP/in.txt" >"$TMP/oneline.txt"
sed 's/$/\r/' "$TMP/in.txt" >"$TMP/crlf.txt"
$py -c '
import random, sys
r = random.Random(7)
lines = ["".join(chr(r.randrange(0x4e00, 0x9fa5)) for _ in range(r.randrange(5, 40))) + "\u3002"
         for _ in range(4000)]
sys.stdout.write("\n".join(lines) + "\n")' >"$TMP/cjk.txt" # no ASCII but the newlines
for f in crlf oneline cjk; do
  if "$data" prepare "$TMP/$f.txt" -o "$TMP/cut-$f" --tokenizer "$TMP/d1" --val-fraction 0.05 \
      >"$TMP/cut-$f.log" 2>&1 && grep -q "1 file(s), 0.3 MB, 3 unit(s)" "$TMP/cut-$f.log" &&
     "$bpe" encode "$TMP/d1" "$TMP/$f.txt" "$TMP/$f.whole" &&
     $py - "$TMP/cut-$f" "$TMP/$f.whole" <<'EOF'
import sys, glob, numpy as np
files = sorted(glob.glob(sys.argv[1] + "/data_val_*.bin")) + sorted(glob.glob(sys.argv[1] + "/data_train_*.bin"))
assert len(files) >= 2, files
toks = np.concatenate([np.fromfile(f, dtype=np.uint16, offset=1024) for f in files]).astype(np.uint32)
whole = np.fromfile(sys.argv[2], dtype=np.uint32)
assert toks[0] == 511 and np.array_equal(toks[1:], whole), (len(toks), len(whole))
EOF
  then ok "$f text: 3 units (validation, 256 KiB, the rest), the tokens of the whole file"
  else fail "$f text: $(tail -n 2 "$TMP/cut-$f.log")"; fi
done

# --- a prepare that fails leaves nothing that looks like a dataset; one
# that succeeds replaces an earlier run's shards; the output folder inside
# an input folder is not read as input.
printf '{"text": "ok"}\n{"text": 5}\n' >"$TMP/late.jsonl"
mkdir -p "$TMP/failed"
if "$data" prepare "$TMP/in.txt" "$TMP/late.jsonl" -o "$TMP/failed" --tokenizer "$TMP/d1" \
    --shard-tokens 10000 --threads 1 >"$TMP/failed.log" 2>&1; then
  fail "a prepare with a bad last line succeeded"
elif [ -z "$(ls -A "$TMP/failed")" ]; then
  ok "a prepare that fails after writing shards leaves the folder empty"
else fail "a failed prepare left: $(ls -A "$TMP/failed" | tr '\n' ' ')"; fi
"$data" prepare "$TMP/in.txt" -o "$TMP/again" --tokenizer "$TMP/d1" --shard-tokens 20000 \
  >/dev/null 2>&1
first=$(ls "$TMP/again" | grep -c '_.*\.bin$')
# Another dataset whose name starts like this one's stays.
cp "$TMP/d1/data_train_000001.bin" "$TMP/again/data_val_train_000001.bin"
"$data" prepare "$TMP/in.txt" -o "$TMP/again" --tokenizer "$TMP/d1" --shard-tokens 40000 \
  >"$TMP/again.log" 2>&1
"$data" prepare "$TMP/in.txt" -o "$TMP/fresh" --tokenizer "$TMP/d1" --shard-tokens 40000 \
  >/dev/null 2>&1
if diff -r -x data_val_train_000001.bin "$TMP/again" "$TMP/fresh" >/dev/null &&
   cmp -s "$TMP/d1/data_train_000001.bin" "$TMP/again/data_val_train_000001.bin" &&
   grep -q "replaced $first shard(s) named data_\* of an earlier run" "$TMP/again.log"; then
  ok "a second prepare replaces the first one's $first shards (the folder is a fresh one's), not data_val_train_*"
else fail "after two prepares: $(ls -A "$TMP/again" | tr '\n' ' ') $(grep replaced "$TMP/again.log")"; fi
mkdir -p "$TMP/corpus" && cp "$TMP/in.txt" "$TMP/corpus/"
"$data" prepare "$TMP/corpus" -o "$TMP/corpus/out" --tokenizer "$TMP/d1" >/dev/null 2>&1
if "$data" prepare "$TMP/corpus" -o "$TMP/corpus/out" --tokenizer "$TMP/d1" \
    >"$TMP/inside.log" 2>&1 && grep -q "leaving out .*corpus/out: it is the output folder" \
    "$TMP/inside.log" && grep -q "in 1 file(s)" "$TMP/inside.log"; then
  ok "the output folder inside the input folder is left out"
else fail "output inside input: $(tail -n 2 "$TMP/inside.log")"; fi

# --- bad input, each named with where.
refused() { # WHAT PATTERN ARGS...
  local what=$1 pat=$2
  shift 2
  if "$data" "$@" >"$TMP/r.log" 2>&1; then fail "$what: accepted"
  elif grep -q -- "$pat" "$TMP/r.log"; then ok "$what: $(grep -m1 -- "$pat" "$TMP/r.log" | cut -c1-150)"
  else fail "$what: message lacks '$pat': $(tail -n 1 "$TMP/r.log")"; fi
}
printf 'good text\nand then \xc3\x28 bad\n' >"$TMP/badutf.txt"
refused "invalid UTF-8" "badutf.txt: invalid UTF-8 at byte offset 19" prepare "$TMP/badutf.txt" \
  -o "$TMP/x" --tokenizer "$TMP/d1"
: >"$TMP/empty.txt"
refused "an empty file" "empty.txt: an empty file" prepare "$TMP/empty.txt" -o "$TMP/x" \
  --tokenizer "$TMP/d1"
printf '{"text": "ok"}\n{"text": 5}\n' >"$TMP/bad.jsonl"
refused "a JSON line without text" 'bad.jsonl: line 2: no string field "text"' prepare \
  "$TMP/bad.jsonl" -o "$TMP/x" --tokenizer "$TMP/d1"
if "$data" prepare "$TMP/badutf.txt" "$TMP/empty.txt" "$TMP/in.txt" -o "$TMP/skip" \
    --tokenizer "$TMP/d1" --skip-invalid >"$TMP/skip.log" 2>&1 &&
   grep -q "skipped .*badutf.txt" "$TMP/skip.log" && grep -q "skipped .*empty.txt: an empty file" "$TMP/skip.log"
then ok "--skip-invalid leaves them out, naming each"
else fail "--skip-invalid"; tail -n 3 "$TMP/skip.log"; fi
cp "$TMP/d1/data_train_000001.bin" "$TMP/cut_train_000001.bin"
truncate -s 5000 "$TMP/cut_train_000001.bin"
refused "a truncated shard" "cut_train_000001.bin: the header (offset 8) says" check \
  "$TMP/cut_train_000001.bin"
printf 'XXXX' | dd of="$TMP/cut_train_000001.bin" conv=notrunc 2>/dev/null
refused "a shard with the wrong magic" "magic 1482184792 at offset 0" check "$TMP/cut_train_000001.bin"
refused "a token outside the vocabulary" "token .* at byte offset .* outside the vocabulary of 100" \
  check "$TMP/d1" --vocab 100
# check without flags takes the tokenizer prepare left beside the shards
# (512 tokens), not GPT-2's 50257: token 1000 in a shard is refused.
mkdir -p "$TMP/wide" && cp "$TMP"/d1/* "$TMP/wide/"
printf '\xe8\x03' | dd of="$TMP/wide/data_train_000001.bin" bs=1 seek=1100 conv=notrunc 2>/dev/null
refused "chorus-data check DIR uses DIR's tokenizer" \
  "token 1000 at byte offset .* outside the vocabulary of 512" check "$TMP/wide"
mkdir -p "$TMP/notok" && cp "$TMP"/d1/data_*.bin "$TMP/notok/"
if "$train" --data "$TMP/notok" --vocab 100 --steps 1 --sample 0 --val-every 0 --layers 1 \
    --channels 16 --heads 1 --ctx 16 --threads 1 >"$TMP/t.log" 2>&1; then
  fail "chorus-train took tokens outside its vocabulary"
elif grep -q "outside the vocabulary of 100" "$TMP/t.log"; then
  ok "chorus-train stops on a token outside the vocabulary, naming file and offset"
else fail "chorus-train's message: $(tail -n 1 "$TMP/t.log")"; fi

# --- shards written as llm.c's scripts write them (write_datafile), named
# as its one-shard datasets are (tiny_shakespeare_train.bin / _val.bin):
# exactly 240 sequences of 32 tokens (+1), from the prepared tokens, and a
# validation file of 100 tokens.
mkdir -p "$TMP/llmc"
$py - "$TMP/d1" "$TMP/llmc/x_train.bin" "$TMP/llmc/x_val.bin" <<'EOF'
import sys, numpy as np
src = np.fromfile(sys.argv[1] + "/data_train_000001.bin", dtype=np.uint16, offset=1024)
for path, toks in ((sys.argv[2], src[: 240 * 32 + 1]), (sys.argv[3], src[-100:])):
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = 20240520, 1, len(toks)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(toks.astype(np.uint16).tobytes())
EOF
cp "$TMP/d1/encoder.json" "$TMP/d1/vocab.bpe" "$TMP/llmc/"
model=(--data "$TMP/llmc" --layers 2 --heads 2 --channels 32 --ctx 32 --batch 4 --warmup 3
       --val-every 0 --sample 0 --log-every 100 --threads 1)
train_run() { # LOG RANKS ARGS...
  local log=$1 n=$2
  shift 2
  "$run" --standalone -n "$n" -- "$train" "${model[@]}" "$@" >"$TMP/$log.log" 2>&1
}
# 240 sequences: an epoch is 30 steps of 2 x 4, or 20 of 3 x 4.
if train_run straight 2 --steps 30 --dump "$TMP/straight" --log-data "$TMP/straight.idx"; then
  ok "a shard in llm.c's format trains"
else fail "training on llm.c's shard failed"; tail -n 5 "$TMP/straight.log"; fi
grep -q "vocabulary 512" "$TMP/straight.log" && ok "the vocabulary comes from the data's tokenizer" ||
  fail "vocabulary not taken from encoder.json"
grep -q "data: $TMP/llmc: 7681 tokens in 1 file(s); validation 100 tokens" "$TMP/straight.log" &&
  ok "llm.c's NAME_train.bin and NAME_val.bin found in the directory" ||
  fail "the directory's one-shard train and val files: $(grep -m1 '^data:' "$TMP/straight.log")"
# Every sequence once in the uninterrupted epoch.
cat "$TMP"/straight.idx.rank* | cut -d: -f2 | tr ' ' '\n' | grep . | sort -n >"$TMP/epoch.ref"
if [ "$(wc -l <"$TMP/epoch.ref")" = 240 ] && [ "$(uniq "$TMP/epoch.ref" | wc -l)" = 240 ]; then
  ok "the uninterrupted epoch sees all 240 sequences once"
else fail "the uninterrupted epoch: $(wc -l <"$TMP/epoch.ref") sequences"; fi
# Killed at step 8 (checkpoint at 6: 48 sequences taken; 192 = 16 steps of 3 x 4 left).
train_run killed 2 --steps 30 --checkpoint-dir "$TMP/ck" --checkpoint-every 6 --kill-at 8 \
  --log-data "$TMP/killed.idx" --workers 2 --data-prefetch 3
grep -q "kills itself at step 8" "$TMP/killed.log" && ok "rank 1 was SIGKILLed at step 8" ||
  fail "the kill did not happen"
cp -r "$TMP/ck" "$TMP/ck2"
cp -r "$TMP/ck" "$TMP/ck3"
if train_run three 3 --steps 22 --checkpoint-dir "$TMP/ck" --log-data "$TMP/three.idx" &&
   grep -q "resumed from .*ckpt-000000006" "$TMP/three.log"; then
  ok "resumed on 3 ranks from step 6"
else fail "the 3-rank resume"; tail -n 5 "$TMP/three.log"; fi
{ cat "$TMP"/killed.idx.rank* | awk -F: '$1 < 6'; cat "$TMP"/three.idx.rank*; } |
  cut -d: -f2 | tr ' ' '\n' | grep . | sort -n >"$TMP/epoch.res"
if cmp -s "$TMP/epoch.ref" "$TMP/epoch.res"; then
  ok "2 ranks then 3: the epoch's sequences are exactly the uninterrupted run's (none twice, none skipped)"
else fail "the resumed epoch differs: $(comm -3 "$TMP/epoch.ref" "$TMP/epoch.res" | wc -l) sequences"; fi
if train_run two 2 --steps 30 --checkpoint-dir "$TMP/ck2" --dump "$TMP/resumed" --workers 0 &&
   "$cmp" "$TMP/straight" "$TMP/resumed" 0; then
  ok "resumed on 2 ranks (no workers; the killed run had 2 x 3 ahead): bit-identical weights"
else fail "the 2-rank resume differs from the uninterrupted run"; fi
# A position in another order (here another seed) is not taken as is.
if train_run reseeded 2 --steps 8 --checkpoint-dir "$TMP/ck3" --seed 9 &&
   grep -q "its data position is in another order (240 sequences, seed 1337; this run: 240, seed 9): epoch 0 starts over" "$TMP/reseeded.log"; then
  ok "resumed with another seed: the epoch starts over, saying why"
else fail "resume with another seed: $(grep -m1 'checkpoint of step\|resumed' "$TMP/reseeded.log")"; fi
# 12 MB of letters and no white space: cut at the pieces' own boundaries
# (it was one unit: all of it validation, and 17 bytes of memory per byte
# in one piece), so memory stays near the input's size and there is a
# training part.
$py -c "import random; random.seed(5); open('$TMP/nows.txt','w').write(''.join(random.choice('abcdefgh') for _ in range(12 << 20)))"
peak=$($py -c 'import resource, subprocess, sys
rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024 if rc == 0 else -1)' \
  "$data" prepare "$TMP/nows.txt" -o "$TMP/nows" --tokenizer "$TMP/d1" --threads 2)
if [ "$peak" -gt 0 ] && [ "$peak" -lt 60 ] && ls "$TMP/nows" | grep -q '_train_'; then
  ok "12 MB without white space: peak $peak MB, a training part (was: one unit, about 210 MB)"
else fail "12 MB without white space: peak $peak MB; $(ls "$TMP/nows" 2>&1 | tr '\n' ' ')"; fi
summary "all data checks passed" "data check(s) failed"
