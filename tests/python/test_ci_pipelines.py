"""No shell pipeline in the repository can die of SIGPIPE.

Every script runs under `set -o pipefail`, so a pipeline fails when any command in it fails. A
reader that stops before the end of its input (`head`, `grep -q`, `grep -m`, `sed ...q`, `awk
... exit`, `read`, `cmp`) leaves the writer to meet a closed pipe: the writer is killed by
SIGPIPE (exit 141) whenever it writes after the reader left, a race that depends on timing.
`ci/remote-setup.sh` ran `etcd --version | head -n 1` that way and failed `bash ci/test.sh` on
fresh machines (etcd prints 4 lines; 44 of 200 tries failed when this was measured on the 2-core
machine, 0 of 200 with `sed -n 1p`, which reads to the end). `grep PATTERN >/dev/null` is NOT
safe: GNU grep stops at the first match when its output is /dev/null (checked with grep 3.8:
`yes | head -c 100000000 | grep y >/dev/null` exits 141 under pipefail). Safe forms: `sed -n
1p`, `grep -c PATTERN >/dev/null` (counting reads to the end), `find ... -print -quit`, or a
variable and parameter expansion.
"""

from __future__ import annotations

import os
import re
import subprocess

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# A command after a pipe that can stop reading before its input ends.
EARLY_READERS = [
    (re.compile(r"^head\b"), "head"),
    (
        re.compile(
            r"^grep\b.*\s(-[a-zA-Z0-9]*[qmlL][a-zA-Z0-9]*|--quiet|--silent|--max-count\S*|"
            r"--files-with(out)?-match\S*)(\s|$)"
        ),
        "grep that stops at a match",
    ),
    (re.compile(r"^sed\b.*(\d+q\b|;\s*q\b|'q'|\bq;)"), "sed with q"),
    (re.compile(r"^awk\b.*\bexit\b"), "awk with exit"),
    (re.compile(r"^(read|cmp)\b"), "read/cmp"),
    # GNU grep quits at the first match when stdout is /dev/null (unless it counts, -c)
    (
        re.compile(r"^grep\b(?!.*\s-[a-zA-Z0-9]*c)(.*\s)?(1?>|&>)\s*/dev/null"),
        "grep into /dev/null stops at a match",
    ),
]


def _blank_quotes(raw: str) -> str:
    """`raw` with quoted text and comments replaced by spaces, character for character; the code
    of a command substitution `$(...)` stays, inside double quotes too."""
    out = []
    stack = ["code"]  # contexts: code, ' (single-quoted), " (double-quoted)
    i = 0
    while i < len(raw):
        c, ctx = raw[i], stack[-1]
        if ctx == "'":
            if c == "'":
                stack.pop()
            out.append(" ")
        elif ctx == '"':
            if c == "\\":
                out.append("  ")
                i += 2
                continue
            if raw.startswith("$(", i):
                stack.append("code")
                out.append("$(")
                i += 2
                continue
            if c == '"':
                stack.pop()
            out.append(" ")
        else:
            if c == "\\":
                out.append("  ")
                i += 2
                continue
            if c in ("'", '"'):
                stack.append(c)
                out.append(" ")
            elif c == "#" and (i == 0 or raw[i - 1].isspace()):
                break
            elif raw.startswith("$(", i):
                stack.append("code")
                out.append("$(")
                i += 2
                continue
            elif c == ")" and len(stack) > 1:
                stack.pop()
                out.append(c)
            else:
                out.append(c)
        i += 1
    return "".join(out)


def _code_lines(text: str):
    """(line number, code, line) of shell code: comments, here-document bodies and quoted text
    are blanked so that a `|` in a message or a help text is not taken for a pipe."""
    heredoc_end = None
    for n, raw in enumerate(text.splitlines(), 1):
        if heredoc_end is not None:
            if raw.strip() == heredoc_end:
                heredoc_end = None
            continue
        code = _blank_quotes(raw)
        m = re.search(r"<<-?\s*(['\"]?)(\w+)\1", raw)
        if m and code[m.start() : m.start() + 2] == "<<" and "<<<" not in raw:
            heredoc_end = m.group(2)
        yield n, code, raw


def early_reader_pipes(text: str) -> list[tuple[int, str, str]]:
    """(line number, reason, line) for each pipe into a reader that may stop early."""
    found = []
    for n, code, raw in _code_lines(text):
        # `code` is `raw` with quoted text blanked, character for character, so the positions of
        # its pipes (`|` or `|&`, not `||`) cut `raw` into the commands of the pipeline.
        pipes = [m.start() for m in re.finditer(r"(?<!\|)\|(?!\|)", code)]
        for k, pos in enumerate(pipes):
            end = pipes[k + 1] if k + 1 < len(pipes) else len(code)
            reader = raw[pos + 1 : end].lstrip("&").strip()
            for pattern, reason in EARLY_READERS:
                if pattern.search(reader):
                    found.append((n, reason, raw.strip()))
                    break
    return found


def shell_files() -> list[str]:
    files = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    return [f for f in files if f.endswith(".sh") or f in (".ci/run",)]


def test_the_check_finds_the_pipelines_that_failed_and_spares_the_safe_forms():
    bad = [
        '"$tools/usr/bin/etcd" --version | head -n 1',
        'dpkg-deb -x "$(ls -t "$tools"/debs/etcd-server_*.deb | head -n 1)" "$tools"',
        "if ! ldd \"$bin\" 2>&1 | grep -q 'statically linked'; then",
        "x=$(find . -name a | head -1)",
        "cmd | grep -Eqi pattern",
        "cmd | grep -m1 pattern",
        "cmd | sed 1q",
        "cmd | awk '{print; exit}'",
        "cmd | read -r first",
        "ldd \"$bin\" 2>&1 | grep 'statically linked' >/dev/null",
    ]
    for line in bad:
        assert early_reader_pipes(line + "\n"), line
    good = [
        '"$tools/usr/bin/etcd" --version | sed -n 1p',
        "ldd \"$bin\" 2>&1 | grep -c 'statically linked' >/dev/null",
        "x=$(find . -name a -print -quit)",
        "a || head -n 1 file",
        "grep -q pattern file",
        "echo 'a | head -n 1'",
        "# cmd | head -n 1",
        "cmd | tail -n 1",
        "cmd | grep -c x",
        "cat <<EOF\nusage: a | head\nEOF",
    ]
    for line in good:
        assert not early_reader_pipes(line + "\n"), line


def test_no_script_pipes_into_a_reader_that_stops_early():
    files = shell_files()
    assert "ci/remote-setup.sh" in files and "ci/test.sh" in files, files
    problems = []
    for f in files:
        with open(os.path.join(REPO, f), encoding="utf-8") as fh:
            for n, reason, line in early_reader_pipes(fh.read()):
                problems.append(f"{f}:{n}: {reason}: {line}")
    assert not problems, (
        "pipelines whose writer can die of SIGPIPE under pipefail (use sed -n "
        "1p, grep -c >/dev/null or find -print -quit):\n" + "\n".join(problems)
    )
