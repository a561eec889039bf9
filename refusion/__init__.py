"""ReFusion model, training objective, decoders, slot-attention kernel and tokenizer.

Importing this package is cheap and offline: submodules import torch and
transformers themselves.
"""

__version__ = "0.1.0"
