"""The user docs (README, docs/, tasks/README.md) and the committed reports, checked fast, without building the
site (`make docs` builds it with mkdocs --strict): every relative link resolves to a committed file, user pages
name no issue or machine, the README is a front door, and every figure of the results and kernels tables equals
the committed file it names."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
RESULTS = (REPO / "docs" / "results.md").read_text(encoding="utf-8")


def _site():
    spec = importlib.util.spec_from_file_location("docs_site", REPO / "scripts" / "docs_site.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SITE = _site()
FILES = SITE.tracked(REPO)
USER_PAGES = ["README.md", "tasks/README.md", *sorted(f for f in FILES if f.startswith("docs/") and f.endswith(".md"))]
REPORT_PAGES = sorted(f for f in FILES if f.startswith("reports/") and f.endswith(".md"))


# ---------------------------------------------------------------- links


def test_every_relative_link_resolves_to_a_committed_file():
    assert "docs/results.md" in USER_PAGES and "reports/example/index.md" in REPORT_PAGES
    bad = SITE.broken_links(FILES, USER_PAGES + REPORT_PAGES, REPO)
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_the_link_scan_sees_links_and_skips_code():
    text = ("[a](x.md) ![b](img/y.png \"title\") [c](https://e.org/z) [d](#here) `[e](no.md)`\n"
            "```\n[f](no2.md)\n```\n[g](../up.md#anchor)")
    assert SITE.links(text) == ["x.md", "img/y.png", "../up.md"]
    assert SITE.resolve("docs/a.md", "../up.md") == "up.md" and SITE.resolve("docs/a.md", "../../x") == "../x"
    files = {"docs/a.md", "up.md", "reports/r/index.md"}
    assert SITE.broken_links(files, ["docs/a.md"], _Fake({"docs/a.md": "[u](../up.md) [r](../reports/r/) [n](no.md)"})) \
        == ["docs/a.md: no.md"]


class _Fake:
    """A stand-in repository root: `root / path` reads the given texts."""

    def __init__(self, texts: dict[str, str]):
        self.texts = texts

    def __truediv__(self, path: str):
        text = self.texts[path]
        return type("P", (), {"read_text": lambda self, encoding=None: text})()


# ---------------------------------------------------------------- what user pages hold


def _prose(text: str) -> str:
    """The text without link targets (anchors such as (#1-refusion) are not issue numbers)."""
    return re.sub(r"\]\([^)]*\)", "]()", text)


@pytest.mark.parametrize("page", [p for p in USER_PAGES if p != "docs/history.md"])
def test_user_pages_name_no_issue_and_no_machine_path(page):
    text = _prose((REPO / page).read_text(encoding="utf-8"))
    issues = re.findall(r"(?<![\w&#])#\d+\b", text)
    assert not issues, f"{page}: issue references {issues} (history belongs in docs/history.md)"
    paths = re.findall(r"(?<![\w.~-])/(?:tmp|work|root|home|Users|mnt|scratch)/[\w./-]*", text)
    assert not paths, f"{page}: machine paths {paths}"
    dates = re.findall(r"\b20\d\d-\d\d-\d\d\b", text)
    assert not dates, f"{page}: dated runs {dates} (docs/history.md holds the record)"


def test_readme_is_a_front_door():
    lines = README.splitlines()
    assert len(lines) <= 200, len(lines)
    first = "\n".join(lines[:120])
    block = first.split("## ReFusion against Qwen3-8B on GSM8K, on one GPU")[1]
    command = re.sub(r"\\\n\s*", "", block.split("```bash")[-1].split("```")[0])
    evals = [ln for ln in command.splitlines() if ln.strip().startswith("make eval")]
    assert len(evals) == 1, command
    for piece in ("TASK=gsm8k_cot", "DTYPE=bfloat16", "CHAT_TEMPLATE_ARGS=enable_thinking=false",
                  "=/ckpt/Qwen3-8B:ar", "=/ckpt/ReFusion:refusion", "--baseline qwen3"):
        assert piece in evals[0], piece
    assert "make report" in command and "REFUSION_DATA_DIR" in block and "--dry-run" in block
    for section in ("## Install", "## Two commands", "## Supported systems", "## Results at a glance",
                    "## Your own model, decoder or task", "## Documentation", "## Citation"):
        assert section in README, section
    assert "make test" in README.split("## Two commands")[1].split("##")[0]  # .ci/run calls the README's test command


# ---------------------------------------------------------------- figures against the committed files


def _table(text: str, header_start: str) -> list[list[str]]:
    lines = text[text.index(header_start):].splitlines()
    rows = []
    for ln in lines[2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip().strip("|").split("|")])
    assert rows, header_start
    return rows


def _summary():
    s = json.loads((REPO / "results" / "tiny_embedded400_all" / "summary.json").read_text())
    rows = {(r["model"], r["task"]): r for r in s["rows"]}
    return s, rows


def _ci(c: dict | None, scale: float = 1.0) -> str:
    return f"[{c['lo'] * scale:.1f}, {c['hi'] * scale:.1f}]"


def _speedup(s: dict, model: str) -> str:
    ci = s["mean_speedup_interval"].get(model)
    return f"{s['mean_speedup'][model]:.2f}x" + (f" [{ci['lo']:.2f}, {ci['hi']:.2f}]" if ci else "")


TASKS = ("embedded_math", "embedded_code", "embedded_choice")


def test_the_results_table_is_the_committed_summary():
    s, rows = _summary()
    table = _table(RESULTS, "| decoder | math acc [95% CI] / TPF / tok/s (single pass)")
    assert "results/tiny_embedded400_all/summary.json" in RESULTS
    assert [cells[0] for cells in table] == list(dict.fromkeys(r["model"] for r in s["rows"]))  # every model
    for cells in table:
        model = cells[0]
        for task, cell in zip(TASKS, cells[1:4]):
            r = rows[(model, task)]
            want = (f"{r['quality'] * 100:.1f}% {_ci(r['quality_ci'], 100)} / {r['tpf']:.2f} / "
                    f"{r['tokens_per_s']:.0f}")
            assert cell == want, (model, task, cell, want)
        assert cells[4] == _speedup(s, model), (model, cells[4])


def test_the_readme_glance_table_is_the_committed_summary():
    s, rows = _summary()
    table = _table(README, "| decoder | math | code | choice | speedup vs ar (single pass) |")
    assert "results/tiny_embedded400_all/summary.json" in README
    assert len(table) >= 6
    for cells in table:
        model = cells[0]
        for task, cell in zip(TASKS, cells[1:4]):
            r = rows[(model, task)]
            assert cell == f"{r['quality'] * 100:.1f} {_ci(r['quality_ci'], 100)}", (model, task, cell)
        assert cells[4] == _speedup(s, model), (model, cells[4])


def test_the_frontier_table_is_the_committed_frontier():
    f = json.loads((REPO / "reports" / "tiny-frontier" / "frontier.json").read_text())
    by_task = {t["task"]: t["models"] for t in f["tasks"]}
    table = _table(RESULTS, "| model | embedded_math | embedded_code | embedded_choice |")
    assert len(table) == 4
    for cells in table:
        for task, cell in zip(TASKS, cells[1:4]):
            m = by_task[task][cells[0]]
            want = f"{m['aup']:.1f} {_ci(m['aup_ci'])} ({len(m['kept'])}/{m['points']})"
            assert cell == want, (cells[0], task, cell, want)


def test_the_kernels_table_is_the_committed_benchmark():
    d = json.loads((REPO / "results" / "bench_kernels.json").read_text())
    rows = {(r["prefix"], r["slots"], r["slot_len"], r["backend"]): r for r in d["rows"]}
    section = RESULTS[RESULTS.index("## Slot-attention kernels"):]
    assert "results/bench_kernels.json" in section and d["env"]["cpu"] in section
    assert d["env"]["git_commit"][:7] in section and "no GPU" in section and d["env"]["gpu"] is None
    table = _table(section, "| prefix, slots | sdpa ms / built")
    assert len(table) >= 4
    for cells in table:
        prefix, shape = cells[0].split(", ")
        k, length = (int(x) for x in shape.split(" x "))
        for backend, cell in zip(("sdpa", "replicated", "flex"), cells[1:4]):
            r = rows[(int(prefix), k, length, backend)]
            ms, built = cell.split(" / ")
            assert ms == f"{r['ms_median']:.0f}", (cells[0], backend, ms)
            value, unit = built.split()
            scale, digits = {"MiB": (2 ** 20, 1), "KiB": (1024, 0)}[unit]
            assert value == f"{r['extra_bytes'] / scale:.{digits}f}", (cells[0], backend, built)


# ---------------------------------------------------------------- the decoder registry is the only list


def test_the_decoders_page_is_generated_from_the_registry():
    """docs/decoders.md (capabilities, presets, knob tables) is `python -m harness knobs --markdown`'s output:
    a registered decoder, a changed flag, knob default or help text, or a hand edit of the page fails here."""
    from harness.run.knobs import DOC_PAGE, markdown

    page = (REPO / DOC_PAGE).read_text(encoding="utf-8")
    assert page == markdown(), f"{DOC_PAGE} differs from the registry: regenerate it with `make decoders-doc`"


def test_the_decoders_table_states_each_entrys_flags():
    """The generated table against the entries it is read from, cell by cell (so the generator cannot drop
    or reorder a column silently): one row per registered decoder, in registry order."""
    from harness.run.knobs import markdown
    from refusion.decoding import DECODERS

    rows = _table(markdown(), "| decoder | batched | compile | sampling | attention | families | MDM row | grid |")
    assert [r[0] for r in rows] == [f"[`{n}`](#{n})" for n in DECODERS]
    for cells, d in zip(rows, DECODERS.values()):
        yes = {"yes": True, "no": False}
        assert yes[cells[1]] == d.batched and yes[cells[2]] == ("compile" in d.knobs.names())
        assert yes[cells[3]] == ("seed" in d.knobs.names()) and yes[cells[6]] == d.masked_diffusion
        assert cells[4] == ("causal" if d.causal else "bidirectional")


# A line that names this many registered decoders is a list of them; it belongs in the generated page only.
LIST_NAMES = 5


def _decoder_lists(text: str, names: list[str]) -> list[str]:
    pattern = {n: re.compile(r"(?<![\w/.-])%s(?![\w/-])" % re.escape(n)) for n in names}
    return [line.strip() for line in text.splitlines() if sum(bool(p.search(line)) for p in pattern.values())
            >= LIST_NAMES]


def test_no_page_or_module_lists_the_decoders_by_hand():
    """Prose and comments point to docs/decoders.md (or the registry) instead of enumerating decoders: a
    hand-written list drifts (it said every causal decoder takes `compile`, and listed 6 of 9 batched ones).
    Scanned: the user pages and every Python file of refusion/, harness/ and scripts/; skipped: the generated
    page and the registry itself. The scan finds a planted list (below)."""
    from refusion.decoding import DECODERS

    names = list(DECODERS)
    planted = "every batched decoder (`ar`, `refusion`, `llada`, `fast_dllm`, `dream`) takes batches"
    assert _decoder_lists(planted, names) == [planted]
    skip = {"docs/decoders.md", "refusion/decoding/__init__.py"}
    scanned = [f for f in FILES if f not in skip and (f in USER_PAGES or (
        f.endswith(".py") and f.split("/")[0] in ("refusion", "harness", "scripts")))]
    found = {f: hits for f in scanned if (hits := _decoder_lists((REPO / f).read_text(encoding="utf-8"), names))}
    assert not found, found
