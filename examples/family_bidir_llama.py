"""Example model family of docs/extending.md: a bidirectional Llama with its own ``model_type``.

Suppose a lab releases a masked-diffusion model built on Llama: its ``config.json`` says
``"model_type": "bidir_llama"``, its fields are Llama's, its tensors have Llama's names, and it was
trained with bidirectional attention (its modelling code ignores any causal flag). The harness loads
it onto the stock ``LlamaForCausalLM`` with no remote code once its family is known: one ``Family``
entry (how the folder maps onto a transformers class and what the decoders need) and one
``model_type`` route.

In-tree that is an entry in ``FAMILIES`` and one in ``MODEL_TYPES`` in harness/models/families.py.
``register_example`` does the same at run time; tests/test_extending.py builds a folder laid out like
such a release (a real Llama-shaped random model) and checks it loads bidirectional.
"""

from __future__ import annotations

from harness.models.families import Family, plain_config, register_family

BIDIR_LLAMA = Family(
    name="bidir_llama",
    model_class="LlamaForCausalLM",  # the transformers class that runs the weights as published
    causal=False,                    # fixed by the family: the release was trained bidirectional
    mask_token="<|mask|>",           # looked up in the folder's tokenizer when config.json has no mask_token_id
    to_config=plain_config,          # config.json fields are LlamaConfig's already
    notes="example family of docs/extending.md: Llama weights, bidirectional attention",
    sources=("examples/family_bidir_llama.py",),
)


def register_example() -> Family:
    """Add the family and route ``model_type: bidir_llama`` to it."""
    return register_family(BIDIR_LLAMA, ("bidir_llama",))
