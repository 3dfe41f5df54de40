"""The models shipped inside the package, so a fresh install runs with no download.

- `default/`: the default model, a small `qwen3_moe` (32 routed experts per layer, top-4) trained on Python's
  standard library, Shakespeare and Vim's documentation; see its MODEL_CARD.md.
- `draft/`: a tiny dense `qwen3` model with the same tokenizer, for draft-model speculative decoding.

Both are plain Hugging Face model folders (config.json, model.safetensors, tokenizer files); the training pipeline
that made them lives in the repository's top-level `train/` folder.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from moelane.errors import ModelLoadError


def _asset_dir(name: str) -> Path:
    path = Path(str(files(__name__) / name))
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"the shipped model folder {path} is missing (broken install?)")
    return path


def default_model_path() -> Path:
    """The folder of the shipped default MoE model."""
    return _asset_dir("default")


def draft_model_path() -> Path:
    """The folder of the shipped dense draft model (same tokenizer as the default model)."""
    return _asset_dir("draft")
