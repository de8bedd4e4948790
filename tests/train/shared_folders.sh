#!/usr/bin/env bash
# Folders that another local user can write (issue 42, item 2): that user
# plants links named like what chorus-data and chorus-train remove -- a
# staging folder of a killed run (.prepare-NAME-HOST-PID), an old
# checkpoint (ckpt-N) -- pointing at a folder of the victim's.  Before, the
# clean-up followed them and deleted every file of that folder; now nothing
# is removed through a link, and a folder everyone may write without the
# sticky bit is refused by name.  The stranger is user nobody (setpriv)
# when the test runs as root; otherwise this user plays it, with a note.
# And a FIFO named like an input, a shard or encoder.json is refused by
# name at once (it hung chorus-data and chorus-train in open()).
#   shared_folders.sh CHORUSRUN CHORUS_TRAIN CHORUS_DATA TEXT
set -u
. "$(dirname "$0")/../lib.sh"
run=$1 train=$2 data=$3 text=$4
tmp_dir shared
chmod 755 "$TMP"
if [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null; then
  stranger() { setpriv --reuid=65534 --regid=65534 --clear-groups "$@"; }
  echo "the stranger is user nobody (uid 65534)"
else
  stranger() { "$@"; }
  echo "note: not root, so the stranger is this user (the links are planted all the same)"
fi
precious() { # the victim's folder the links point at: its 3 files still there?
  [ "$(ls "$TMP/precious" 2>/dev/null | wc -l)" = 3 ]
}
mkdir "$TMP/precious"
for f in a b c; do echo "keep $f" >"$TMP/precious/$f.txt"; done
head -c 60000 "$text" >"$TMP/in.txt"
# A process id nobody has any more: a killed run's.
sleep 0 & dead=$!
wait "$dead"
host=$(hostname | sed 's/[^a-zA-Z0-9.]/_/g')

# 1. chorus-data into a folder like /tmp (everyone may add, sticky bit).
mkdir -m 1777 "$TMP/pub"
stranger ln -s "$TMP/precious" "$TMP/pub/.prepare-mini-$host-$dead"
if "$data" prepare "$TMP/in.txt" -o "$TMP/pub" --name mini --vocab-size 300 \
    --threads 1 >"$TMP/data.log" 2>&1; then ok "chorus-data prepare ran in a sticky folder"
else fail "chorus-data prepare failed"; tail -n 5 "$TMP/data.log"; fi
if precious; then ok "a planted staging link was not followed (the victim's files are there)"
else fail "the planted staging link was followed: $(ls "$TMP/precious" | wc -l) of 3 files left"; fi
grep -q "other users can put files there" "$TMP/data.log" &&
  ok "chorus-data warned that others can put files there" || fail "no warning about the folder"

# 2. chorus-train's checkpoint pruning in such a folder.
mkdir -m 1777 "$TMP/ck"
stranger ln -s "$TMP/precious" "$TMP/ck/ckpt-000000001"
model=(--layers 1 --heads 2 --channels 16 --ctx 16 --steps 10 --warmup 1 --val-every 0
       --sample 0 --log-every 100 --threads 1 --batch 2 --data "$TMP/in.txt")
if "$run" --standalone -n 1 -- "$train" "${model[@]}" --checkpoint-dir "$TMP/ck" \
    --checkpoint-every 5 --keep 1 >"$TMP/train.log" 2>&1; then ok "chorus-train saved in a sticky folder"
else fail "chorus-train failed"; tail -n 5 "$TMP/train.log"; fi
if precious; then ok "a planted checkpoint link was not followed by the pruning"
else fail "the pruning followed a planted link: $(ls "$TMP/precious" | wc -l) of 3 files left"; fi
[ -d "$TMP/ck/ckpt-000000010" ] && ok "the newest checkpoint is there" || fail "no ckpt-000000010"

# 3. A folder everyone may write without the sticky bit: refused by name.
mkdir -m 777 "$TMP/open"
chmod 777 "$TMP/open"
if "$data" prepare "$TMP/in.txt" -o "$TMP/open" --vocab-size 300 --threads 1 \
    >"$TMP/open_data.log" 2>&1; then fail "chorus-data wrote into a folder everyone may change"
elif grep -q "writable by every user and has no sticky bit" "$TMP/open_data.log"; then
  ok "chorus-data refuses a folder everyone may change: $(grep -o 'writable by every user.*' "$TMP/open_data.log" | head -c 90)"
else fail "chorus-data failed otherwise"; tail -n 3 "$TMP/open_data.log"; fi
if "$run" --standalone -n 1 -- "$train" "${model[@]}" --checkpoint-dir "$TMP/open" \
    --checkpoint-every 5 >"$TMP/open_train.log" 2>&1; then
  fail "chorus-train saved into a folder everyone may change"
elif grep -q "writable by every user and has no sticky bit" "$TMP/open_train.log"; then
  ok "chorus-train refuses it too"
else fail "chorus-train failed otherwise"; tail -n 3 "$TMP/open_train.log"; fi
# 4. FIFOs (and sockets) where a file belongs: refused by name, at once
# (before: open() waited forever for a writer).  Each run is bounded.
mkdir -p "$TMP/fifo/tk" "$TMP/fifo/d"
mkfifo "$TMP/fifo/in.txt" "$TMP/fifo/x_train_000001.bin" "$TMP/fifo/tk/encoder.json" "$TMP/fifo/d/p.txt"
printf '#version: 0.2\n' >"$TMP/fifo/tk/vocab.bpe"
echo "some text for the data tool" >"$TMP/fifo/d/a.txt"
refused() { # WHAT LOG PATTERN CMD...: the command ends within 20 s, non-zero, saying PATTERN
  local what=$1 log=$2 pat=$3
  shift 3
  timeout 20 "$@" >"$TMP/$log.log" 2>&1
  local rc=$?
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && grep -q -- "$pat" "$TMP/$log.log"; then ok "$what"
  else fail "$what (exit $rc): $(tail -n 2 "$TMP/$log.log" | tr '\n' ' ')"; fi
}
refused "a FIFO named as an input is refused by name" fifo_in "in.txt: not a regular file" \
  "$data" prepare "$TMP/fifo/in.txt" -o "$TMP/fifo/o1" --vocab-size 300
refused "a FIFO named like a shard is refused by name" fifo_shard \
  "x_train_000001.bin: not a regular file" "$run" --standalone -n 1 -- "$train" \
  --layers 1 --heads 2 --channels 16 --ctx 16 --steps 1 --data "$TMP/fifo/x_train_000001.bin"
refused "a FIFO named encoder.json is refused by name" fifo_tok "encoder.json is not a regular file" \
  "$data" prepare "$TMP/fifo/d/a.txt" -o "$TMP/fifo/o2" --tokenizer "$TMP/fifo/tk"
if timeout 20 "$data" prepare "$TMP/fifo/d" -o "$TMP/fifo/o3" --vocab-size 257 \
    >"$TMP/fifo_dir.log" 2>&1 || true; grep -q "leaving out .*p.txt: not a regular file" "$TMP/fifo_dir.log"; then
  ok "a FIFO in an input folder is left out by name"
else fail "a FIFO in an input folder: $(tail -n 2 "$TMP/fifo_dir.log" | tr '\n' ' ')"; fi

summary "all shared-folder checks passed"
