"""Shared test helpers, handed to tests as fixtures (no test module imports another one).

Fixtures:
  one_thread                          run a module's tiny models on one torch thread (REFUSION_TEST_THREADS)
  tiny_qwen3(vocab=..., ...)          a random tiny Qwen3ForCausalLM, causal or bidirectional
  left_pad(rows)                      -> (ids, attention_mask), rows right-aligned, pad 0
  assert_cache_matches_fresh_forward  a refusion on_commit cache vs an independent recomputation
  tiny_checkpoint(name)               path of the committed trained checkpoints/tiny/<name>
  make_checkpoint(path, causal, seed) a random tiny Qwen3 saved with a small chat BPE tokenizer
  write_task(folder, name, n, ...)    a minimal local lm-eval YAML task over a JSONL file
  assert_close(actual, expected)      two float computations of the same math agree (dtype-aware tolerance)
  fake_venv                           a VENV for `make` whose setup is done (its python is this one)
  load_example(name)                  the module examples/<name>.py (docs/extending.md's worked examples)
  dry_run(models)                     (exit status, stdout, stderr) of `harness eval --dry-run` on embedded_math
  one_error(rc, err)                  err, asserted to be exit 2 with one `error:` line and no traceback
  shared_once(name, make)             a folder ``make(folder)`` filled once per session, shared by the xdist workers
  fake_engine(mode=..., child=...)    an EngineServer (harness/run/engine.py) on tests/engine_double.py, the
                                      engine's test double; stopped after the test
"""

import json
import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

# Tests never reach a hub: everything runs on local data and tiny models.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `make test` runs one pytest-xdist worker per core: each worker, and every process its tests start, then
# computes on one thread (set before torch is imported), so two workers never oversubscribe two cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

REPO = Path(__file__).resolve().parents[1]
TINY_CHECKPOINTS = REPO / "checkpoints" / "tiny"


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread; on a loaded 2-core box two threads spin. Restored after.
    REFUSION_TEST_THREADS=N runs them on N threads instead (`make test-cpus` checks 1 and 4: a float32 sum
    is split differently across threads, and the fixture comparisons must hold at any count)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("REFUSION_TEST_THREADS", "1")))
    yield
    torch.set_num_threads(before)


# --- float comparisons -------------------------------------------------------------------------
# Two computations of the same math in another order (another kernel, a freshly compiled graph,
# another CPU's vector width or reduction tree) differ by rounding, and rounding scales with the
# magnitude of the values: logits of size ~10 differ by ~1e-5 in float32 where activations of size
# ~1 differ by ~1e-6. So every float comparison of the suite allows, per element,
#     |actual - expected| <= rtol * |expected| + atol * max(1, max |expected|)
# with (rtol, atol) from the dtype of the compared computation: about 100 ulps of float32 (eps 1.2e-7),
# a few ulps of the half types (bfloat16 eps 7.8e-3, float16 eps 9.8e-4). Where the claim is "the
# same decoding", tests compare tokens exactly instead.
TOLERANCES = {"float32": (1e-5, 1e-5), "bfloat16": (1.6e-2, 1.6e-2), "float16": (2e-3, 2e-3)}


def check_close(actual, expected, *, dtype=None, msg: str | None = None) -> None:
    """Assert two tensors agree within the suite's tolerance for ``dtype`` (default: the dtype of
    ``actual``); compares in float32, scaled by the magnitude of ``expected`` (see TOLERANCES)."""
    import torch

    name = str(dtype or actual.dtype).removeprefix("torch.")
    rtol, atol = TOLERANCES[name]
    b = expected.detach().float().cpu()
    scale = max(1.0, b.abs().max().item()) if b.numel() else 1.0
    torch.testing.assert_close(actual.detach().float().cpu(), b, rtol=rtol, atol=atol * scale,
                               msg=(lambda m: f"{msg}: {m}") if msg else None)


@pytest.fixture(scope="session")
def assert_close():
    """`assert_close(actual, expected, dtype=None, msg=None)`: see TOLERANCES in tests/conftest.py."""
    return check_close


# --- tiny random Qwen3 ---------------------------------------------------------------------------

def build_tiny_qwen3(*, vocab: int, seed: int = 0, causal: bool = True, layers: int = 2, impl: str | None = None,
                     max_positions: int = 256, eos: int | None = None, pad: int | None = None,
                     mask: int | None = None, init_range: float = 0.02, tie: bool = False):
    """A random Qwen3ForCausalLM (hidden 32, MLP 64, 4 query / 2 KV heads of 8), seeded, in eval mode.

    causal=False sets config.is_causal = False (bidirectional attention, the MDM convention).
    impl=None leaves the attention implementation to transformers' default; otherwise it is set
    on the config before the model is built. mask sets config.mask_token_id.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=max_positions, eos_token_id=eos,
        pad_token_id=pad, initializer_range=init_range, tie_word_embeddings=tie,
    )
    if mask is not None:
        cfg.mask_token_id = mask
    if not causal:
        cfg.is_causal = False
    if impl is not None:
        cfg._attn_implementation = impl
    return Qwen3ForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def tiny_qwen3():
    """The builder `build_tiny_qwen3(vocab=..., seed=0, causal=True, layers=2, impl=None, ...)`."""
    return build_tiny_qwen3


# --- left padding --------------------------------------------------------------------------------

def left_pad_rows(rows, pad: int = 0):
    """1-D token rows -> (ids [B, W], attention_mask [B, W]) with each row right-aligned."""
    import torch

    width = max(r.numel() for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - r.numel():], mask[i, width - r.numel():] = r, 1
    return ids, mask


@pytest.fixture(scope="session")
def left_pad():
    """`left_pad(rows, pad=0) -> (ids, attention_mask)`."""
    return left_pad_rows


# --- refusion cache exactness --------------------------------------------------------------------

def fresh_cache(model, info):
    """Independent recomputation of a refusion decoder's committed cache from an on_commit `info`:
    the committed tokens in commit order at their positions, each attending exactly the commit
    indices recorded for it ([0, base) and [start, itself])."""
    import torch
    from transformers import DynamicCache

    c = len(info["ids"])
    allowed = torch.zeros(c, c, dtype=torch.bool)
    for i in range(c):
        for j in range(i + 1):
            allowed[i, j] = j < info["base"][i] or j >= info["start"][i]
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([info["ids"]]), position_ids=torch.tensor([info["pos"]]), attention_mask=mask,
              cache=cache, use_cache=True)
    return cache


def check_cache_matches_fresh_forward(model, info):
    """Every layer's keys and values in info["cache"] equal `fresh_cache` (within `check_close`)."""
    ref = fresh_cache(model, info)
    assert len(info["cache"].layers) == len(ref.layers)
    for i, (mine, theirs) in enumerate(zip(info["cache"].layers, ref.layers)):
        assert mine.keys.shape == theirs.keys.shape
        check_close(mine.keys, theirs.keys, msg=f"layer {i} keys")
        check_close(mine.values, theirs.values, msg=f"layer {i} values")


@pytest.fixture(scope="session")
def assert_cache_matches_fresh_forward():
    """`assert_cache_matches_fresh_forward(model, info)`, for a refusion on_commit hook."""
    return check_cache_matches_fresh_forward


# --- checkpoints ---------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def tiny_checkpoint():
    """`tiny_checkpoint(name) -> Path` of the committed trained checkpoints/tiny/<name> (ar, refusion, mdm, dream, d2f)."""

    def path(name: str) -> Path:
        p = TINY_CHECKPOINTS / name
        assert (p / "model.safetensors").is_file(), f"checkpoint {p} is missing (run `make train-tiny`)"
        return p

    return path


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
WORDS = ("the answer is 12 . what is 3 plus 4 ? seven apples and nine pears , def add ( a , b ) : return a + b "
         "question choose A B C D")


def build_tokenizer():
    """A byte-level BPE (vocab 300) trained on a few words, with the chat specials and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([WORDS] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                   mask_token="<|mask|>", clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT
    return fast


def build_checkpoint(path: Path, causal: bool = True, seed: int = 0) -> Path:
    """A random 2-layer Qwen3 (bidirectional when causal=False) saved with its tokenizer."""
    tok = build_tokenizer()
    model = build_tiny_qwen3(vocab=len(tok), seed=seed, causal=causal, max_positions=512, eos=tok.eos_token_id,
                             pad=tok.pad_token_id, mask=tok.mask_token_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def build_task(folder: Path, name: str = "tiny_gen", n: int = 4, output_type: str = "generate_until") -> Path:
    """A minimal lm-eval YAML task over a local JSONL file (no hub access)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    with open(data, "w") as f:
        for i in range(n):
            f.write(json.dumps({"q": f"what is {i} plus 4 ?", "a": str(i + 4), "choices": ["A", "B"], "gold": i % 2})
                    + "\n")
    if output_type == "generate_until":
        tail = textwrap.dedent("""\
            output_type: generate_until
            doc_to_target: "{{a}}"
            generation_kwargs:
              until: ["."]
              max_gen_toks: 6
            metric_list:
              - metric: exact_match
            """)
    else:
        tail = textwrap.dedent("""\
            output_type: multiple_choice
            doc_to_choice: "{{choices}}"
            doc_to_target: "{{gold}}"
            metric_list:
              - metric: acc
            """)
    (folder / f"{name}.yaml").write_text(textwrap.dedent(f"""\
        task: {name}
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data}
        test_split: test
        doc_to_text: "{{{{q}}}}"
        """) + tail)
    return folder


@pytest.fixture(scope="session")
def make_checkpoint():
    """`make_checkpoint(path, causal=True, seed=0) -> path`: a random tiny Qwen3 + tokenizer saved there."""
    return build_checkpoint


@pytest.fixture(scope="session")
def write_task():
    """`write_task(folder, name="tiny_gen", n=4, output_type="generate_until") -> folder`."""
    return build_task


# ---------------------------------------------------------------- random bidirectional models (MDM decoders)
MDM_MASK, MDM_EOS = 47, 2  # special ids of the random vocab-48 bidirectional models below


@pytest.fixture(scope="session")
def tiny_mdm(tiny_qwen3):
    """`tiny_mdm(seed=0, impl="sdpa", layers=2)`: a random bidirectional tiny Qwen3, vocab 48, mask id 47."""
    return lambda seed=0, impl="sdpa", layers=2: tiny_qwen3(
        vocab=48, seed=seed, causal=False, impl=impl, layers=layers, eos=MDM_EOS, pad=0, mask=MDM_MASK,
        init_range=0.1)


@pytest.fixture(scope="session")
def mdm_prompts(left_pad):
    """`mdm_prompts(lengths=(6,), seed=0) -> (rows, ids, mask)`: seeded random rows of the vocab-48 models,
    left padded."""

    import torch

    def make(lengths=(6,), seed=0):
        g = torch.Generator().manual_seed(seed)
        rows = [torch.randint(3, 47, (n,), generator=g) for n in lengths]
        return (rows, *left_pad(rows))

    return make


@pytest.fixture
def fake_venv(tmp_path) -> Path:
    """A VENV for `make` whose setup is already done, so no target installs anything."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    wrapper = venv / "bin" / "python"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    (venv / ".setup-done").touch()
    return venv


@pytest.fixture(scope="session")
def load_example():
    """`load_example(name) -> module` of examples/<name>.py (examples/ is not a package: the guide's files stand
    alone, so they are loaded by path)."""
    import importlib.util

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"examples_{name}", REPO / "examples" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
        return module

    return load


# ---------------------------------------------------------------- one tiny run shared by the runner's tests


@pytest.fixture(scope="session")
def shared_once(tmp_path_factory):
    """`shared_once(name, make) -> folder`: ``make(folder)`` runs once per test session, in whichever pytest-xdist
    worker asks first; the other workers wait for it and get the same folder. For the expensive runs that tests in
    several modules read (each worker would otherwise make its own copy). Without xdist: a temp folder."""
    from filelock import FileLock

    # Under xdist each worker's basetemp is <session temp>/popen-gwN, so their parent is this session's, shared.
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base

    def get(name: str, make) -> Path:
        folder = root / f"shared-{name}"
        with FileLock(str(root / f"shared-{name}.lock")):
            if not (folder / ".made").is_file():
                shutil.rmtree(folder, ignore_errors=True)  # left half-made by a worker whose make failed
                folder.mkdir(parents=True)
                make(folder)
                (folder / ".made").touch()
        return folder

    return get


@pytest.fixture
def fake_engine(tmp_path):
    """`fake_engine(mode="ok", child=False, health_timeout_s=60, eos=None) -> EngineServer`, not yet started: the
    real lifecycle code (keeper, process group, health wait, stop) around tests/engine_double.py, a real HTTP
    server that speaks the engine's API subset (``eos``: the double's own EOS, as a model's); every server made
    here is stopped after the test."""
    from harness.run.engine import EngineServer, free_port

    made = []

    def make(mode: str = "ok", child: bool = False, health_timeout_s: float = 60.0,
             eos: int | None = None) -> EngineServer:
        port = free_port()
        cmd = [sys.executable, str(REPO / "tests" / "engine_double.py"), "--port", str(port), "--mode", mode]
        cmd += ["--child"] if child else []
        cmd += ["--eos", str(eos)] if eos is not None else []
        server = EngineServer(cmd, port, tmp_path / f"engine-{len(made)}.log",
                              health_timeout_s=health_timeout_s, name="double")
        made.append(server)
        return server

    yield make
    for server in made:
        server.stop()


@pytest.fixture(scope="session")
def runner_setup(shared_once):
    """A random tiny causal checkpoint, a 6-document generation task and an output folder, shared by every test
    that drives ``harness eval`` end to end (tests/test_runner.py, tests/test_faults.py): each uses its own run ids."""
    def make(root: Path) -> None:
        build_checkpoint(root / "ckpt")
        build_task(root / "tasks", "tiny_gen", n=6)

    root = shared_once("runner", make)
    ckpt = root / "ckpt"
    return {"root": root, "ckpt": ckpt, "tasks": root / "tasks", "models": f"a={ckpt}:ar:gen_length=24",
            "out": root / "out", "task": "tiny_gen", "n_docs": 6}


@pytest.fixture(scope="session")
def runner_reference(runner_setup, shared_once):
    """The uninterrupted single-process run of ``runner_setup`` (run id ``ref``): what resumed, faulty, sharded or
    data-parallel runs must reproduce. Made once per session, whichever xdist worker needs it first."""
    import subprocess

    s = runner_setup

    def make(_marker: Path) -> None:
        cmd = [sys.executable, "-m", "harness", "eval", "--task", s["task"], "--models", s["models"], "--tasks-dir",
               str(s["tasks"]), "--out", str(s["out"]), "--run-id", "ref", "--threads", "1", "--no-chat-template"]
        shutil.rmtree(s["out"] / "ref", ignore_errors=True)
        # the fork server on, and saying why it refuses a child (harness/run/zygote.py)
        p = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO),
                                               "TOKENIZERS_PARALLELISM": "false", "REFUSION_FORK_SERVER": "1",
                                               "REFUSION_FORK_SERVER_DEBUG": "1"},
                           capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stderr[-4000:]
        assert "done:" in p.stdout and s["task"] in p.stdout
        # every child (each model's worker, the timed rounds, the memory pass) was forked from the server, which
        # the runner started before its own imports: what those set in its environment must not refuse them
        assert "fork server:" not in p.stderr, p.stderr[-4000:]

    shared_once("runner-reference", make)
    return s["out"] / "ref"


# ---------------------------------------------------------------- the dry run of a released layout


@pytest.fixture
def dry_run(tmp_path, capsys):
    """`dry_run(models) -> (rc, out, err)`: `harness eval --dry-run` of one MODELS string on embedded_math."""
    def run(models: str) -> tuple[int, str, str]:
        from harness.run import runner

        rc = runner.main(["--task", "embedded_math", "--models", models, "--out", str(tmp_path / "out"),
                          "--run-id", "x", "--limit", "1", "--dry-run"])
        cap = capsys.readouterr()
        return rc, cap.out, cap.err.strip()

    return run


@pytest.fixture(scope="session")
def one_error():
    """`one_error(rc, err) -> err`, asserting a failure of exactly one `error:` line (exit 2, no traceback)."""
    def check(rc: int, err: str) -> str:
        assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
        return err

    return check
