"""The embedded demo model: a small Llama trained on Python's standard library
source (``scripts/train_demo_model.py``), shipped inside the package."""

from __future__ import annotations

import os

DEMO_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_model")


def demo_model_path() -> str:
    """Folder of the embedded demo model; an error if this installation lacks it."""
    if not os.path.isfile(os.path.join(DEMO_MODEL_DIR, "config.json")):
        raise FileNotFoundError(
            f"the embedded demo model is missing ({DEMO_MODEL_DIR}); pass a model folder, "
            "or rebuild it with scripts/train_demo_model.py"
        )
    return DEMO_MODEL_DIR
