#!/usr/bin/env python3
"""The docs' code blocks, run as a user would run them.

Every fenced block in README.md and docs/*.md carries a marker on the line
before it, an HTML comment that a reader of the rendered page never sees:

    <!-- doc: run -->                 sh: run the block with bash (set -e);
                                      lines "$ cmd" followed by output are a
                                      transcript: each cmd runs, and every
                                      output line shown must be among the
                                      lines it printed ("..." skips)
    <!-- doc: run ranks=N -->         python / c: the block is a program;
                                      run it on N ranks under build/chorusrun
                                      (c: compiled against include/ and
                                      build/libchorus first)
    <!-- doc: output CMD -->          the block is what the shell command CMD
                                      prints: run it, and every line shown
                                      must be among the lines it printed
    <!-- doc: skip -- REASON -->      a command that cannot run here (another
                                      host, Slurm, minutes of work): REASON
                                      says why, and what runs it instead
    <!-- doc: text -- REASON -->      not a command (a shape, a table, a
                                      formula): REASON says what it is

Options after the kind: timeout=S (default 120), shape (numbers with a
decimal point and m:ss times are not compared: timings and rates), digits
(no number is compared: an error message's shape, its ranks, counts,
ports and times), fails (the commands must fail, not time out: they show
an error), needs=FILE (put there
first: prog.c is README's program, my_script.py a small chorus program; a
doc's "your program"), torch (skipped,
saying so, where /usr/bin/python3 has no torch).

A block without a marker, a marker without a reason where one is due, a
command that fails and an output line that does not appear all fail the
test.  Two more checks: every option the docs give one of our programs is
in its --help, and every message docs/errors.md quotes in running text is
one the code prints (check_error_quotes).  Commands run in a scratch folder holding links to the source tree's
top-level folders and build -> the build tree, with PYTHONPATH at the
build's Python package and CHORUS_TIMEOUT=60.

    doc_test.py SOURCE_DIR BUILD_DIR
"""

import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

SRC, BUILD = (os.path.abspath(a) for a in sys.argv[1:3])
PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
MARK = re.compile(r"^\s*<!-- doc: (\w+)(.*?)(?: -- (.*?))? -->\s*$")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
DECIMAL = re.compile(r"\d+\.\d+(e[-+]?\d+)?|\b\d+:\d\d\b")  # shape: rates, timings, m:ss
NUMBER = re.compile(r"\d+(\.\d+)?")                            # digits: every number

STUB = {  # needs=FILE: what a doc calls "your program"
    # prog.c: README's program, read from README.md
    "my_script.py": "import numpy as np, chorus\n"
                    "chorus.init_process_group()\n"
                    "a = np.ones(4, np.float32)\n"
                    "chorus.all_reduce(a)\n"
                    "print('sum', a[0])\n"
                    "chorus.destroy_process_group()\n",
}


def readme_program():
    """needs=prog.c: README's program ("The API in 20 lines")."""
    for _, lang, _, body in blocks(os.path.join(SRC, "README.md")):
        if lang == "c":
            return "\n".join(body) + "\n"
    raise SystemExit("README.md has no c block")


def blocks(path):
    """(line, lang, marker match or None, body lines) of each fenced block."""
    lines = open(path, encoding="utf-8").read().split("\n")
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m:
            indent = m.group(1)
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            mark = MARK.match(lines[i - 1]) if i > 0 else None
            body = [l[len(indent):] if l.startswith(indent) else l for l in lines[i + 1:j]]
            yield i + 1, m.group(2), mark, body
            i = j
        i += 1


def scratch():
    d = tempfile.mkdtemp(prefix="chorus-doc.")
    # Links to the source tree's folders only: a block that writes a file
    # in its folder (CMakeLists.txt, say) writes it here, not through a link
    # into the source tree.
    for name in os.listdir(SRC):
        if (name != "build" and not name.startswith(".") and
                os.path.isdir(os.path.join(SRC, name))):
            os.symlink(os.path.join(SRC, name), os.path.join(d, name))
    os.symlink(BUILD, os.path.join(d, "build"))
    return d


def env_for(d):
    e = dict(os.environ)
    e.update(PYTHONPATH=os.path.join(BUILD, "python"), CHORUS_TIMEOUT="60", HOME=d,
             OPENBLAS_NUM_THREADS="1")
    return e


def run(cmd, d, timeout):
    """(exit code, output) of bash -c cmd in d; its whole process group is
    killed when it is done or after timeout seconds (124)."""
    p = subprocess.Popen(["bash", "-c", cmd], cwd=d, env=env_for(d), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, errors="replace",
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        out, _ = p.communicate()
        out, rc = (out or "") + "\n(timed out after %d s)" % timeout, 124
    try:
        os.killpg(p.pid, 9)  # what it left behind
    except ProcessLookupError:
        pass
    return rc, out


def norm(line, shape):
    line = line.strip()
    if shape == "digits":
        return NUMBER.sub("<n>", line)
    return DECIMAL.sub("<x>", line) if shape else line


def compare(shown, out, shape):
    """The shown lines missing from out."""
    have = {norm(l, shape) for l in out.split("\n")}
    return [l for l in shown if l.strip() not in ("", "...") and norm(l, shape) not in have]


PROGRAMS = ("chorusrun", "chorus-train", "chorus-data", "chorus-bench")


def known_options():
    """Each program's options, as its --help lists them."""
    known = {}
    for prog in PROGRAMS:
        p = subprocess.run([os.path.join(BUILD, prog), "--help"], capture_output=True, text=True)
        known[prog] = {"--help", "-h"} | set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*|-[a-zA-Z])\b", p.stdout + p.stderr))
    return known


def command_lines(path):
    """(line number, text) of every command a doc shows: `code` spans and
    the lines of sh blocks."""
    in_sh = False
    for n, line in enumerate(open(path, encoding="utf-8"), 1):
        m = FENCE.match(line.rstrip("\n"))
        if m:
            in_sh = not in_sh and m.group(2) in ("sh", "bash")
            continue
        if in_sh:
            yield n, line.strip().lstrip("$ ")
        else:
            for span in re.findall(r"`([^`]+)`", line):
                yield n, span


def check_options(files):
    known = known_options()
    fails = checked = 0
    for path in files:
        rel = os.path.relpath(path, SRC)
        for n, text in command_lines(path):
            try:
                words = shlex.split(text.split(" #")[0])
            except ValueError:
                continue
            prog = None
            for w in words:
                base = os.path.basename(w)
                if base in PROGRAMS:
                    prog = base
                    continue
                if w == "--":
                    prog = None  # what follows is the program chorusrun starts
                    continue
                if prog and re.match(r"^--?[a-zA-Z][a-z0-9-]*(=.*)?$", w):
                    opt = w.split("=", 1)[0]
                    checked += 1
                    if opt not in known[prog]:
                        print("FAIL %s:%d: %s has no option %s (`%s`)" % (rel, n, prog, opt, text))
                        fails += 1
    print("ok   %d option(s) given to chorusrun, chorus-train, chorus-data and chorus-bench in the "
          "docs, each one its --help lists" % checked if not fails else
          "%d option(s) checked, %d unknown" % (checked, fails))
    return fails


# ------------------------------------------------ errors.md's quoted messages
SPEC = re.compile(r"%[-+ #0]*\d*(?:\.\d+)?(?:hh|h|ll|l|z|j|t|L)?[diouxXeEfgGscp]|%\.\*s")
# A word of a message: letters, not a lone capital (R, N, H, P are the
# docs' placeholders); a run is four or more such words in a row.
WORD = r"(?:[A-Za-z][a-z]+(?:['-][a-z]+)*|[a-z]|[A-Z]{2,}[a-z]*)"
RUN = re.compile(r"(?<![\w'])" + WORD + r"(?: " + WORD + r"){3,}(?![\w])")


def source_formats():
    """The string literals of src/ and python/chorus (adjacent ones joined,
    PRIu64 and the like made %llu), and errno's texts."""
    lit = re.compile(r'"((?:[^"\\\n]|\\.)*)"')
    out = []
    paths = glob.glob(os.path.join(SRC, "src", "**", "*.[ch]"), recursive=True)
    paths += glob.glob(os.path.join(SRC, "python", "chorus", "*.*"))
    for path in paths:
        text = open(path, errors="replace").read()
        text = re.sub(r'"\s*PRI[diuxX]\d*\s*"', "%llu", text)
        text = re.sub(r'"\s*\n\s*"', "", text)
        text = re.sub(r'"[ \t]+"', "", text)
        out += [m.group(1).replace('\\"', '"').replace("\\n", " ") for m in lit.finditer(text)]
    return out + [os.strerror(i) for i in range(1, 134)]


def check_error_quotes():
    """Every message errors.md quotes in running text is one the code can
    print: each run of four or more words in it is either text of a string
    literal, or inside a part of the quote that a format string (its
    conversions matching anything) produces.  A message reworded in the
    code, or quoted from memory, fails here.  (Its fenced examples are run
    and compared by the blocks check.)"""
    formats = source_formats()
    chunks = "\n".join(part for f in formats for part in SPEC.split(f))
    pieces = [p.strip(" ;:,.") for f in formats for p in re.split(r"(?<=[.;:])\s+", f)]
    pieces = [p for p in pieces if len(SPEC.sub("", p)) >= 12]

    def regex(f):
        out, pos = [], 0
        for m in SPEC.finditer(f):
            out += [re.escape(f[pos:m.start()]), ".+?"]
            pos = m.end()
        return "".join(out + [re.escape(f[pos:])])

    def made_by_format(run, quote):
        w, at = run.split()[0], quote.find(run)
        for f in pieces:
            if w in f:
                m = re.search(regex(f), quote)
                if m and m.start() <= at < m.end():
                    return True
        return False

    doc = open(os.path.join(SRC, "docs", "errors.md"), encoding="utf-8").read()
    doc = re.sub(r"(?ms)^\s*```.*?^\s*```\s*$", "", doc)
    doc = re.sub(r"<!--.*?-->", "", doc)
    fails = runs = 0
    for quote in re.findall(r"`([^`]+)`", re.sub(r"\n\s*", " ", doc)):
        if len(quote.split()) < 5:
            continue
        for run in RUN.findall(quote):
            runs += 1
            if run not in chunks and not made_by_format(run, quote):
                print("FAIL docs/errors.md: no message of the code says '%s' (in `%s`)"
                      % (run, quote[:160]))
                fails += 1
    if not fails:
        print("ok   docs/errors.md: %d runs of words in its quoted messages, each one the code "
              "prints" % runs)
    return fails


def check_env_md():
    gen = subprocess.run([os.path.join(BUILD, "chorusrun"), "--env-markdown"], capture_output=True,
                         text=True).stdout
    doc = open(os.path.join(SRC, "docs", "env.md"), encoding="utf-8").read()
    if gen and doc.endswith(gen):
        print("ok   docs/env.md's tables are chorusrun --env-markdown's")
        return 0
    print("FAIL docs/env.md: its tables are not what `build/chorusrun --env-markdown` prints "
          "(regenerate them: that output replaces everything from the first table on)")
    return 1


def check_tour():
    readme = open(os.path.join(SRC, "README.md"), encoding="utf-8").read()
    a, b = readme.find("## Source tour"), readme.find("\n## ", readme.find("## Source tour") + 1)
    tour = readme[a:b] if a >= 0 else ""
    files = [os.path.relpath(p, SRC) for pat in ("src/**/*.[ch]", "src/**/*.def", "python/chorus/*.*")
             for p in glob.glob(os.path.join(SRC, pat), recursive=True)]
    missing = sorted(f for f in files if "`%s`" % os.path.basename(f) not in tour)
    for f in missing:
        print("FAIL README.md: the source tour does not name %s" % f)
    if not missing:
        print("ok   README.md's source tour names all %d files of src/ and python/chorus/" % len(files))
    return len(missing)


def main():
    files = [os.path.join(SRC, "README.md")] + sorted(glob.glob(os.path.join(SRC, "docs", "*.md")))
    counts = dict(run=0, compared=0, skip=0, text=0)
    fails = 0
    have_torch = subprocess.run([PY, "-c", "import torch"], capture_output=True).returncode == 0
    for path in files:
        rel = os.path.relpath(path, SRC)
        for line, lang, mark, body in blocks(path):
            where = "%s:%d" % (rel, line)
            if rel == "README.md" and line <= 5 and not mark:
                # The README starts with its two commands, nothing above them.
                counts["skip"] += 1
                print("skip %s: the README's two commands: CI runs the second (.ci/run); the "
                      "first is a newcomer's minutes of build and training" % where)
                continue
            if not mark:
                print("FAIL %s: a ```%s block without a doc marker (<!-- doc: run|output|skip|"
                      "text ... -->)" % (where, lang))
                fails += 1
                continue
            kind, opts, reason = mark.group(1), mark.group(2).strip(), mark.group(3)
            if kind in ("skip", "text"):
                if not reason:
                    print("FAIL %s: '%s' needs a reason (<!-- doc: %s -- why -->)" % (where, kind, kind))
                    fails += 1
                    continue
                counts[kind] += 1
                print("%-4s %s: %s" % (kind, where, reason))
                continue
            words = shlex.split(opts) if kind == "run" else []
            kv = dict(w.split("=", 1) for w in words if "=" in w)
            flags = {w for w in words if "=" not in w}
            if kind == "output":
                m = re.match(r"(.*?)((?:\s+(?:shape|digits|fails|timeout=\d+))*)$", opts)
                cmd, tail = m.group(1), m.group(2).split()
                kv = dict(w.split("=", 1) for w in tail if "=" in w)
                flags = {w for w in tail if "=" not in w}
            timeout = int(kv.get("timeout", 120))
            shape = "digits" if "digits" in flags else "shape" in flags
            fails_ok = "fails" in flags  # the commands are meant to fail (an error's message)
            ok_rc = (lambda rc: rc not in (0, 124)) if fails_ok else (lambda rc: rc == 0)
            if "torch" in flags and not have_torch:
                counts["skip"] += 1
                print("skip %s: %s has no torch (python3-torch): not run here" % (where, PY))
                continue
            d = scratch()
            try:
                for f in kv.get("needs", "").split(",") if kv.get("needs") else []:
                    with open(os.path.join(d, f), "w") as fh:
                        fh.write(STUB[f] if f in STUB else readme_program())
                bad = None
                compared = False
                if kind == "output":
                    rc, out = run(cmd, d, timeout)
                    missing = compare(body, out, shape)
                    compared = True
                    if not ok_rc(rc) or missing:
                        bad = "`%s` exited %d; lines not in its output: %s" % (cmd, rc, missing[:3])
                elif lang == "python" or lang == "c":
                    n = int(kv.get("ranks", 1))
                    src = os.path.join(d, "snippet." + ("py" if lang == "python" else "c"))
                    with open(src, "w") as fh:
                        fh.write("\n".join(body) + "\n")
                    if lang == "c":
                        cc = "cc -std=c11 -Wall -Werror -Iinclude snippet.c -o snippet %s -Wl,-rpath,%s" % (
                            shlex.quote(os.path.join(BUILD, "libchorus.so")), shlex.quote(BUILD))
                        rc, out = run(cc, d, timeout)
                        if rc != 0:
                            bad = "does not compile: " + out[-600:]
                        prog = "./snippet"
                    else:
                        prog = "%s snippet.py" % PY
                    if not bad:
                        rc, out = run("build/chorusrun --standalone -n %d -- %s" % (n, prog), d, timeout)
                        if rc != 0:
                            bad = "exited %d on %d rank(s): %s" % (rc, n, out[-600:])
                elif any(l.startswith("$ ") for l in body):
                    # a transcript: each "$ cmd", then what it prints
                    i = 0
                    while i < len(body) and not bad:
                        if not body[i].startswith("$ "):
                            i += 1
                            continue
                        cmd, j = body[i][2:], i + 1
                        while j < len(body) and not body[j].startswith("$ "):
                            j += 1
                        rc, out = run(cmd, d, timeout)
                        missing = compare(body[i + 1:j], out, shape)
                        compared = compared or j > i + 1
                        if not ok_rc(rc) or missing:
                            bad = "`%s` exited %d; lines not in its output: %s\n%s" % (
                                cmd, rc, missing[:3], out[-400:])
                        i = j
                else:
                    rc, out = run("set -e -o pipefail\n" + "\n".join(body), d, timeout)
                    if rc != 0:
                        bad = "exited %d: %s" % (rc, out[-800:])
                if bad:
                    print("FAIL %s: %s" % (where, bad))
                    fails += 1
                else:
                    counts["run"] += 1
                    counts["compared"] += compared
                    print("ok   %s: %s%s" % (where, "ran" if kind == "run" else "output of " + cmd,
                                            ", its output compared" if compared and kind == "run" else ""))
            finally:
                shutil.rmtree(d, ignore_errors=True)
    # Every option a doc gives one of our programs -- in running text, in
    # blocks that run and in those that cannot -- is one its --help lists.
    fails += check_options(files)
    fails += check_error_quotes()
    # README's source tour names every file of src/ and python/chorus/.
    fails += check_tour()
    # docs/env.md's tables are chorusrun --env-markdown's, as it says.
    fails += check_env_md()
    # README's list of packages is scripts/deps.sh's.
    deps = open(os.path.join(SRC, "scripts", "deps.sh")).read()
    pkgs = set(re.findall(r"need\+=\(([a-z0-9][a-z0-9.+-]+)\)", deps))
    for group in re.findall(r"for p in ([^;]+); do", deps):
        pkgs |= {w for w in group.replace("\\", " ").split() if re.match(r"^[a-z0-9][a-z0-9.+-]+$", w)}
    readme = open(os.path.join(SRC, "README.md")).read()
    missing = sorted(p for p in pkgs if "`%s`" % p not in readme)
    if missing:
        print("FAIL README.md: scripts/deps.sh installs %s, which README's list leaves out"
              % ", ".join(missing))
        fails += 1
    else:
        print("ok   README.md lists every package scripts/deps.sh installs (%d)" % len(pkgs))
    print("%d block(s) run (%d with their output compared), %d marked not runnable, %d marked "
          "as text; %d failed" % (counts["run"], counts["compared"], counts["skip"], counts["text"],
                                  fails))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
