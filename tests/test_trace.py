"""Decode traces: every decoder's commit order (stats commit_forward / commit_kind / forward_phase), the
`harness trace` drawings, the page in a real headless browser, and the report's links to logged traces."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from harness.report import trace as trace_cmd
from harness.report import trace_draw
from harness.run.presets import PRESETS
from refusion.decoding import DECODERS

pytestmark = pytest.mark.usefixtures("one_thread")

QUERIES = ("Ana has 85 apples. Ana uses 22 apples. How many apples does Ana have now?",
           "Write a function add_two(x) that returns x plus 2.",
           "Which word has the most letters?\n(A) cat\n(B) mountain\n(C) sun\n(D) key")
REFUSION_KINDS = {"plan", "verify", "infill"}
GEN = 32


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    """name -> (model, tokenizer) of the tiny checkpoints, loaded once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = {}

    def get(name):
        if name not in cache:
            path = tiny_checkpoint(name)
            cache[name] = (AutoModelForCausalLM.from_pretrained(str(path)).eval(),
                           AutoTokenizer.from_pretrained(str(path)))
        return cache[name]

    return get


def _batch(tok):
    from refusion.tokenizer import encode_chat

    rows = [torch.tensor(encode_chat(tok, q)) for q in QUERIES]
    width = max(r.numel() for r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - r.numel():], mask[i, width - r.numel():] = r, 1
    return ids, mask


@pytest.mark.parametrize("preset", ["ar", "refusion", "refusion_left_to_right", "refusion_recompute_kv",
                                    "refusion_replicated", "refusion_no_cache", "llada", "fast_dllm", "dream",
                                    "dream_fast_dllm", "d2f"])
def test_commit_order_is_consistent_with_the_stats(preset, loaded):
    spec = PRESETS[preset]
    model, tok = loaded(Path(spec.checkpoint).name)
    ids, mask = _batch(tok)
    knobs = {**spec.knobs, "gen_length": GEN}
    tokens, stats = DECODERS[spec.decoder](model, ids, mask, knobs)
    nfe, phases = stats["nfe"], stats["forward_phase"]
    assert len(phases) == nfe
    for p in {x for ph in phases for x in ph.split("+")}:  # the phase log is the counters, call by call
        assert sum(ph.split("+").count(p) for ph in phases) == stats[f"nfe_{p}"]
    assert len(stats["commit_forward"]) == len(stats["commit_kind"]) == len(tokens) == 3
    for row, fwd, kind in zip(tokens, stats["commit_forward"], stats["commit_kind"]):
        # every generated token has exactly one index, of a forward that happened
        assert len(fwd) == len(kind) == row.numel() > 0
        assert all(0 <= f < nfe for f in fwd) and len(set(fwd)) <= nfe
        # its kind is a phase of that forward (ReFusion's rows share stacked calls serving several phases)
        assert all(k in phases[f].split("+") for f, k in zip(fwd, kind))
        if spec.decoder == "ar":
            assert fwd == list(range(row.numel())) and kind[0] == "prefill"
        if spec.decoder == "refusion":
            assert set(kind) <= REFUSION_KINDS
            size = knobs["slot_size"]
            for a in range(0, len(fwd), size):
                slot_f, slot_k = fwd[a:a + size], kind[a:a + size]
                assert slot_f == sorted(slot_f), f"slot at {a}: commit order {slot_f} goes back"
                assert slot_k[0] == "plan" and "plan" not in slot_k[1:]  # a slot's head comes from its plan
        if spec.decoder == "llada":  # steps = gen_length: one token per row per forward
            assert len(set(fwd)) == len(fwd)
        if spec.decoder == "fast_dllm":  # every block starts with a full forward that commits
            assert kind[0] == "full" and fwd[0] == 0


def test_refusion_batch_rows_record_their_own_order(loaded):
    """Batched rows: each row's order is its own; the same tokens as alone, indices into the shared calls."""
    model, tok = loaded("refusion")
    ids, mask = _batch(tok)
    knobs = {**PRESETS["refusion"].knobs, "gen_length": GEN}
    tokens, stats = DECODERS["refusion"](model, ids, mask, knobs)
    for b in range(3):
        one_ids = ids[b:b + 1, mask[b].bool()]
        alone, one = DECODERS["refusion"](model, one_ids, None, knobs)
        assert torch.equal(alone[0], tokens[b])
        assert one["commit_kind"][0] == stats["commit_kind"][b]
        # alone, the row's k-th distinct commit forward is its k-th commit step; in the batch too, in order
        order = sorted(set(one["commit_forward"][0]))
        batch_order = sorted(set(stats["commit_forward"][b]))
        assert len(order) == len(batch_order)
        remap = dict(zip(order, batch_order))
        assert [remap[f] for f in one["commit_forward"][0]] == stats["commit_forward"][b]


# ---------------------------------------------------------------- harness trace

MODELS = "ar,refusion,llada:block_length=16,fast_dllm:block_length=16"


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """`harness trace` on embedded_choice test item 0 with ar, refusion, llada and fast_dllm (gen_length 16)."""
    out = tmp_path_factory.mktemp("reports")
    rc = trace_cmd.main(["--task", "embedded_choice", "--index", "0", "--models", MODELS, "--gen-length", "16",
                         "--out", str(out), "--name", "t", "--threads", "1", "--device", "cpu", "--fps", "8"])
    assert rc == 0
    folder = out / "t" / "trace"
    return folder, json.loads((folder / "trace.json").read_text())


def test_trace_writes_figures_gifs_and_the_page(traced):
    from PIL import Image

    from tasks.embedded import load_split

    folder, trace = traced
    names = [m["name"] for m in trace["models"]]
    assert names == ["ar", "refusion", "llada", "fast_dllm"]
    assert load_split("choice", "test")[0]["query"] == trace["prompt"]
    for m in trace["models"]:
        n = len(m["tokens"])
        assert 0 < n <= 16 and len(m["pieces"]) == len(m["commit_forward"]) == len(m["commit_kind"]) == n
        assert len(m["forward_phase"]) == m["nfe"] and all(0 <= f < m["nfe"] for f in m["commit_forward"])
        with Image.open(folder / f"{m['name']}.png") as im:
            assert im.format == "PNG" and im.width > 300
        with Image.open(folder / f"{m['name']}.gif") as im:
            assert im.format == "GIF" and im.n_frames == m["nfe"]  # one frame per forward
    assert next(m for m in trace["models"] if m["name"] == "refusion")["group"] == {"name": "slot", "size": 4}
    with Image.open(folder / "all.gif") as im:  # one clock: one frame per forward of the slowest
        assert im.n_frames == max(m["nfe"] for m in trace["models"])
    page = (folder / "index.html").read_text()
    assert "<script src" not in page and "http" not in page.lower()  # nothing fetched
    blob = page.split('id="trace-data">', 1)[1].split("</script>", 1)[0]
    data = json.loads(blob.replace("<\\/", "</"))
    assert [m["commit_forward"] for m in data["models"]] == [m["commit_forward"] for m in trace["models"]]


def test_commit_figure_marks_slots_kinds_and_eos():
    m = {"name": "r", "decoder": "refusion", "nfe": 3, "tokens": [5, 6, 7, 8, 9], "pieces": list("abcd") + ["<e>"],
         "commit_forward": [0, 1, 1, 0, 2], "commit_kind": ["plan", "verify", "verify", "plan", "infill"],
         "forward_phase": ["plan", "verify", "infill"], "eos_at": 4, "group": {"name": "slot", "size": 3}}
    fig = trace_draw.commit_figure(m)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["plan (a slot's first token)", "global verify", "parallel infill", "slot (3 tokens)", "EOS"]
    outlines = [p for p in ax.patches if not p.get_fill()]
    assert [(p.get_x(), p.get_width(), p.get_y(), p.get_height()) for p in outlines] == [
        (-0.5, 3, 0.5, 2), (2.5, 2, 0.5, 3)]  # slot 0: forwards 1-2, slot 1: forwards 1-3
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "c", "d", "EOS"]
    assert [trace_draw.display(p) for p in (" x\n", "a\x02", "", "abcdefghij")] == ["·x↵", "a\\x02", "∅", "abcdefg…"]
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    cases = [(["--index", "3"], "--index needs --task"),
             (["--task", "nope"], "unknown task 'nope'"),
             (["--task", "embedded_math", "--index", "400"], "test items 0 to 399"),
             (["--run", "missing", "--task", "embedded_math"], "no run folder"),
             (["--prompt", "hi", "--models", "ar:gen_length=0"], "gen_length"),
             (["--prompt", "hi", "--name", "../x"], "plain folder name")]
    for args, want in cases:
        rc = trace_cmd.main(args + ["--out", str(tmp_path), "--runs-root", str(tmp_path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and want in err[0], (args, err)
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------- the page in a real browser

BROWSER = "/usr/bin/chromium"
DRIVER = "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")


@pytest.fixture()
def browser(tmp_path):
    """A headless Chromium driven by Selenium with a fresh profile; skipped (one line) without one."""
    missing = [p for p in (BROWSER, DRIVER) if not Path(p).is_file()]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("selenium (pip install -e '.[test]')")
    if missing:
        pytest.skip(f"no headless browser ({', '.join(missing)}): run `make browser-deps` "
                    "(apt-get install -y chromium chromium-driver)")
    profile = tmp_path / "chromium-profile"  # inside pytest's folder: nothing left in the temp directory
    options = webdriver.ChromeOptions()
    options.binary_location = BROWSER
    for flag in FLAGS + (f"--user-data-dir={profile}",):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def test_page_steps_with_the_arrow_keys_in_a_headless_browser(traced, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    folder, trace = traced
    browser.get((folder / "index.html").resolve().as_uri())
    body = browser.find_element(By.TAG_NAME, "body")
    last = max(m["nfe"] for m in trace["models"])

    def shown() -> tuple[int, dict[str, int]]:
        counts = {m["name"]: int(browser.find_element(By.CSS_SELECTOR, f'[data-model="{m["name"]}"] .count').text)
                  for m in trace["models"]}
        return int(browser.find_element(By.ID, "step").text), counts

    def expected(step: int) -> tuple[int, dict[str, int]]:
        return step, {m["name"]: trace_draw.committed(m, step) for m in trace["models"]}

    assert shown() == expected(0) and all(v == 0 for v in shown()[1].values())
    body.send_keys(Keys.ARROW_RIGHT)
    assert shown() == expected(1)
    body.send_keys(Keys.ARROW_RIGHT, Keys.ARROW_RIGHT)
    assert shown() == expected(3)
    body.send_keys(Keys.ARROW_LEFT)
    assert shown() == expected(2)
    body.send_keys(Keys.END)
    step, counts = shown()
    assert (step, counts) == expected(last) and counts == {m["name"]: len(m["tokens"]) for m in trace["models"]}
    cells = browser.find_elements(By.CSS_SELECTOR, '[data-model="refusion"] .c')
    ref = next(m for m in trace["models"] if m["name"] == "refusion")
    assert [c.text for c in cells] == [trace_draw.display(p, i == ref["eos_at"]) for i, p in enumerate(ref["pieces"])]
    body.send_keys(Keys.HOME)
    assert shown() == expected(0)
    assert {c.text for c in cells} == {trace_draw.MASK_GLYPH}


# ---------------------------------------------------------------- make report


def test_report_links_the_trace_a_run_logged(tmp_path, tiny_checkpoint):
    """A logged sample (the adapter's record, as a run journals it) becomes a figure and a page in the report."""
    from harness.run.lm_adapter import RefusionBenchLM
    from harness.report.paper_report import RunSet

    path = tiny_checkpoint("refusion")
    lm = RefusionBenchLM(pretrained=str(path), decoder="refusion", warmup=False, device="cpu",
                         **{**PRESETS["refusion"].knobs, "gen_length": 16})
    context = lm.apply_chat_template([{"role": "user", "content": QUERIES[1]}])
    rec = lm.decode_record(context, task="embedded_code")
    assert rec["commit_forward"] and len(rec["commit_forward"]) == len(rec["tokens"])
    run = tmp_path / "run"
    samples = run / "models" / "rf" / "samples"
    samples.mkdir(parents=True)
    row = {"task": "embedded_code", "doc_id": 0, "prompt": context, **rec}
    (samples / "embedded_code.jsonl").write_text(json.dumps(row) + "\n")
    rs = RunSet(runs=[], models=[{"name": "rf", "decoder": "refusion", "checkpoint": str(path)}],
                metrics={("rf", "embedded_code"): {"_run_dir": str(run)}})
    out = tmp_path / "report"
    text = trace_cmd.report_traces(rs, out)
    assert "## Decode traces" in text and "trace/embedded_code/index.html" in text and "trace/embedded_code/rf.png" in text
    assert {p.name for p in (out / "trace" / "embedded_code").iterdir()} == {"trace.json", "rf.png", "index.html"}
    links = re.findall(r"\]\(([^)]+)\)", text)
    assert links and all((out / link).is_file() for link in links), links  # it links only what it wrote
    # --no-traces (the committed reports): nothing drawn, no link, the command that draws the sample instead.
    plain = trace_cmd.report_traces(rs, tmp_path / "plain", draw=False)
    assert f"`make trace RUN={run} TASK=embedded_code INDEX=0`" in plain, plain
    assert "](" not in plain and not (tmp_path / "plain").exists()
    logged = json.loads((out / "trace" / "embedded_code" / "trace.json").read_text())
    assert logged["models"][0]["commit_forward"] == rec["commit_forward"]
    assert logged["models"][0]["eos_at"] == (len(rec["tokens"]) - 1 if rec["tokens"][-1] in lm.eos else None)
    samples.joinpath("embedded_code.jsonl").write_text(json.dumps({"task": "embedded_code", "doc_id": 0}) + "\n")
    assert trace_cmd.report_traces(rs, tmp_path / "again") == ""  # a run from before traces: no section
