"""Stage the docs site's pages for mkdocs (`make docs`): the README as the home page, docs/, tasks/README.md,
the committed reports with their figures, and every repository file a page links to, each at its path in the
repository, so a link that works on the repository works on the site unchanged.

    python scripts/docs_site.py [--out build/docs]

Only committed files are staged (`git ls-files`; every file when the tree is not a git checkout), so the site
shows what a clone has. The same link scan is `tests/test_docs.py`'s check that every relative link resolves.
Standard library only.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath

REPO = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/", "tasks/README.md")  # the user pages: files, or folders (every file under them)
REPORTS = ("reports/example/", "reports/tiny-frontier/", "reports/curves/", "reports/kernels.png", "reports/trend.png")
# A Markdown link or image target: [text](target) / ![alt](target), up to a space (a title) or the parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)


def tracked(repo: Path = REPO) -> set[str]:
    """Committed files, as POSIX paths relative to the repository (every file when git is not available)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=repo, capture_output=True, check=True).stdout
        return {p for p in out.decode().split("\0") if p}
    except (OSError, subprocess.CalledProcessError):
        return {str(p.relative_to(repo).as_posix()) for p in repo.rglob("*") if p.is_file() and ".git" not in p.parts}


def select(files: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(f for f in files if any(f == p or (p.endswith("/") and f.startswith(p)) for p in prefixes))


def links(text: str) -> list[str]:
    """Relative link targets of a Markdown text, outside code blocks and code spans, without their #anchor."""
    text = CODE.sub("", FENCE.sub("", text))
    out = []
    for target in LINK.findall(text):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("#", "/")):
            continue  # a URL (http:, mailto:), a link inside the page, or an absolute path
        out.append(target.split("#", 1)[0])
    return out


def resolve(page: str, target: str) -> str:
    """The repository path a relative link of `page` points at ('..' beyond the root stays visible)."""
    parts: list[str] = []
    for part in (PurePosixPath(page).parent / target).parts:
        if part == "..":
            if parts and parts[-1] != "..":
                parts.pop()
            else:
                parts.append("..")
        elif part != ".":
            parts.append(part)
    return "/".join(parts)


def broken_links(files: set[str], pages: list[str], repo: Path = REPO) -> list[str]:
    """'page: target' for every relative link of `pages` that is not a committed file (a folder that holds
    committed files counts, as GitHub shows it; the docs site wants files, which mkdocs --strict checks)."""
    folders = {str(PurePosixPath(f).parent) for f in files}
    folders |= {"/".join(f.split("/")[:i]) for f in files for i in range(1, f.count("/") + 1)}
    bad = []
    for page in pages:
        for target in links((repo / page).read_text(encoding="utf-8")):
            path = resolve(page, target).rstrip("/")
            if path not in files and path not in folders:
                bad.append(f"{page}: {target}")
    return bad


def stage(out: Path, repo: Path = REPO) -> list[str]:
    """Copy the pages, the reports and every committed file they link to into `out` (emptied first)."""
    files = tracked(repo)
    wanted = set(select(files, PAGES)) | set(select(files, REPORTS))
    todo = [f for f in sorted(wanted) if f.endswith(".md")]
    while todo:  # linked pages (tasks/README.md from a report, say) bring their own links
        page = todo.pop()
        for target in links((repo / page).read_text(encoding="utf-8")):
            path = resolve(page, target).rstrip("/")
            if path in files and path not in wanted:
                wanted.add(path)
                if path.endswith(".md"):
                    todo.append(path)
    if out.exists():
        shutil.rmtree(out)
    for f in sorted(wanted):
        dest = out / f
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / f, dest)
    return sorted(wanted)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/docs_site.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "build" / "docs"), help="staging folder (default: %(default)s)")
    ns = p.parse_args(argv)
    staged = stage(Path(ns.out))
    print(f"staged {len(staged)} files ({sum(f.endswith('.md') for f in staged)} pages) in {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
