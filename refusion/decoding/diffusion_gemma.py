"""DiffusionGemma block diffusion (google/diffusiongemma-26B-A4B-it on transformers'
``DiffusionGemmaForBlockDiffusion``): the loop of transformers' own
``DiffusionGemmaGenerationMixin.generate`` (src/transformers/models/diffusion_gemma/
generation_diffusion_gemma.py, 5.24.0), written as this project's decoders are (docs/design.md
§4b).

The model has two halves that share their weights: a causal *encoder* that writes the KV cache of
everything before the current block, and a bidirectional *decoder* that reads that cache (never writes
it) and predicts a whole block, the *canvas*, at once. Per canvas of ``canvas_length`` tokens:

  encode    one encoder forward of the tokens not yet in the cache (the prompt, then the previous
            canvas) -- ``model.model.encoder``, as generate's step 1.a;
  start     a canvas of uniformly random tokens over the whole vocabulary (there is no mask token);
  denoise   at most ``max_denoising_steps`` decoder forwards, the step counter n running N..1:
            logits / T(n) with T(n) = t_min + (t_max - t_min) n / N (float32, as the logits processor);
            a sampled canvas (multinomial) and the argmax canvas; the sampled tokens of lowest entropy
            are accepted while (sum of their entropies) - (the largest) <= ``entropy_bound`` (always at
            least one); every other position is re-drawn uniformly at random; the step's tempered logits
            condition the next step (self-conditioning);
  stop      a row stops denoising once its argmax canvas equals each of the last
            ``stability_threshold`` ones and the mean token entropy is below ``confidence_threshold``;
  commit    the canvas is the last *argmax* canvas; an EOS in it ends the row (tokens after the first EOS
            are dropped), otherwise the next canvas starts.

The budget: ceil(gen_length / canvas_length) canvases, as generate decodes for max_new_tokens; a response
is cut to gen_length tokens (generate returns whole canvases, so its tokens past the budget are dropped).

Why a reimplementation and not generate driven by hooks: generate draws the random canvas and the samples
of the whole batch from one global stream, and gives a left-padded row shifted positions (one shared
arange), so a row's tokens depend on its batch; here each row draws from its own generator (seeded
``seed``) in exactly the order generate draws for that row alone, and positions count from each row's
first real token -- a row decodes the same alone or in any batch, and equals generate on that row alone,
seed for seed. Rows that ended leave the batch at the next canvas (their cache rows dropped). And the
forwards are counted here, encoder and decoder apart (generate's tokens_per_forward counts the decoder's
only).

Compile (the knob ``compile``, docs/design.md §6a): the pieces transformers' generate compiles -- each canvas's
encoder forward and the decoder forward, over a static cache (``static_cache``) -- run under torch.compile; the
prompt's encode stays eager. Refused where a static cache cannot replay the eager decode: a cached context past
the sliding window less one, a canvas length other than the model's.

Counting (docs/design.md §6 and §4b): phases ``encode`` and ``denoise``; NFE = both; TPF =
generated tokens / NFE. A token is committed by the decoder forward from which its position's argmax held
to the canvas's end. Extra stats: canvas_length, canvases (row canvases decoded), denoise_steps (decoder
steps per row canvas, summed), early_stops (row canvases the adaptive stop ended before the step cap), and
tpf_decoder (generated tokens / decoder forwards: generate's own figure for a batch of one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, StaticLayer

from .block_loop import BlockGrid, BlockRule, BlockRun, decode_blocks
from .common import KnobLimit, Meter, counted_call
from .compiled import capacity_bucket, compiled_module_call
from .knobs import Knobs, compile_knob, gen_length, knob, seed
from .proposals import make_generator
from .tokens import eos_ids, positions_from_mask

# transformers' DiffusionGemmaGenerationConfig._get_default_generation_params (generation_diffusion_gemma.py
# :219-235), the defaults generate applies where neither the call nor generation_config.json sets a value.
DEFAULT_STEPS, DEFAULT_BOUND, DEFAULT_T_MIN, DEFAULT_T_MAX = 48, 0.1, 0.4, 0.8
DEFAULT_STABILITY, DEFAULT_CONFIDENCE = 1, 0.005


@dataclass(frozen=True)
class DiffusionGemmaKnobs(Knobs):
    """Knobs of ``diffusion_gemma``, named as DiffusionGemmaGenerationConfig's fields (entropy_bound is its
    sampler_config.entropy_bound). Defaults: transformers' (module constants); a checkpoint's own
    generation_config.json values are applied by the harness (``FOLDER_KNOBS``)."""
    gen_length: int = gen_length(256)
    canvas_length: int | None = knob(None, "tokens per canvas (block); none = the model's config.canvas_length "
                                     "(256 released); a budget that is no multiple of it is decoded in whole "
                                     "canvases, as generate does, and cut to gen_length", low=1, optional=True)
    max_denoising_steps: int = knob(DEFAULT_STEPS, "decoder forwards per canvas at most (N)", low=1)
    entropy_bound: float = knob(DEFAULT_BOUND, "accept the sampled tokens of lowest entropy while their entropy "
                                "sum minus the largest stays <= this (> 0); higher = more tokens per step",
                                low=0.0)
    t_min: float = knob(DEFAULT_T_MIN, "temperature at the last denoising step", low=0.0)
    t_max: float = knob(DEFAULT_T_MAX, "temperature at the first denoising step (> t_min); linear in between",
                        low=0.0)
    stability_threshold: int = knob(DEFAULT_STABILITY, "adaptive stop: the argmax canvas must equal the last this "
                                    "many (0 = always stable)", low=0)
    confidence_threshold: float = knob(DEFAULT_CONFIDENCE, "adaptive stop: the mean token entropy (nats) must be "
                                       "below this (> 0)", low=0.0)
    seed: int = seed()
    compile: bool = compile_knob()

    def check(self) -> None:
        if self.entropy_bound <= 0:
            raise ValueError(f"entropy_bound must be > 0, got {self.entropy_bound}")
        if self.confidence_threshold <= 0:
            raise ValueError(f"confidence_threshold must be > 0, got {self.confidence_threshold}")
        if self.t_max <= self.t_min:
            raise ValueError(f"t_max must be > t_min {self.t_min}, got {self.t_max}")


# The knobs a DiffusionGemma folder sets for itself: config.json's canvas_length and the
# DiffusionGemmaGenerationConfig fields of its generation_config.json (sampler_config.entropy_bound as
# entropy_bound). Read by ``knobs.folder_knobs`` through the registry.
FOLDER_KNOBS = {"config.json": {"canvas_length": "canvas_length"},
                "generation_config.json": {**{k: k for k in ("max_denoising_steps", "t_min", "t_max",
                                                             "stability_threshold", "confidence_threshold")},
                                           "entropy_bound": "sampler_config.entropy_bound"}}


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Token entropy [..] of logits [.., V], as transformers computes it (torch.distributions.Categorical)."""
    return torch.distributions.Categorical(logits=logits).entropy()


def accept_mask(ent: torch.Tensor, bound: float) -> torch.Tensor:
    """bool [B, L]: the positions the entropy-bound sampler accepts (EntropyBoundSampler.accept_canvas,
    generation_diffusion_gemma.py:438-447), given their token entropies ``ent`` [B, L] (``entropy`` of the tempered
    logits): by ascending entropy, while the cumulative entropy minus the current (largest so far) entropy is
    <= bound -- so the lowest-entropy token always."""
    sorted_ent, order = torch.sort(ent, dim=-1, descending=False)
    chosen = torch.cumsum(sorted_ent, dim=-1) - sorted_ent <= bound
    return torch.scatter(torch.zeros_like(chosen), -1, order, chosen)


def temperature(t_min: float, t_max: float, step: int, steps: int) -> torch.Tensor:
    """T(step) of LinearTemperatureScheduleLogitsProcessor (generation_diffusion_gemma.py:316), with the step an
    int32 tensor as _denoising_step passes it (:1022): a float32 scalar, so the division rounds as generate's."""
    n = torch.tensor(step, dtype=torch.int32)
    return t_min + ((t_max - t_min) * (n / steps))


class _Rows:
    """The per-row random streams: row b draws its canvases and samples from generator ``gens[b]`` (None = the
    global one), in the order generate draws them for that row alone."""

    def __init__(self, gens: list[torch.Generator | None], vocab: int, length: int, device: torch.device):
        self.gens, self.vocab, self.length, self.device = gens, vocab, length, device

    def canvas(self, rows: list[int]) -> torch.Tensor:
        """[len(rows), L] uniform random tokens (EntropyBoundSampler.initialize_canvas, :395-405)."""
        return torch.cat([torch.randint(0, self.vocab, (1, self.length), device=self.device, generator=self.gens[b])
                          for b in rows])

    def sample(self, probs: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """probs [len(rows), L, V] -> [len(rows), L] one multinomial draw per position (:1043-1044)."""
        return torch.stack([torch.multinomial(probs[i], 1, generator=self.gens[b]).squeeze(-1)
                            for i, b in enumerate(rows)])


class DiffusionGemmaRule(BlockRule):
    """DiffusionGemma's step rule for the shared block loop (block_loop.decode_blocks): the encoder writes the
    prompt's KV, then each canvas's once a next canvas reads it (``store_late``); a canvas starts random and is
    denoised by the decoder (``_denoise``); its last argmax canvas is the block."""
    phases = ("encode", "denoise")
    aligned = False  # a canvas starts right after the prompt
    store_late = True
    fill = None  # no mask token: the rule draws the canvas

    def __init__(self, k: DiffusionGemmaKnobs, model):
        self.k, self.gen_length, self.compile = k, k.gen_length, k.compile
        self.size = int(k.canvas_length or model.config.canvas_length)
        self.n_canvas = -(-k.gen_length // self.size)  # whole canvases, as generate (:652)
        self.vocab = int(model.config.get_text_config().vocab_size)
        self.rng: _Rows | None = None
        self.counts = {"canvases": 0, "denoise_steps": 0, "early_stops": 0}

    def budget(self, grid: BlockGrid) -> tuple[int, int | None]:
        return self.gen_length, self.n_canvas * self.k.max_denoising_steps

    def start(self, run: BlockRun, input_ids: torch.Tensor, pad: torch.Tensor) -> None:
        self.rng = _Rows([make_generator(run.device, self.k.seed) for _ in run.live], self.vocab, self.size,
                         run.device)
        text = run.model.config.get_text_config(decoder=True)
        if self.compile:  # the prompt and every canvas a next one reads, in one static cache
            if self.size != run.model.config.canvas_length:  # the model's static decoder mask is that wide
                raise KnobLimit(f"compile: canvas_length {self.size} must be the model's config.canvas_length "
                                 f"({run.model.config.canvas_length}); decode without compile")
            run.cache = static_cache(text, input_ids.shape[1] + (self.n_canvas - 1) * self.size)
        else:
            run.cache = DynamicCache(config=text)
        run.seen = pad.bool()  # [B, P] the 2-D mask of the cache
        # the prompt's encode runs eagerly under compile too (its length varies), as transformers' generate does
        _encode(run.model, run.meter, run.cache, input_ids, run.seen, positions_from_mask(pad), compiled=False)

    def decide(self, run: BlockRun, j: int, block: torch.Tensor | None) -> torch.Tensor:
        """Start (1.b), denoise (1.c) and commit (1.d) canvas j of the live rows: its last argmax canvas."""
        argmax, held, ran = _denoise(run.model, run.meter, run.cache, run.seen, run.pos, run.live, self.rng, self.k)
        self.counts["canvases"] += len(run.live)
        self.counts["denoise_steps"] += int(ran.sum())
        self.counts["early_stops"] += int((ran < self.k.max_denoising_steps).sum())
        length = self.size
        for i, b in enumerate(run.live):  # every position counted from the forward since which it held
            run.meter.commit(b, range(j * length, (j + 1) * length), held[i].tolist(), ["denoise"] * length)
        return argmax

    def store(self, run: BlockRun, block: torch.Tensor) -> None:
        """Next canvas (1.f): the canvas of the rows that go on is what the encoder reads next."""
        _encode(run.model, run.meter, run.cache, block, run.seen, run.pos, compiled=self.compile)

    def stats(self, run: BlockRun) -> dict:
        return {"canvas_length": self.size, **self.counts}


@torch.no_grad()
def diffusion_gemma(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    knobs: DiffusionGemmaKnobs | dict | None = None,
    *,
    eos_token_id: int | list[int] | None = None,
    mask_token_id: int | None = None,
    **overrides,
) -> tuple[list[torch.Tensor], dict]:
    """DiffusionGemma block diffusion (module doc) of a left-padded batch, every row as alone.

    model: a DiffusionGemmaForBlockDiffusion; input_ids [B, P] left-padded, attention_mask [B, P] (1 = real
    token). ``mask_token_id`` is accepted and unused (the canvas starts random, not masked)."""
    del mask_token_id
    k = DiffusionGemmaKnobs.of(knobs, overrides, "diffusion_gemma")
    responses, stats = decode_blocks(model, input_ids, attention_mask, DiffusionGemmaRule(k, model),
                                     eos_ids(model, eos_token_id))
    stats["tpf_decoder"] = stats["generated_tokens"] / stats["nfe_denoise"] if stats["nfe_denoise"] else 0.0
    return responses, stats


def _encode(model, meter: Meter, cache: Cache, new_ids: torch.Tensor, seen: torch.Tensor,
            positions: torch.Tensor, compiled: bool) -> None:
    """Encode (generate's step 1.a): one encoder forward of the tokens not yet in the cache, new_ids [b, q] at
    ``positions`` [b, q], writing their KV; ``seen`` [b, kv] is the 2-D mask of the cache and them. ``compiled``:
    through the compiled encoder (a canvas's encode, under the knob compile)."""
    encoder = model.model.encoder
    embed_dtype = model.model.decoder.embed_tokens.weight.dtype
    masks = encoder.create_masks_for_generate(
        config=model.config, inputs_embeds=torch.empty((new_ids.shape[0], new_ids.shape[1], 0), dtype=embed_dtype,
                                                      device=new_ids.device),
        attention_mask=seen, cache=cache, position_ids=positions)
    kwargs = {"input_ids": new_ids, "attention_mask": masks, "cache": cache, "position_ids": positions}
    if compiled:
        counted_call(meter, "encode", lambda: compiled_module_call(model, "diffusion_gemma.encoder", _run_encoder,
                                                                   encoder, **kwargs), compiled=True)
    else:
        counted_call(meter, "encode", lambda: encoder(**kwargs))
    if isinstance(cache, DynamicCache):
        meter.kv(cache)
    else:  # a static cache: its live columns only (``seen`` is as wide), as for eager decoding
        meter.kv(extra=sum(x.keys[:, :, :seen.shape[1]].nbytes + x.values[:, :, :seen.shape[1]].nbytes
                           for x in cache.layers))


def _run_encoder(encoder, **kwargs) -> None:
    encoder(**kwargs)


def _run_decoder(model, **kwargs) -> torch.Tensor:
    return model(**kwargs).logits


class _StaticRows(StaticLayer):
    """transformers' StaticLayer (compile: one buffer [B, heads, C, head_dim] written in place) whose batch rows
    can be dropped (the loop's pruning of ended rows: a new buffer of the kept rows, so the next forward compiles
    for that batch size)."""

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.keys, self.values = self.keys[indices].contiguous(), self.values[indices].contiguous()
            self.batch_size = self.keys.shape[0]
            torch._dynamo.mark_static_address(self.keys)
            torch._dynamo.mark_static_address(self.values)


class _WholeWindow(_StaticRows):
    """A sliding-attention layer's static cache while the whole context fits its window: it keeps every token
    (never rolls), and the model's sliding-window masks apply over it. Below W - 1 tokens this holds what
    transformers' DynamicSlidingWindowLayer holds (every token), which its StaticSlidingWindowLayer does not
    once the context passes W (it keeps another W), hence ``static_cache``'s bound."""
    is_sliding = True


def static_cache(text_config, tokens: int) -> Cache:
    """The static cache of a compiled decode that caches at most ``tokens`` tokens (the padded prompt and every
    canvas a next one reads): capacity ``capacity_bucket(tokens)``, so decodes of nearby lengths share their
    graphs. KnobLimit (a ValueError) when a sliding-attention layer would have to drop tokens (``tokens`` > sliding_window - 1):
    the eager decode's cache then keeps the last W - 1 tokens, which a static buffer does not replay."""
    types = list(text_config.layer_types)
    window = getattr(text_config, "sliding_window", None)
    if "sliding_attention" in types and window is not None and tokens > window - 1:
        raise KnobLimit(f"compile: the prompt and the canvases before the last ({tokens} tokens) exceed the model's "
                         f"sliding window less one ({window - 1}); decode this request without compile")
    cap = capacity_bucket(tokens)
    return Cache(layers=[_WholeWindow(cap) if t == "sliding_attention" else _StaticRows(cap) for t in types])


def _denoise(model, meter: Meter, cache: Cache, seen: torch.Tensor, positions: torch.Tensor,
             live: list[int], rng: _Rows, k: DiffusionGemmaKnobs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Start (1.b) and denoise (1.c) one canvas of the ``live`` rows: a random canvas, then decoder forwards
    with the step counter n = N .. 1 until every row stops. The decoder reads the cache (``seen`` [b, kv] its
    mask) and the whole canvas at ``positions`` [b, L]. Returns the last argmax canvas [b, L], the decoder
    forward since which each position's argmax held [b, L], and the steps each row ran [b]."""
    device, length, steps = positions.device, positions.shape[1], k.max_denoising_steps
    embed_dtype = model.model.decoder.embed_tokens.weight.dtype
    canvas = rng.canvas(live)  # [b, L]
    dec_seen = torch.nn.functional.pad(seen, (0, length), value=True)  # [b, kv + L]
    dec_mask = model.model.decoder.create_diffusion_decoder_attention_mask(
        config=model.config, inputs_embeds=canvas.unsqueeze(-1), cache=cache, decoder_attention_mask=dec_seen)
    argmax, cond = canvas, None  # argmax canvas [b, L]; self-conditioning logits [b, L, V] (None at first)
    done = torch.zeros(len(live), dtype=torch.bool, device=device)  # stopped denoising
    held = torch.zeros(len(live), length, dtype=torch.long, device=device)  # forward since which argmax holds
    history = None  # [S, b, L] the last S argmax canvases (StableAndConfidentStoppingCriteria)
    ran = torch.zeros(len(live), dtype=torch.long, device=device)  # decoder steps per row
    for step in range(steps, 0, -1):
        ran += ~done
        kwargs = {"decoder_input_ids": canvas, "self_conditioning_logits": cond, "decoder_attention_mask": dec_mask,
                  "cache": cache, "decoder_position_ids": positions}
        if meter.compiled:
            logits = counted_call(meter, "denoise", lambda: compiled_module_call(
                model, "diffusion_gemma.decoder", _run_decoder, model, **kwargs), check=True, compiled=True).float()
        else:
            logits = counted_call(meter, "denoise", lambda: model(**kwargs).logits.float(), check=True)  # [b, L, V]
        scaled = logits / temperature(k.t_min, k.t_max, step, steps)  # [b, L, V] float32
        del logits  # only the tempered copy is read (docs/design.md §6)
        probs = torch.softmax(scaled, dim=-1, dtype=torch.float32)
        active = [b for b, d in zip(live, done.tolist()) if not d]  # rows that draw (alone: still looping)
        idx = [i for i, d in enumerate(done.tolist()) if not d]
        sampled = canvas.clone()
        sampled[idx] = rng.sample(probs[idx], active)
        del probs
        new_argmax = scaled.argmax(-1)
        # [b, L] token entropies, computed once for the sampler and the stop (generate computes them twice, from the
        # same tempered logits for every row still denoising; a row that stopped stays stopped, whatever its value)
        ent = entropy(scaled)
        accepted = accept_mask(ent, k.entropy_bound)
        fresh = canvas.clone()
        fresh[idx] = rng.canvas(active)
        new_canvas = torch.where(accepted, sampled, fresh)
        if bool(done.any()):  # rows that stopped keep canvas, argmax and conditioning (:1056-1061)
            new_argmax = torch.where(done[:, None], argmax, new_argmax)
            new_canvas = torch.where(done[:, None], canvas, new_canvas)
            scaled = torch.where(done[:, None, None], cond, scaled)
        changed = new_argmax != argmax if cond is not None else torch.ones_like(held, dtype=torch.bool)
        held = torch.where(changed & ~done[:, None], meter.calls - 1, held)
        done, history = _stop(done, history, new_argmax, ent, k)
        canvas, argmax, cond = new_canvas, new_argmax, scaled.to(embed_dtype)
        del scaled  # only cond [b, L, V] goes into the next forward (docs/design.md §6)
        if bool(done.all()):
            break
    return argmax, held, ran


def _stop(done: torch.Tensor, history: torch.Tensor | None, argmax: torch.Tensor, ent: torch.Tensor,
          k: DiffusionGemmaKnobs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """StableAndConfidentStoppingCriteria.__call__ (generation_diffusion_gemma.py:504-538): (done | stable &
    confident, the rolled history). argmax [b, L]; ent [b, L] the token entropies of the tempered logits (rows
    already done: any value)."""
    if k.stability_threshold == 0:
        stable = torch.ones(argmax.shape[0], dtype=torch.bool, device=argmax.device)
    else:
        if history is None:
            history = torch.full((k.stability_threshold, *argmax.shape), -1, dtype=argmax.dtype, device=argmax.device)
        stable = (history == argmax[None]).all(dim=-1).all(dim=0)
        history = torch.roll(history, shifts=-1, dims=0)
        history[-1] = argmax
    confident = torch.mean(ent, dim=-1) < k.confidence_threshold
    return done | (stable & confident), history
