#!/usr/bin/env bash
# The tokenizer at scale against the reference, and its speed: builds
# ~63 MB of varied text and 10 MB of random bytes (make_corpus.py), trains
# a vocabulary of VOCAB ids on 10 MB of it (3 times), checks that the C
# tokenizer and tests/train/bpe_ref.py give identical tokens on all of it,
# and measures encoding speed on one core: C on every input, C and the
# reference on the same 5 MB subset (the reference is too slow for all of
# it in a benchmark).  Medians of RUNS runs.  Not part of the test suite.
#   bench/bpe/compare.sh [BUILD_DIR [WORK_DIR]]
#   env: VOCAB (8192), VOCAB_BIG (32768: trained once on all the text),
#        RUNS (3), REF_CHECK (1: run the reference over all
#        inputs for the identity check; 0: skip that part, ~2 min),
#        GPT2_DIR (a folder with GPT-2's own encoder.json and vocab.bpe,
#        which no Debian package ships: also the identity and speed with
#        GPT-2's 50257 tokens), GPT2_ENCODER_PY (OpenAI's encoder.py from
#        the gpt-2 repository: with GPT2_DIR, the identity against it too,
#        through bench/bpe/openai_ref.py, and its speed)
# Writes bench/results/bpe.md (and .log).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../.." && pwd)
build=${1:-$src/build}
work=${2:-/tmp/chorus_bpe_bench}
vocab=${VOCAB:-8192} runs=${RUNS:-3} ref_check=${REF_CHECK:-1}
tool=$build/tests/bpe_tool
py=/usr/bin/python3
ref=$src/tests/train/bpe_ref.py
out=$src/bench/results/bpe.md
log=$out.log
export OPENBLAS_NUM_THREADS=1 # libchorus-train links OpenBLAS; its threads must not spin beside us
[[ -x $tool ]] || { echo "no $tool: build first (cmake --build $build)"; exit 1; }
$py -c 'import regex' || { echo "needs /usr/bin/python3 with regex (python3-regex)"; exit 1; }
mkdir -p "$work" "$(dirname "$out")"
: > "$log"
say() { echo "$@" | tee -a "$log"; }
median() { sort -n | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }

say "== corpus ($work)"
$py "$here/make_corpus.py" "$work" | tee -a "$log"
# The same 5 MB for both implementations: 1 MB of each source.
$py - "$work" <<'EOF'
import sys
w = sys.argv[1]
text = open(w + "/text.txt", "rb").read()
part = len(text) // 5
open(w + "/subset.txt", "wb").write(b"".join(text[i * part:i * part + (1 << 20)] for i in range(5)))
EOF
mb() { awk -v b="$(stat -c %s "$1")" 'BEGIN {printf "%.1f", b / 1e6}'; }
# "identical", or where two token files first differ.
same() { cmp -s "$1" "$2" && echo identical || echo "DIFFERENT ($(cmp "$1" "$2" 2>&1 || true))"; }

say "== training $vocab ids on train.txt ($(mb "$work/train.txt") MB), $runs runs"
train_times=() count_times=()
for ((r = 0; r < runs; r++)); do
  line=$("$tool" train "$vocab" "$work/v$vocab" "$work/train.txt")
  say "$line"
  count_times+=("$(sed -E 's/.* counted in ([0-9.]+) s.*/\1/' <<< "$line")")
  train_times+=("$(sed -E 's/.* learned in ([0-9.]+) s.*/\1/' <<< "$line")")
done
count_med=$(printf '%s\n' "${count_times[@]}" | median)
train_med=$(printf '%s\n' "${train_times[@]}" | median)

big=${VOCAB_BIG:-32768}
say "== training $big ids on all of text.txt ($(mb "$work/text.txt") MB), once"
big_line=$(/usr/bin/time -f "%M" -o "$work/big.rss" "$tool" train "$big" "$work/v$big" "$work/text.txt")
big_rss=$(awk '{printf "%.0f", $1 / 1024}' "$work/big.rss")
say "$big_line (peak RSS $big_rss MB)"

identity="not run (REF_CHECK=0)"
if ((ref_check)); then
  say "== identity: C vs reference, every token"
  identity=""
  for f in text.txt random.bin; do
    "$tool" encode "$work/v$vocab" "$work/$f" "$work/$f.c.tok"
    t0=$(date +%s.%N)
    $py "$ref" encode "$work/v$vocab" "$work/$f" "$work/$f.py.tok"
    t1=$(date +%s.%N)
    n=$(($(stat -c %s "$work/$f.c.tok") / 4))
    res=$(same "$work/$f.c.tok" "$work/$f.py.tok")
    [[ $res == identical ]] && res="identical ($n tokens)"
    "$tool" decode "$work/v$vocab" "$work/$f.c.tok" "$work/$f.dec"
    cmp -s "$work/$f.dec" "$work/$f" && res="$res, decodes back" || res="$res, DECODING DIFFERS"
    say "$f ($(mb "$work/$f") MB): $res (reference took $(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.0f", b - a}') s)"
    identity+="| $f | $(mb "$work/$f") | $res |"$'\n'
  done
fi

say "== encoding speed, one core, $runs runs each (a new encoder, so an empty cache, per run)"
declare -A speed
for f in text.txt english.txt random.bin subset.txt; do
  res=$("$tool" bench "$work/v$vocab" "$work/$f" "$runs")
  echo "$res" >> "$log"
  speed[$f]=$(tail -1 <<< "$res" | awk '{print $2}')
  say "C $f: median ${speed[$f]} MB/s"
done
res=$($py "$ref" bench "$work/v$vocab" "$work/subset.txt" "$runs")
echo "$res" >> "$log"
ref_speed=$(tail -1 <<< "$res" | awk '{print $2}')
say "reference subset.txt: median $ref_speed MB/s"

gpt2=""
if [[ -n "${GPT2_DIR:-}" ]]; then
  say "== GPT-2's own vocabulary ($GPT2_DIR)"
  gpt2=$'\n'"## GPT-2's own vocabulary (50257 tokens, GPT2_DIR)"$'\n\n'
  gpt2+="| input | MB | tokens | C vs bpe_ref.py | C vs OpenAI's encoder.py | C MB/s | encoder.py MB/s |"$'\n'
  gpt2+="|---|---|---|---|---|---|---|"$'\n'
  for f in text.txt random.bin english.txt; do
    "$tool" encode "$GPT2_DIR" "$work/$f" "$work/$f.g.tok"
    n=$(($(stat -c %s "$work/$f.g.tok") / 4))
    vs_ref="not run" vs_openai="not run (GPT2_ENCODER_PY)" ospeed=""
    if ((ref_check)) && [[ $f != english.txt ]]; then
      $py "$ref" encode "$GPT2_DIR" "$work/$f" "$work/$f.gr.tok"
      vs_ref=$(same "$work/$f.g.tok" "$work/$f.gr.tok")
    fi
    if [[ -n "${GPT2_ENCODER_PY:-}" ]]; then
      line=$($py "$here/openai_ref.py" "$GPT2_ENCODER_PY" "$GPT2_DIR" "$work/$f" "$work/$f.go.tok")
      echo "$line" >> "$log"
      vs_openai=$(same "$work/$f.g.tok" "$work/$f.go.tok")
      ospeed=$(sed -E 's/.*: ([0-9.]+) MB\/s$/\1/' <<< "$line")
    fi
    res=$("$tool" bench "$GPT2_DIR" "$work/$f" "$runs")
    echo "$res" >> "$log"
    cspeed=$(tail -1 <<< "$res" | awk '{print $2}')
    say "GPT-2 $f: $n tokens; vs bpe_ref.py: $vs_ref; vs encoder.py: $vs_openai; C $cspeed MB/s, encoder.py ${ospeed:-?} MB/s"
    gpt2+="| $f | $(mb "$work/$f") | $n | $vs_ref | $vs_openai | $cspeed | $ospeed |"$'\n'
  done
  gpt2+=$'\n'"C: median of $runs runs on one core (a new encoder each run); encoder.py: one pass over the"
  gpt2+=$'\n'"whole file with its own cache, so its speed there is the best case."$'\n'
fi

cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')
cat > "$out" <<EOF
# Tokenizer: C (src/train/bpe.c) against the Python reference

Written by \`bench/bpe/compare.sh\` on $(date -u +%Y-%m-%d) ($cpu, $(nproc) cores, load
average $(cut -d' ' -f1-3 /proc/loadavg) at the end: the machine is shared, so single runs vary).
Vocabulary: $vocab ids trained by \`bpe_tool train\` on train.txt (2 MB of each source).
Inputs (\`bench/bpe/make_corpus.py\`): text.txt = $(mb "$work/text.txt") MB of /usr/share/doc,
/usr/include, the Python standard library, man pages (decompressed, localized ones too) and
generated text in many scripts (tests/train/gen_bpe_corpus.py); english.txt = its doc and man
parts; random.bin = 10 MB of random bytes; subset.txt = 1 MB of each source.

## Identical tokens (C vs tests/train/bpe_ref.py)

| input | MB | result |
|---|---|---|
${identity}
## Encoding speed, one core (median of $runs runs, MB/s)

| input | C | reference |
|---|---|---|
| text.txt | ${speed[text.txt]} | |
| english.txt | ${speed[english.txt]} | |
| random.bin | ${speed[random.bin]} | |
| subset.txt | ${speed[subset.txt]} | $ref_speed |

## Training

Counting train.txt ($(mb "$work/train.txt") MB): median $count_med s; learning $vocab ids: median
$train_med s ($runs runs).  A larger vocabulary on all of text.txt: $big_line, peak resident
memory $big_rss MB.  Every run's numbers are in bpe.md.log.
$gpt2
EOF
say "wrote $out"
