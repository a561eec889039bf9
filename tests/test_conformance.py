"""The decoder conformance suite: every entry of ``refusion.decoding.DECODERS`` must keep the decoder
contract, on the tiny checkpoint of the attention it declares (docs/extending.md).

Parametrized over the registry itself, so registering a decoder is enough to put it under these
checks; no list here names a decoder. Each check is one test id ``test_conformance[<decoder>-<rule>]``
and fails with a message that names the decoder and the rule it breaks:

- ``counts``        NFE > 0 whenever tokens were generated, TPF = tokens / NFE, the phase counters add up;
- ``commit_log``    every generated position has exactly one committing forward, of a forward that happened;
- ``records``       KV peak bytes and timings (decode_s, forward_s) are recorded;
- ``batch``         a left-padded batch decodes exactly like its rows one by one (decoders that declare
                    ``batched``);
- ``seed``          the same seed gives the same tokens, also when sampling;
- ``eos``           EOS ends the answer: no EOS inside a row, and a row shorter than the budget ends with one;
- ``knobs``         an out-of-range value of any knob is rejected by one line naming the knob;
- ``nan``           NaN logits at one forward fail the call with ``NonFiniteLogits`` naming that forward, before
                    any token is committed from them (docs/design.md "Faults");
- ``budget``        on a model whose confidences never pass a threshold (all logits equal) the decoder still
                    ends within its forward budget (``common.forward_budget``), and with the budget cut to one
                    forward it stops with ``ForwardBudgetExceeded`` instead of decoding on.

The example decoder of docs/extending.md (examples/decoder_ltr_llada.py) runs the same checks, and a
deliberately broken decoder (it calls the model around the meter) shows that they catch it.
"""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from refusion.decoding import DECODERS, Decoder, DecoderContractError, make_knobs
from refusion.decoding.common import ForwardBudgetExceeded, Meter, NonFiniteLogits, cut_after_eos, eos_ids
from refusion.decoding.mdm import LladaKnobs

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[1]
QUERIES = ("Ana has 85 apples. Ana uses 22 apples. How many apples does Ana have now?",
           "Write a function add_two(x) that returns x plus 2.",
           "Which word has the most letters?\n(A) cat\n(B) mountain\n(C) sun\n(D) key")
GEN = 32  # the response budget of every check: small, and divisible by the default block and slot sizes
RULES = ("counts", "commit_log", "records", "batch", "seed", "eos", "knobs", "nan", "budget")


FAMILY_FIXTURES = {"diffusion_gemma": REPO / "tests" / "fixtures" / "released" / "diffusiongemma",
                   "llada2": REPO / "tests" / "fixtures" / "released" / "llada2"}


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    """causal -> (model, tokenizer): the tiny ReFusion checkpoint (causal) and the tiny MDM one (bidirectional);
    and family -> (model, tokenizer) for the decoders of a model class of their own (``Decoder.family``): the
    release-layout fixture of that family, loaded by the harness as a run loads it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harness.models.checkpoints import load_model

    out = {}
    for causal, name in ((True, "refusion"), (False, "mdm")):
        path = str(tiny_checkpoint(name))
        out[causal] = (AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path))
    for family, path in FAMILY_FIXTURES.items():
        loaded = load_model(path)
        out[family] = (loaded.model, loaded.tokenizer)
    return out


def model_of(entry: Decoder):
    """The key of ``models`` whose model decoder ``entry`` runs."""
    return entry.family if entry.family is not None else entry.causal


def _prompts(tok) -> list[torch.Tensor]:
    from refusion.tokenizer import encode_chat

    return [torch.tensor(encode_chat(tok, q)) for q in QUERIES]


def base_knobs(entry: Decoder, **extra) -> dict:
    """The decoder's defaults with the suite's budget (and ``extra``), where its knob class takes them."""
    names = set(entry.knobs.names())
    wanted = {k: v for k, v in {"gen_length": GEN, **extra}.items() if k in names}
    try:
        entry.knobs.of(wanted)
    except ValueError:  # the decoder's constraints refuse the suite's budget: its own defaults then
        wanted = {k: v for k, v in extra.items() if k in names}
    return wanted


class Conformance:
    """The checks of the module doc for one registered decoder; each raises AssertionError naming
    the decoder and the rule. Decodes through the raw ``fn``, so the suite does not lean on the
    registry's own runtime check (``refusion.decoding.check_result``)."""

    def __init__(self, name: str, entry: Decoder, model, tok, left_pad):
        self.name, self.entry, self.model, self.tok = name, entry, model, tok
        self.rows = _prompts(tok)
        self.ids, self.mask = left_pad(self.rows, tok.pad_token_id)
        self.knobs = base_knobs(entry)
        self._greedy = None

    def fail(self, rule: str, why: str) -> AssertionError:
        return AssertionError(f"decoder {self.name!r} breaks rule {rule!r}: {why}")

    def decode(self, ids, mask, knobs=None, **kw):
        tokens, stats = self.entry.fn(self.model, ids, mask, dict(self.knobs if knobs is None else knobs), **kw)
        if not isinstance(tokens, list) or not isinstance(stats, dict):
            raise self.fail("counts", "a decoder returns (list of 1-D token tensors, stats dict)")
        return tokens, stats

    def batch_call(self):
        """The greedy decode of the left-padded batch, made once and shared by the checks."""
        if self._greedy is None:
            self._greedy = self.decode(self.ids, self.mask)
        return self._greedy

    def counts(self) -> None:
        tokens, stats = self.batch_call()
        generated = sum(int(t.numel()) for t in tokens)
        nfe = stats.get("nfe")
        if not isinstance(nfe, int) or nfe < 0:
            raise self.fail("counts", f"stats['nfe'] must be a count of forwards, got {nfe!r}")
        if stats.get("generated_tokens") != generated:
            raise self.fail("counts", f"stats['generated_tokens'] {stats.get('generated_tokens')!r} != "
                                      f"{generated} returned tokens")
        if generated and nfe == 0:
            raise self.fail("counts", f"{generated} tokens generated with 0 counted forwards (the model was "
                                      "called around the meter: use refusion.decoding.common.forward)")
        if nfe and not math.isclose(stats.get("tpf", -1), generated / nfe, rel_tol=1e-12):
            raise self.fail("counts", f"tpf {stats.get('tpf')!r} != generated / nfe = {generated}/{nfe}")
        phases = {k[4:]: v for k, v in stats.items() if k.startswith("nfe_")}
        if not phases or sum(phases.values()) < nfe:
            raise self.fail("counts", f"the per-phase counts {phases} do not cover the {nfe} forwards")

    def commit_log(self) -> None:
        tokens, stats = self.batch_call()
        if "commit_forward" not in stats:
            raise self.fail("commit_log", "no commit log in stats (call meter.track, then settle/commit)")
        fwd, kind, nfe = stats["commit_forward"], stats["commit_kind"], stats["nfe"]
        if len(stats.get("forward_phase", ())) != nfe:
            raise self.fail("commit_log", f"forward_phase lists {len(stats.get('forward_phase', ()))} "
                                          f"forwards, nfe is {nfe}")
        for b, row in enumerate(tokens):
            if len(fwd[b]) != row.numel() or len(kind[b]) != row.numel():
                raise self.fail("commit_log", f"row {b}: {row.numel()} tokens but {len(fwd[b])} commit entries")
            bad = [c for c, f in enumerate(fwd[b]) if not 0 <= f < nfe]
            if bad:
                raise self.fail("commit_log", f"row {b}: positions {bad[:5]} have no forward that committed them")

    def records(self) -> None:
        _, stats = self.batch_call()
        kv, t = stats.get("kv_peak_bytes"), stats.get("timings") or {}
        if not isinstance(kv, int) or kv < 0:
            raise self.fail("records", f"kv_peak_bytes must be a byte count, got {kv!r}")
        d, f = t.get("decode_s"), t.get("forward_s")
        if not (isinstance(d, float) and isinstance(f, float) and 0 <= f <= d and d > 0):
            raise self.fail("records", f"timings must hold decode_s > 0 and 0 <= forward_s <= decode_s, got {t}")

    def batch(self) -> None:
        if not self.entry.batched:
            return  # the adapter feeds it one row at a time
        together, _ = self.batch_call()
        for b, row in enumerate(self.rows):
            alone, _ = self.decode(row[None], None)
            if not torch.equal(alone[0], together[b]):
                raise self.fail("batch", f"row {b} decodes to other tokens in a left-padded batch of "
                                         f"{len(self.rows)} than alone ({together[b].tolist()} vs {alone[0].tolist()})")

    def seed(self) -> None:
        sampling = {**self.knobs, **base_knobs(self.entry, temperature=0.8, seed=7)}
        ids = self.rows[0][None]
        first, _ = self.decode(ids, None, sampling)
        again, _ = self.decode(ids, None, sampling)
        if not torch.equal(first[0], again[0]):
            raise self.fail("seed", f"the same seed gave other tokens ({sampling})")

    def eos(self) -> None:
        own = list(eos_ids(self.model, None))
        greedy, _ = self.batch_call()
        # An EOS the greedy answers do reach, mid-answer: with it, the answers must end there.
        inner = [int(t) for row in greedy for t in row[1:-1] if int(t) not in own]
        stop = [max(set(inner), key=inner.count)] if inner else own
        for ids_eos, tokens in ((own, greedy), (stop, self.decode(self.ids, self.mask, eos_token_id=stop)[0])):
            for b, row in enumerate(tokens):
                hits = [i for i, t in enumerate(row.tolist()) if t in ids_eos]
                if hits and hits[0] != row.numel() - 1:
                    raise self.fail("eos", f"row {b} goes on after EOS {ids_eos} at position {hits[0]}")
                if row.numel() < self.knobs.get("gen_length", GEN) and not hits:
                    raise self.fail("eos", f"row {b} stops at {row.numel()} tokens without an EOS")
        if inner and not any(stop[0] in row.tolist() for row in tokens):
            raise self.fail("eos", f"with EOS {stop} (a token of its answers) no row ends at it")

    def knobs_rule(self) -> None:
        cls = self.entry.knobs
        kinds = {row["name"]: row["type"] for row in cls.describe()}
        for f in fields(cls):
            meta = f.metadata
            kind = kinds[f.name]
            if meta["choices"] is not None:
                bad = "no-such-choice"
            elif kind == "bool":
                bad = "maybe"
            elif meta["low"] is not None:
                bad = meta["low"] - 1
            elif meta["high"] is not None:
                bad = meta["high"] + 1
            else:
                continue  # an unbounded number or free text has no out-of-range value
            try:
                make_knobs(self.name, {f.name: bad})
            except ValueError as e:
                msg = str(e)
                if "\n" in msg or f.name not in msg:
                    raise self.fail("knobs", f"{f.name}={bad!r}: the error must be one line naming the knob, "
                                             f"got {msg!r}") from None
            else:
                raise self.fail("knobs", f"{f.name}={bad!r} (outside {meta['low']}..{meta['high']} / "
                                         f"{meta['choices']}) was accepted")

    def _hooked(self, hook):
        """The model with a forward hook on its output for one decode (a context manager)."""
        import contextlib

        @contextlib.contextmanager
        def ctx():
            handle = self.model.register_forward_hook(hook)
            try:
                yield
            finally:
                handle.remove()
        return ctx()

    def _encoder(self):
        """The encoder half of an encoder-decoder model (DiffusionGemma's ``model.model.encoder``, whose forwards
        write the cache and return no logits), else None."""
        inner = getattr(self.model, "model", None)
        return getattr(inner, "encoder", None)

    def nan(self) -> None:
        calls, at = [0], 2  # forwards so far (the encoder's too); NaN logits from the first one at `at` or later
        encoder = self._encoder()
        handle = encoder.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) if encoder else None

        def poison(_m, _a, out):
            calls[0] += 1
            if calls[0] >= at and not hit:
                hit.append(calls[0])
                out.logits = torch.full_like(out.logits, float("nan"))
            return out

        hit: list[int] = []
        with self._hooked(poison):
            try:
                self.decode(self.ids, self.mask)
            except NonFiniteLogits as e:
                at = hit[0]
                if e.forward != at or str(e) != f"non-finite logits at forward {at}":
                    raise self.fail("nan", f"NaN at forward {at} reported as {str(e)!r}") from None
                if sorted(e.rows) != list(range(len(self.rows))):
                    raise self.fail("nan", f"NaN in every row, rows {e.rows} reported") from None
                return
            finally:
                if handle is not None:
                    handle.remove()
        raise self.fail("nan", f"NaN logits at forward {at} went unnoticed: the call returned tokens")

    def budget(self) -> None:
        from refusion.decoding import common

        def flat(_m, _a, out):
            out.logits = torch.zeros_like(out.logits)  # every confidence 1/V: no threshold is ever passed
            return out

        knobs = make_knobs(self.name, self.knobs)
        gen, steps = knobs.gen_length, getattr(knobs, "steps", None)
        bound = common.forward_budget(len(self.rows), gen, steps)
        with self._hooked(flat):
            tokens, stats = self.decode(self.ids, self.mask)
            if stats["nfe"] > bound:
                raise self.fail("budget", f"{stats['nfe']} forwards, over the budget {bound}")
            saved = common.FORWARDS_PER_TOKEN, common.FORWARDS_EXTRA
            common.FORWARDS_PER_TOKEN, common.FORWARDS_EXTRA = 0, 1
            try:
                self.decode(self.ids, self.mask)
            except ForwardBudgetExceeded as e:
                if e.budget != len(self.rows):
                    raise self.fail("budget", f"a budget of 1 forward a row stopped at {e.budget}") from None
                return
            finally:
                common.FORWARDS_PER_TOKEN, common.FORWARDS_EXTRA = saved
        raise self.fail("budget", "a budget of one forward a row did not stop the call (no Meter.track?)")

    def run(self, rule: str) -> None:
        getattr(self, "knobs_rule" if rule == "knobs" else rule)()


def check_all(name: str, entry: Decoder, models, left_pad, rules=RULES, suites: dict | None = None) -> None:
    """Run ``rules`` on decoder ``name``; ``suites`` keeps one Conformance per entry (its greedy decode) across calls."""
    suites = {} if suites is None else suites
    key = (name, id(entry))
    if key not in suites:
        suites[key] = Conformance(name, entry, *models[model_of(entry)], left_pad)
    for rule in rules:
        suites[key].run(rule)


@pytest.fixture(scope="module")
def suites():
    return {}


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("name", sorted(DECODERS))
def test_conformance(name, rule, models, suites, left_pad):
    check_all(name, DECODERS[name], models, left_pad, (rule,), suites)


# ---------------------------------------------------------------- the suite catches a broken decoder


def _skips_meter(model, input_ids, attention_mask=None, knobs=None, *, eos_token_id=None, mask_token_id=None,
                 **overrides):
    """A greedy left-to-right decoder that calls ``model(...)`` directly: its forwards go uncounted."""
    k = LladaKnobs.of(knobs, overrides, "skips_meter")
    eos = eos_ids(model, eos_token_id)
    meter = Meter(model, ("step",))
    x = input_ids
    for _ in range(k.gen_length):
        logits = model(input_ids=x, attention_mask=None).logits[:, -1]  # around the meter
        x = torch.cat([x, logits.argmax(-1, keepdim=True)], 1)
    responses = [cut_after_eos(row, eos) for row in x[:, input_ids.shape[1]:]]
    return responses, meter.finish(responses)


def test_a_decoder_that_skips_the_meter_fails_the_suite_and_the_run(models, monkeypatch, left_pad):
    entry = Decoder(name="skips_meter", fn=_skips_meter, knobs=LladaKnobs, batched=False, causal=True,
                    masked_diffusion=False)
    monkeypatch.setitem(DECODERS, "skips_meter", entry)
    with pytest.raises(AssertionError, match=r"decoder 'skips_meter' breaks rule 'counts': \d+ tokens generated "
                                             r"with 0 counted forwards"):
        check_all("skips_meter", entry, models, left_pad, ("counts",))
    # At run time the registry refuses its result instead of reporting a TPF of 0.
    model, tok = models[True]
    ids = _prompts(tok)[0][None]
    with pytest.raises(DecoderContractError, match="decoder 'skips_meter' .* with 0 counted forwards"):
        DECODERS["skips_meter"](model, ids, None, {"gen_length": 4, "block_length": 4})


def test_registration_states_every_flag():
    entry = DECODERS["llada"]
    with pytest.raises(TypeError):
        Decoder(name="x", fn=entry.fn, knobs=entry.knobs)  # batched / causal / masked_diffusion missing
    with pytest.raises(TypeError, match="causal must be True or False"):
        Decoder(name="x", fn=entry.fn, knobs=entry.knobs, batched=True, causal=None, masked_diffusion=True)
    from refusion.decoding import register

    with pytest.raises(ValueError, match="already registered"):
        register("llada", entry.fn, entry.knobs, batched=True, causal=False, masked_diffusion=True)


# ---------------------------------------------------------------- docs/extending.md's example decoder


@pytest.fixture
def example_decoder(load_example):
    """docs/extending.md's decoder, registered as its file says; unregistered afterwards."""
    example = load_example("decoder_ltr_llada")
    assert "ltr_llada" not in DECODERS
    try:
        yield example.register_example()
    finally:
        DECODERS.pop("ltr_llada", None)


def test_example_decoder_passes_the_suite(models, example_decoder, left_pad):
    entry = example_decoder
    # The registry line docs/extending.md and the example's docstring give is the one the example runs.
    line = ('register("ltr_llada", ltr_llada, LtrLladaKnobs, batched=True, causal=False, '
            'masked_diffusion=True)')
    assert line in (REPO / "docs" / "extending.md").read_text(encoding="utf-8")
    assert line in (REPO / "examples" / "decoder_ltr_llada.py").read_text(encoding="utf-8")
    assert DECODERS["ltr_llada"] is entry and entry.masked_diffusion and not entry.causal
    check_all("ltr_llada", entry, models, left_pad)
    # It really is left to right: each forward commits the leftmost masked position (one token per step).
    model, tok = models[False]
    _, stats = DECODERS["ltr_llada"](model, _prompts(tok)[0][None], None, {"gen_length": 16, "block_length": 8})
    f = stats["commit_forward"][0]
    assert f == sorted(f) and len(set(f)) == len(f)
