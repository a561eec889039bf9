"""Drawings of decode traces (``harness trace``): how each decoder filled one answer, forward by forward.

A trace (``trace.json``, built by harness/report/trace.py) holds the prompt and, per model, its answer's
tokens with their display text and, per token, the forward that committed it
(``commit_forward``, 0-based call order) and that step's kind (``commit_kind``), plus the phase
of every forward (``forward_phase``): the decoders' stats (refusion/decoding/common.py CommitLog).
Shown as "after forward k of NFE" (k = forwards done), so a token committed by forward index i
appears at k = i + 1.

- ``commit_figure``: token position x forward, each token coloured by the step that committed
  it, ReFusion slots outlined, block boundaries of the block decoders dashed, EOS starred;
- ``write_gif``: the answer filling in, one frame per forward (masked positions as a mask glyph),
  one model or several stacked on one clock (one frame per forward of the slowest);
- ``html_page``: one self-contained page (inline CSS and JS, the trace embedded as JSON, nothing
  fetched) stepping through the forwards with the arrow keys.
matplotlib (Agg) and Pillow only.
"""

from __future__ import annotations

import json
import math
from html import escape
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.collections import PatchCollection  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

DPI = 90
MASK_GLYPH = "▒"  # a position not committed yet
MASK_COLOUR = "#e4e4e4"
# commit kind -> (legend label, colour); kinds are the decoders' phases (refusion/decoding/*.py)
KINDS = {
    "plan": ("plan (a slot's first token)", "#4c72b0"),
    "verify": ("global verify", "#55a868"),
    "infill": ("parallel infill", "#dd8452"),
    "prefill": ("prefill", "#8172b3"),
    "step": ("step", "#64b5cd"),
    "full": ("full forward", "#c44e52"),
    "cached": ("cached forward", "#da8bc3"),
    "denoise": ("denoise (the token holds from here)", "#55a868"),
}
OTHER_COLOURS = ("#937860", "#8c8c8c", "#ccb974")
# forward phase -> what the page and the GIF titles call it
PHASES = {"verify": "global verify", "draft": "infill draft", "infill": "infill verify",
          "encode": "encoder (cache write)", "denoise": "denoise step", "store": "store (block KV write)"}


def display(piece: str, eos: bool = False) -> str:
    """A token's text for a cell: EOS as such, whitespace made visible, at most 8 characters."""
    if eos:
        return "EOS"
    s = piece.replace("\n", "↵").replace("\t", "→").replace(" ", "·") or "∅"
    s = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in s)  # control bytes: no glyph, no layout
    return s if len(s) <= 8 else s[:7] + "…"


def colour(kind: str) -> str:
    if kind in KINDS:
        return KINDS[kind][1]
    return OTHER_COLOURS[sum(map(ord, kind)) % len(OTHER_COLOURS)]


def faded(hex_colour: str, keep: float = 0.45) -> str:
    """The colour mixed with white (a token committed by an earlier forward)."""
    rgb = [int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(keep * c + (1 - keep) * 255):02x}" for c in rgb)


def label(kind: str) -> str:
    return KINDS[kind][0] if kind in KINDS else kind


def phase_name(phase: str) -> str:
    return "+".join(PHASES.get(p, p) for p in phase.split("+"))


def groups(m: dict) -> list[tuple[int, int]]:
    """[start, end) position ranges of the model's slots or blocks, cut at the answer's end."""
    g, n = m.get("group"), len(m["tokens"])
    if not g or g["size"] < 1:
        return []
    first = min(g.get("offset") or 0, n)  # a first block that began in the prompt (llada2, sdar)
    return ([(0, first)] if first else []) + [(a, min(a + g["size"], n)) for a in range(first, n, g["size"])]


def committed(m: dict, k: int) -> int:
    """Tokens committed after k forwards."""
    return sum(1 for f in m["commit_forward"] if f < k)


# ---------------------------------------------------------------- static figure


def commit_figure(m: dict) -> Figure:
    """Token position (x) against the forward that committed it (y, forward 1 at the top)."""
    n, nfe = len(m["tokens"]), max(1, m["nfe"])
    fwd = [f + 1 for f in m["commit_forward"]]  # forward number: 1 = the first model call
    fig, ax = plt.subplots(figsize=(min(11.0, max(6.0, 2.6 + 0.15 * n)), min(7.5, max(3.2, 1.9 + 0.1 * nfe))),
                           dpi=DPI, layout="constrained")
    cells = [Rectangle((i - 0.45, f - 0.45), 0.9, 0.9) for i, f in enumerate(fwd)]
    ax.add_collection(PatchCollection(cells, facecolors=[colour(k) for k in m["commit_kind"]], edgecolors="none"))
    handles = [Patch(color=colour(k), label=label(k)) for k in dict.fromkeys(m["commit_kind"])]
    g = m.get("group")
    if g and g["name"] == "slot":  # each slot's tokens, from its first commit to its last
        for a, b in groups(m):
            lo, hi = min(fwd[a:b]), max(fwd[a:b])
            ax.add_patch(Rectangle((a - 0.5, lo - 0.5), b - a, hi - lo + 1, fill=False, edgecolor="black", lw=0.9))
        handles.append(Patch(facecolor="none", edgecolor="black", label=f"slot ({g['size']} tokens)"))
    elif g and len(groups(m)) > 1:  # blocks decoded left to right: their boundaries
        for a, _ in groups(m)[1:]:
            ax.axvline(a - 0.5, color="0.4", ls="--", lw=0.8)
        handles.append(Line2D([], [], color="0.4", ls="--", lw=0.8, label=f"{g['name']} boundary ({g['size']})"))
    if m.get("eos_at") is not None:
        e = m["eos_at"]
        ax.plot([e], [fwd[e]], marker="*", ms=11, color="#d62728", mec="black", mew=0.5, ls="none")
        handles.append(Line2D([], [], marker="*", ms=9, color="#d62728", mec="black", mew=0.5, ls="none", label="EOS"))
    ax.set_xlim(-0.8, max(n, 1) - 0.2)
    ax.set_ylim(nfe + 0.8, 0.2)  # time runs down
    if 0 < n <= 72:  # the token texts as x labels
        ax.set_xticks(range(n), [display(p, i == m.get("eos_at")) for i, p in enumerate(m["pieces"])],
                      rotation=90, fontsize=6, family="monospace")
        ax.set_xlabel("response token (position order)")
    else:
        ax.set_xlabel("response token position")
    ax.set_ylabel("forward (1 = first model call)")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.grid(True, axis="y", alpha=0.25)
    tpf = n / m["nfe"] if m["nfe"] else 0.0
    who = m["name"] if m["name"] == m["decoder"] else f"{m['name']} ({m['decoder']})"
    ax.set_title(f"{who}\n{n} tokens in {m['nfe']} forwards, {tpf:.2f} tokens/forward",
                 fontsize=9)
    ax.legend(handles=handles, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    return fig


# ---------------------------------------------------------------- animation

CELL_W, CELL_H = 0.62, 0.3  # inches per token cell
HEAD_H = 0.42  # inches of a board's title line


def columns(models: list[dict]) -> int:
    """Cells per line: 16, or a multiple of the smallest ReFusion slot up to 24 so slots do not wrap."""
    sizes = [m["group"]["size"] for m in models if m.get("group") and m["group"]["name"] == "slot"]
    longest = max((len(m["tokens"]) for m in models), default=1)
    base = 16
    if sizes and min(sizes) <= 24:
        base = min(sizes) * max(1, 16 // min(sizes))
    return max(1, min(base, longest))


class Board:
    """One model's answer as a grid of token cells on an Axes; ``show(k)`` sets it to after k forwards."""

    def __init__(self, ax, m: dict, cols: int):
        self.m, self.ax = m, ax
        n = len(m["tokens"])
        rows = max(1, math.ceil(n / cols))
        ax.set_xlim(0, cols)
        ax.set_ylim(rows, 0)
        ax.axis("off")
        self.cells, self.texts, self.state = [], [], [None] * n
        self.labels = [display(p, i == m.get("eos_at")) for i, p in enumerate(m["pieces"])]
        for i in range(n):
            r, c = divmod(i, cols)
            cell = Rectangle((c + 0.05, r + 0.09), 0.9, 0.82, facecolor=MASK_COLOUR, edgecolor="none", lw=1.4)
            ax.add_patch(cell)
            self.cells.append(cell)
            self.texts.append(ax.text(c + 0.5, r + 0.52, MASK_GLYPH, ha="center", va="center", fontsize=7,
                                      family="monospace", color="0.55"))
        if m.get("group") and m["group"]["name"] == "slot":  # outline every slot, one segment per line
            for a, b in groups(m):
                i = a
                while i < b:
                    r, c = divmod(i, cols)
                    w = min(b - i, cols - c)
                    ax.add_patch(Rectangle((c + 0.01, r + 0.03), w - 0.02, 0.94, fill=False, edgecolor="black",
                                           lw=0.8))
                    i += w
        self.title = ax.text(0.04, -0.12, "", ha="left", va="bottom", fontsize=8, family="monospace")

    def show(self, k: int) -> None:
        m = self.m
        for i, f in enumerate(m["commit_forward"]):
            state = "open" if f >= k else ("new" if f == k - 1 else "old")
            if state == self.state[i]:
                continue
            self.state[i] = state
            cell, text = self.cells[i], self.texts[i]
            if state == "open":
                cell.set_facecolor(MASK_COLOUR)
                cell.set_edgecolor("none")
                text.set_text(MASK_GLYPH)
                text.set_color("0.55")
            else:  # committed by this forward: full colour, edged; by an earlier one: faded
                kind = colour(m["commit_kind"][i])
                cell.set_facecolor(kind if state == "new" else faded(kind))
                edge = "#d62728" if i == m.get("eos_at") else ("black" if state == "new" else "none")
                cell.set_edgecolor(edge)
                text.set_text(self.labels[i])
                text.set_color("black")
        done = min(k, m["nfe"])
        phase = phase_name(m["forward_phase"][done - 1]) if 0 < done <= len(m["forward_phase"]) else "-"
        state = "done" if k >= m["nfe"] else phase
        who = m["name"] if m["name"] == m["decoder"] else f"{m['name']} ({m['decoder']})"
        self.title.set_text(f"{who}  forward {done}/{m['nfe']} [{state}]  "
                            f"{committed(m, k)}/{len(m['tokens'])} tokens")


def _grab(fig):
    from PIL import Image

    fig.canvas.draw()
    w, h = fig.canvas.get_width_height()
    return Image.frombuffer("RGBA", (w, h), bytes(fig.canvas.buffer_rgba()), "raw", "RGBA", 0, 1).convert("RGB")


def write_gif(models: list[dict], path: Path, fps: float = 4.0, hold_s: float = 2.0) -> int:
    """One frame per forward of the slowest model (all on one clock), the last held `hold_s`; returns the
    frame count. Frames are rendered by matplotlib and written by Pillow with one shared palette."""
    from PIL import Image

    cols = columns(models)
    grids = [CELL_H * max(1, math.ceil(len(m["tokens"]) / cols)) for m in models]  # inches
    width, height = 0.3 + CELL_W * cols, 0.1 + sum(HEAD_H + g for g in grids)
    fig = plt.figure(figsize=(width, height), dpi=DPI)
    boards, y = [], height - 0.05  # y: the next board's top, inches from the bottom
    for m, g in zip(models, grids):
        y -= HEAD_H + g
        ax = fig.add_axes((0.15 / width, y / height, CELL_W * cols / width, g / height))
        boards.append(Board(ax, m, cols))
    steps = max(1, max(m["nfe"] for m in models))
    frames = []
    for k in range(1, steps + 1):
        for b in boards:
            b.show(k)
        frames.append(_grab(fig))
    plt.close(fig)
    # One palette for every frame: from the first and the last frame plus a swatch of every cell colour
    # (a kind's full colour may show in intermediate frames only).
    fills = [MASK_COLOUR, "#d62728"] + [c for m in models for k in dict.fromkeys(m["commit_kind"])
                                        for c in (colour(k), faded(colour(k)))]
    w, h = frames[0].size
    probe = Image.new("RGB", (w, 2 * h + 24), "white")
    probe.paste(frames[0], (0, 0))
    probe.paste(frames[-1], (0, h))
    for j, fill in enumerate(fills):
        probe.paste(fill, (j * 24 % w, 2 * h, j * 24 % w + 24, 2 * h + 24))
    palette = probe.quantize(colors=96, method=Image.Quantize.MEDIANCUT)
    images = [f.quantize(palette=palette, dither=Image.Dither.NONE) for f in frames]
    step_ms = int(round(1000 / fps))
    durations = [step_ms] * (len(images) - 1) + [max(step_ms, int(hold_s * 1000))]
    path.parent.mkdir(parents=True, exist_ok=True)
    images[0].save(path, save_all=True, append_images=images[1:], duration=durations, loop=0, optimize=False)
    return len(images)


# ---------------------------------------------------------------- the page


def page_data(trace: dict) -> dict:
    """What the page's script reads: per model, its cells and commit order (no token ids)."""
    keep = ("name", "decoder", "nfe", "commit_forward", "commit_kind", "forward_phase", "eos_at", "group")
    models = []
    for m in trace["models"]:
        d = {k: m.get(k) for k in keep}
        d["text"] = [display(p, i == m.get("eos_at")) for i, p in enumerate(m["pieces"])]
        d["phase_names"] = [phase_name(p) for p in m["forward_phase"]]
        models.append(d)
    kinds = list(dict.fromkeys(k for m in trace["models"] for k in m["commit_kind"]))
    return {"models": models, "kinds": {k: {"label": label(k), "colour": colour(k)} for k in kinds},
            "mask": MASK_GLYPH}


PAGE_CSS = """
body{font-family:system-ui,sans-serif;margin:1.2em;color:#222;max-width:70em}
h1{font-size:1.25em;margin:0 0 .4em}
details{margin:.3em 0 .8em}pre{white-space:pre-wrap;background:#f6f6f6;padding:.5em;font-size:.85em}
#bar{position:sticky;top:0;background:#fff;padding:.4em 0;border-bottom:1px solid #ddd;z-index:1}
#bar b{font-size:1.1em}.keys{color:#666;font-size:.85em;margin-left:1em}
.legend span{display:inline-block;margin-right:1em;font-size:.85em}
.legend i{display:inline-block;width:.9em;height:.9em;margin-right:.3em;vertical-align:-.1em}
.board{margin:.9em 0}.head{font-family:ui-monospace,monospace;font-size:.9em;margin-bottom:.25em}
.cells{display:flex;flex-wrap:wrap;gap:2px}
.grp{display:flex;flex-wrap:wrap;gap:2px;padding:1px}.grp.slot{outline:1.5px solid #222}
.grp.block{outline:1px dashed #888}
.c{font-family:ui-monospace,monospace;font-size:12px;min-width:3.2em;padding:2px 3px;text-align:center;
  background:#e4e4e4;color:#999;border-radius:2px;white-space:pre}
.c.done{color:#000}.c.new{box-shadow:0 0 0 2px #000 inset}
.c.done.eos{outline:2px solid #d62728}
"""

PAGE_JS = """
const data = JSON.parse(document.getElementById('trace-data').textContent);
const last = Math.max(1, ...data.models.map(m => m.nfe));
let step = 0;
const kind = k => data.kinds[k] || {label: k, colour: '#999'};
const boards = document.getElementById('boards');
const legend = document.getElementById('legend');
for (const [k, v] of Object.entries(data.kinds)) {
  const s = document.createElement('span');
  const i = document.createElement('i'); i.style.background = v.colour;
  s.append(i, v.label); legend.append(s);
}
const views = data.models.map(m => {
  const div = document.createElement('div'); div.className = 'board'; div.dataset.model = m.name;
  const head = document.createElement('div'); head.className = 'head';
  const cells = document.createElement('div'); cells.className = 'cells';
  const size = m.group ? m.group.size : 0;
  let holder = cells; const spans = [];
  m.text.forEach((t, i) => {
    if (size && i % size === 0) {
      holder = document.createElement('div');
      holder.className = 'grp ' + (m.group.name === 'slot' ? 'slot' : 'block'); cells.append(holder);
    }
    const c = document.createElement('span'); c.className = 'c' + (i === m.eos_at ? ' eos' : '');
    c.title = 'position ' + i + ': ' + kind(m.commit_kind[i]).label + ', forward ' + (m.commit_forward[i] + 1);
    holder.append(c); spans.push(c);
  });
  head.innerHTML = '<b></b> forward <span class="fwd"></span>/' + m.nfe + ' <span class="phase"></span>'
    + ' &middot; <span class="count"></span>/' + m.text.length + ' tokens committed';
  head.querySelector('b').textContent = m.name === m.decoder ? m.name : m.name + ' (' + m.decoder + ')';
  div.append(head, cells); boards.append(div);
  return {m, head, spans};
});
function render() {
  document.getElementById('step').textContent = step;
  for (const {m, head, spans} of views) {
    const k = Math.min(step, m.nfe);
    let n = 0;
    m.commit_forward.forEach((f, i) => {
      const c = spans[i];
      if (f < step) {
        n++;
        c.textContent = m.text[i];
        // committed by this forward: full colour; by an earlier one: faded (alpha), the text stays black
        c.style.background = kind(m.commit_kind[i]).colour + (f === step - 1 ? '' : '70');
        c.classList.add('done'); c.classList.toggle('new', f === step - 1);
      } else {
        c.textContent = data.mask; c.style.background = ''; c.classList.remove('done', 'new');
      }
    });
    head.querySelector('.fwd').textContent = k;
    head.querySelector('.count').textContent = n;
    head.querySelector('.phase').textContent = step >= m.nfe ? '[done]' : (k ? '[' + m.phase_names[k - 1] + ']' : '');
  }
}
document.addEventListener('keydown', e => {
  const moves = {ArrowRight: 1, ArrowDown: 1, ArrowLeft: -1, ArrowUp: -1, PageDown: 10, PageUp: -10};
  if (e.key in moves) step = Math.min(last, Math.max(0, step + moves[e.key]));
  else if (e.key === 'Home') step = 0;
  else if (e.key === 'End') step = last;
  else return;
  e.preventDefault(); render();
});
document.getElementById('last').textContent = last;
render();
"""


def html_page(trace: dict) -> str:
    """The self-contained page: the trace as JSON in a script tag ('</' escaped), CSS and JS inline."""
    blob = json.dumps(page_data(trace), ensure_ascii=True).replace("</", "<\\/").replace("<!--", "<\\!--")
    title = f"Decode trace: {trace.get('source') or 'one prompt'}"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>
<style>{PAGE_CSS}</style></head>
<body>
<h1>{escape(title)}</h1>
<details><summary>prompt</summary><pre>{escape(trace.get('prompt', ''))}</pre></details>
<div id="bar">after forward <b id="step">0</b> of <span id="last"></span>
<span class="keys">&larr; &rarr; one forward, PgUp/PgDn ten, Home/End first/last</span>
<div class="legend" id="legend"></div></div>
<div id="boards"></div>
<script type="application/json" id="trace-data">{blob}</script>
<script>{PAGE_JS}</script>
</body></html>
"""


def write_all(trace: dict, folder: Path, gifs: bool = True, fps: float = 4.0) -> list[str]:
    """Every drawing of one trace into `folder` (a fresh folder: the caller swaps it in): a PNG per model,
    with `gifs` a GIF per model and all.gif, and index.html. Returns the file names written."""
    import warnings

    from harness.run.store import atomic_save_figure, atomic_write_text

    written = []
    with warnings.catch_warnings():  # a token text the font lacks a glyph for draws as a box: not worth a warning
        warnings.filterwarnings("ignore", message="Glyph .* missing from font")
        for m in trace["models"]:
            atomic_save_figure(commit_figure(m), folder / f"{m['name']}.png", dpi=DPI)
            written.append(f"{m['name']}.png")
            if gifs:
                write_gif([m], folder / f"{m['name']}.gif", fps)
                written.append(f"{m['name']}.gif")
        if gifs and len(trace["models"]) > 1:
            write_gif(trace["models"], folder / "all.gif", fps)
            written.append("all.gif")
    atomic_write_text(folder / "index.html", html_page(trace))
    written.append("index.html")
    return written
