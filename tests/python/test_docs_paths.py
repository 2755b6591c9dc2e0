"""Every repository path that README.md and docs/*.md name exists, and nothing in the repository
refers to files outside it.

A path is a `code span` or a link target whose first component is a top-level entry of this
repository (src/, tests/, bench/results/..., README.md, ...); a link target counts relative to
the page that holds it. Globs must match something; `file::test` names count as the file. Paths
of other projects share some first components with this one (NIXL's `src/core/...`); a path that
does not exist here is accepted only when the text just before it (the same paragraph, up to 300
characters) or the path itself names the other project (NIXL, the kernel, vLLM, ...), or when
git ignores it (build output such as `ci/vm/work/`).
"""

from __future__ import annotations

import glob
import os
import re
import subprocess

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# Words that mark a path as another project's (checked only for paths that do not exist here).
OTHER_PROJECTS = re.compile(
    r"NIXL|nixl|ai-dynamo|kernel|Linux|linux|liburing|vLLM|vllm|LMCache|"
    r"lmcache|Dynamo|dynamo|upstream|UCX|cuFile|glommio|cudarc|io-uring|"
    r"rustls|cloud-hypervisor|mainline|torvalds|axboe"
)


def pages() -> list[str]:
    return [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))


def top_level() -> set[str]:
    out = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    return {f.split("/")[0] for f in out}


def ignored(rel: str) -> bool:
    return subprocess.run(["git", "check-ignore", "-q", rel], cwd=REPO).returncode == 0


def named_paths(page: str, text: str):
    """(line number, path relative to the repository, how it was named, the text of its
    paragraph before it) of every path."""
    tops = top_level()
    base = os.path.relpath(os.path.dirname(page), REPO)
    in_fence = False
    before = ""  # the paragraph so far
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:  # commands and configs: their paths are the reader's (/mnt/nvme, ...)
            continue
        before = "" if not line.strip() else before + " "
        for m in re.finditer(r"`([^`\s]+)`|\]\(([^)\s#]+)(?:#[^)]*)?\)", line):
            if m.group(2):
                target = m.group(2)
                if re.match(r"[a-z]+:", target):  # https:, mailto:
                    continue
                rel = os.path.normpath(os.path.join(base, target))
                how = "link"
            else:
                rel = m.group(1).split("::")[0].rstrip(".,;:)")
                how = "code"
            context = (before + line[: m.start()])[-300:]
            if rel.startswith("..") or rel.split("/")[0] not in tops:
                if how == "link":
                    yield n, rel, how, context
                continue
            yield n, rel, how, context
        before += line


def problems_in(page: str, text: str) -> tuple[int, list[str]]:
    """(paths checked, problems) of one page."""
    problems, checked = [], 0
    for n, rel, how, context in named_paths(page, text):
        where = f"{os.path.relpath(page, REPO)}:{n}"
        if rel.startswith(".."):
            problems.append(f"{where}: {rel} points outside the repository")
            continue
        checked += 1
        if glob.glob(os.path.join(REPO, rel)):
            continue
        if how == "code" and (OTHER_PROJECTS.search(context) or OTHER_PROJECTS.search(rel)):
            continue  # another project's path, named as such
        if ignored(rel):
            continue
        problems.append(f"{where}: {rel} ({how}) does not exist")
    return checked, problems


def test_every_repository_path_the_readme_and_docs_name_exists():
    checked, problems = 0, []
    for page in pages():
        c, p = problems_in(page, open(page, encoding="utf-8").read())
        checked += c
        problems += p
    assert checked > 100, checked  # the pages name many paths: the scan must find them
    assert not problems, "\n".join(problems)


def test_the_check_catches_a_missing_path_and_accepts_other_projects_paths():
    page = os.path.join(REPO, "docs", "x.md")
    text = (
        "see `tests/python/no_such_test.py` and [this](../src/no_such.rs), `src/engine/mod.rs`\n"
        "NIXL's `src/core/nixl_agent.cpp`, `ci/vm/work/`\n"
        "[up](../../outside.md) [ok](parameters.md) [web](https://example.org/x)\n"
        "\n"
        "```sh\n"
        "ls src/not_checked_in_a_command.rs\n"
        "```\n"
    )
    checked, problems = problems_in(page, text)
    assert problems == [
        "docs/x.md:1: tests/python/no_such_test.py (code) does not exist",
        "docs/x.md:1: src/no_such.rs (link) does not exist",
        "docs/x.md:3: ../outside.md points outside the repository",
    ], problems
    assert checked == 6, checked


def test_nothing_refers_to_the_workplace_outside_the_repository():
    # The project's machines have a shared folder beside the checkout; users do not.
    needles = ["../" + "shared", "/work/" + "shared"]
    hits = []
    for needle in needles:
        p = subprocess.run(
            ["git", "grep", "-n", "-F", needle, "--", "."], cwd=REPO, capture_output=True, text=True
        )
        hits += [ln for ln in p.stdout.splitlines() if ln]
    assert not hits, "references to files outside the repository:\n" + "\n".join(hits)
