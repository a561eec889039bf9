"""Checkpoints: the model-family table and the inspection and loading of a checkpoint folder.

The lowest floor of ``harness``: imports nothing else of ``harness`` (tests/test_layering.py).
"""
