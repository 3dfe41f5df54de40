"""Files moelane derives from a model and keeps for the next load: where they live, and the dense projections
quantised once (`DenseCache`). The pager's tier files of quantised experts live in the same folder
(`pager.live.storage.TierFile`).

    <model>/.moelane/dense-int4-float32.safetensors     (m.dense-int4-float32.safetensors for m.gguf)

A dense cache holds every projection `weights.prepare_weights` quantises, as safetensors (codes and scales of each
pool under `<module name>.data` / `.scales`), with a key in its metadata: the quantiser's version, the quantize
choice, the compute dtype the weights were read in, and the name, size and mtime of every file the weights came
from. A load whose key differs, or whose file is damaged or holds other shapes, quantises again and rewrites it
(atomically); one that cannot write it goes on without (a DEBUG line). int4's code search costs ~30 ns a weight on
2 cores (`formats._int4_codes`), so a model with ~0.9B dense weights (Qwen3-30B-A3B) would spend ~27 s of every
load on it without the cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from moelane import kernels
from moelane.kernels.build import user_cache
from moelane.kernels.formats import QUANTIZER_VERSION
from moelane.model.checkpoint import shard_files
from moelane.model.gguf.file import is_gguf, model_name, split_parts

log = logging.getLogger(__name__)
LAYOUT_VERSION = 1  # bump whenever what a dense cache file holds changes


def cache_dir(model_folder: Path) -> Path:
    """`<model>/.moelane/` when writable, else (and for the model shipped inside the package)
    `~/.cache/moelane/tiers/<hash of the model path>/`. Raises OSError when neither can be made."""
    beside = model_folder / ".moelane"
    shipped = Path(__file__).resolve().parents[1] in model_folder.resolve().parents  # (src/moelane/)
    try:
        if not shipped:
            beside.mkdir(exist_ok=True)
            if os.access(beside, os.W_OK):
                return beside
    except OSError:
        pass
    digest = hashlib.sha1(str(model_folder.resolve()).encode()).hexdigest()[:16]
    home = user_cache("tiers") / digest
    home.mkdir(parents=True, exist_ok=True)
    return home


def file_fingerprint(paths: list[Path]) -> list[list[object]]:
    """[name, size, mtime_ns] of each file: what says a derived file was made from these files as they are."""
    return [[p.name, (st := os.stat(p)).st_size, st.st_mtime_ns] for p in paths]


class DenseCache:
    """One model's quantised dense projections at one quantize choice and compute dtype (see the module docstring)."""

    def __init__(self, folder: Path, name: str, key: dict[str, object]) -> None:
        self.folder, self.name, self.key = folder, name, key

    @classmethod
    def of(cls, model: Path, quantize: str, dtype: torch.dtype) -> DenseCache:
        """The cache of a model folder or GGUF file (nothing read or written yet but the sources' sizes and times)."""
        if is_gguf(model):
            sources, folder, prefix = split_parts(model), model.parent, f"{model_name(model)}."
        else:
            config = model / "config.json"
            sources, folder, prefix = shard_files(model) + ([config] if config.is_file() else []), model, ""
        key = {
            "layout": LAYOUT_VERSION,
            "quantizer": QUANTIZER_VERSION,
            "quantize": quantize,
            "dtype": str(dtype),
            "sources": file_fingerprint(sources),
        }
        return cls(folder, f"{prefix}dense-{quantize}-{str(dtype).removeprefix('torch.')}.safetensors", key)

    def path(self) -> Path:
        """Where the file is (its folder made if missing); OSError where no folder can be had."""
        return cache_dir(self.folder) / self.name

    def load(self, wanted: dict[str, tuple[str, int, int]]) -> dict[str, kernels.Pool] | None:
        """Pools by module name, where the file exists with this key and holds exactly `wanted` (name -> kind, out
        rows, in features); else None."""
        try:
            path = self.path()
            if not path.is_file():
                return None
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if json.loads(meta.get("key", "null")) != self.key:
                    return None
                if {k: tuple(v) for k, v in json.loads(meta.get("pools", "{}")).items()} != wanted:
                    return None
                pools = {}
                for name, (kind, n_out, n_in) in wanted.items():
                    pool = kernels.Pool(kind, f.get_tensor(f"{name}.data"), f.get_tensor(f"{name}.scales"), n_in)
                    if tuple(pool.data.shape[:2]) != (1, n_out):
                        return None
                    pools[name] = pool
                return pools
        except (SafetensorError, OSError, ValueError, KeyError) as e:
            log.warning("ignoring the dense cache %s (%s); quantising again", self.name, e)
            return None

    def save(self, pools: dict[str, kernels.Pool]) -> None:
        """Write the pools (atomically), or say at DEBUG why they could not be."""
        tensors: dict[str, torch.Tensor] = {}
        described: dict[str, list[object]] = {}
        for name, pool in pools.items():
            assert pool.scales is not None and pool.in_features is not None
            tensors[f"{name}.data"], tensors[f"{name}.scales"] = pool.data, pool.scales
            described[name] = [pool.kind, pool.data.shape[1], pool.in_features]
        tmp = None
        try:
            path = self.path()
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # (loads in other processes write their own)
            save_file(tensors, str(tmp), metadata={"key": json.dumps(self.key), "pools": json.dumps(described)})
            os.chmod(tmp, 0o644)  # (as the tier files beside it: safetensors writes 0600)
            os.replace(tmp, path)
        except (OSError, SafetensorError) as e:  # (a full disk comes as either)
            if tmp is not None:
                tmp.unlink(missing_ok=True)
            log.debug("cannot write the dense cache %s of %s: %s", self.name, self.folder, e)
