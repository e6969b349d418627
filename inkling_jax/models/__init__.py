"""Trained models shipped inside the package, one directory each: config.json, the
safetensors (bf16, hub naming), a generated README.md model card, the loss curves and the
training log. `inkling-train --export inkling_jax/models/<name>` writes one;
`ik.load_pretrained(model_dir(name))` reads it.

    shakespeare   byte-level `InklingConfig.shakespeare()` trained on Gutenberg's Shakespeare
                  (the command is in `inkling_jax/train/__init__.py` and the model card)
"""

from __future__ import annotations

import os

SHIPPED = ("shakespeare",)


def model_dir(name: str) -> str:
    """The directory of a shipped model. Raises FileNotFoundError when its weights are not
    there (a checkout where nobody has trained it yet)."""
    if name not in SHIPPED:
        raise ValueError(f"no shipped model {name!r} (shipped: {', '.join(SHIPPED)})")
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path} has no trained weights yet: train them with "
                                f"`inkling-train --export {path}` (see inkling_jax/train/__init__.py)")
    return path
