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
run=$1 train=$2 data=$3 text=$4
tmp=$(mktemp -d /tmp/chorus-shared.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
chmod 755 "$tmp"
fails=0
ok() { echo "ok   $1"; }
bad() { echo "FAIL $1"; fails=$((fails + 1)); }
if [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null; then
  stranger() { setpriv --reuid=65534 --regid=65534 --clear-groups "$@"; }
  echo "the stranger is user nobody (uid 65534)"
else
  stranger() { "$@"; }
  echo "note: not root, so the stranger is this user (the links are planted all the same)"
fi
precious() { # the victim's folder the links point at: its 3 files still there?
  [ "$(ls "$tmp/precious" 2>/dev/null | wc -l)" = 3 ]
}
mkdir "$tmp/precious"
for f in a b c; do echo "keep $f" >"$tmp/precious/$f.txt"; done
head -c 60000 "$text" >"$tmp/in.txt"
# A process id nobody has any more: a killed run's.
sleep 0 & dead=$!
wait "$dead"
host=$(hostname | sed 's/[^a-zA-Z0-9.]/_/g')

# 1. chorus-data into a folder like /tmp (everyone may add, sticky bit).
mkdir -m 1777 "$tmp/pub"
stranger ln -s "$tmp/precious" "$tmp/pub/.prepare-mini-$host-$dead"
if "$data" prepare "$tmp/in.txt" -o "$tmp/pub" --name mini --vocab-size 300 \
    --threads 1 >"$tmp/data.log" 2>&1; then ok "chorus-data prepare ran in a sticky folder"
else bad "chorus-data prepare failed"; tail -n 5 "$tmp/data.log"; fi
if precious; then ok "a planted staging link was not followed (the victim's files are there)"
else bad "the planted staging link was followed: $(ls "$tmp/precious" | wc -l) of 3 files left"; fi
grep -q "other users can put files there" "$tmp/data.log" &&
  ok "chorus-data warned that others can put files there" || bad "no warning about the folder"

# 2. chorus-train's checkpoint pruning in such a folder.
mkdir -m 1777 "$tmp/ck"
stranger ln -s "$tmp/precious" "$tmp/ck/ckpt-000000001"
model=(--layers 1 --heads 2 --channels 16 --ctx 16 --steps 10 --warmup 1 --val-every 0
       --sample 0 --log-every 100 --threads 1 --batch 2 --data "$tmp/in.txt")
if "$run" --standalone -n 1 -- "$train" "${model[@]}" --checkpoint-dir "$tmp/ck" \
    --checkpoint-every 5 --keep 1 >"$tmp/train.log" 2>&1; then ok "chorus-train saved in a sticky folder"
else bad "chorus-train failed"; tail -n 5 "$tmp/train.log"; fi
if precious; then ok "a planted checkpoint link was not followed by the pruning"
else bad "the pruning followed a planted link: $(ls "$tmp/precious" | wc -l) of 3 files left"; fi
[ -d "$tmp/ck/ckpt-000000010" ] && ok "the newest checkpoint is there" || bad "no ckpt-000000010"

# 3. A folder everyone may write without the sticky bit: refused by name.
mkdir -m 777 "$tmp/open"
chmod 777 "$tmp/open"
if "$data" prepare "$tmp/in.txt" -o "$tmp/open" --vocab-size 300 --threads 1 \
    >"$tmp/open_data.log" 2>&1; then bad "chorus-data wrote into a folder everyone may change"
elif grep -q "writable by every user and has no sticky bit" "$tmp/open_data.log"; then
  ok "chorus-data refuses a folder everyone may change: $(grep -o 'writable by every user.*' "$tmp/open_data.log" | head -c 90)"
else bad "chorus-data failed otherwise"; tail -n 3 "$tmp/open_data.log"; fi
if "$run" --standalone -n 1 -- "$train" "${model[@]}" --checkpoint-dir "$tmp/open" \
    --checkpoint-every 5 >"$tmp/open_train.log" 2>&1; then
  bad "chorus-train saved into a folder everyone may change"
elif grep -q "writable by every user and has no sticky bit" "$tmp/open_train.log"; then
  ok "chorus-train refuses it too"
else bad "chorus-train failed otherwise"; tail -n 3 "$tmp/open_train.log"; fi
# 4. FIFOs (and sockets) where a file belongs: refused by name, at once
# (before: open() waited forever for a writer).  Each run is bounded.
mkdir -p "$tmp/fifo/tk" "$tmp/fifo/d"
mkfifo "$tmp/fifo/in.txt" "$tmp/fifo/x_train_000001.bin" "$tmp/fifo/tk/encoder.json" "$tmp/fifo/d/p.txt"
printf '#version: 0.2\n' >"$tmp/fifo/tk/vocab.bpe"
echo "some text for the data tool" >"$tmp/fifo/d/a.txt"
refused() { # WHAT LOG PATTERN CMD...: the command ends within 20 s, non-zero, saying PATTERN
  local what=$1 log=$2 pat=$3
  shift 3
  timeout 20 "$@" >"$tmp/$log.log" 2>&1
  local rc=$?
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && grep -q -- "$pat" "$tmp/$log.log"; then ok "$what"
  else bad "$what (exit $rc): $(tail -n 2 "$tmp/$log.log" | tr '\n' ' ')"; fi
}
refused "a FIFO named as an input is refused by name" fifo_in "in.txt: not a regular file" \
  "$data" prepare "$tmp/fifo/in.txt" -o "$tmp/fifo/o1" --vocab-size 300
refused "a FIFO named like a shard is refused by name" fifo_shard \
  "x_train_000001.bin: not a regular file" "$run" --standalone -n 1 -- "$train" \
  --layers 1 --heads 2 --channels 16 --ctx 16 --steps 1 --data "$tmp/fifo/x_train_000001.bin"
refused "a FIFO named encoder.json is refused by name" fifo_tok "encoder.json is not a regular file" \
  "$data" prepare "$tmp/fifo/d/a.txt" -o "$tmp/fifo/o2" --tokenizer "$tmp/fifo/tk"
if timeout 20 "$data" prepare "$tmp/fifo/d" -o "$tmp/fifo/o3" --vocab-size 257 \
    >"$tmp/fifo_dir.log" 2>&1 || true; grep -q "leaving out .*p.txt: not a regular file" "$tmp/fifo_dir.log"; then
  ok "a FIFO in an input folder is left out by name"
else bad "a FIFO in an input folder: $(tail -n 2 "$tmp/fifo_dir.log" | tr '\n' ' ')"; fi

[ "$fails" -eq 0 ] && echo "all shared-folder checks passed" && exit 0
exit 1
