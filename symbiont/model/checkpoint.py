"""Reading local Hugging Face checkpoint folders without loading whole models.

Both halves of a split model read the same folder: the executor reads only the frozen
linear weights, the client only the rest. This module knows the folder layout
(single or sharded safetensors), reads single tensors on demand and fingerprints the
checkpoint so a client and an executor can prove they were built from the same base.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint folder is missing, incomplete, corrupt or unsupported."""


@dataclass(frozen=True)
class Checkpoint:
    """A local checkpoint folder: `config.json` plus safetensors weights."""

    path: Path

    @classmethod
    def open(cls, path: str | os.PathLike) -> Checkpoint:
        folder = Path(path).expanduser()
        if not folder.exists():
            raise CheckpointError(
                f"checkpoint folder {folder} does not exist; pass the path of a local "
                "Hugging Face checkpoint folder (with config.json and *.safetensors)"
            )
        if not folder.is_dir():
            raise CheckpointError(f"{folder} is a file; pass the folder that holds config.json")
        if not (folder / "config.json").is_file():
            raise CheckpointError(
                f"{folder} has no config.json; is it a Hugging Face checkpoint folder?"
            )
        checkpoint = cls(folder.resolve())
        checkpoint.tensor_files  # noqa: B018 - validates the weight files up front
        return checkpoint

    @cached_property
    def config(self) -> PretrainedConfig:
        from transformers import AutoConfig  # not at import: serve-base's process needs none

        try:
            return AutoConfig.from_pretrained(self.path, local_files_only=True)
        except (ValueError, OSError, json.JSONDecodeError) as err:
            raise CheckpointError(f"cannot read {self.path / 'config.json'}: {err}") from err

    @cached_property
    def tensor_files(self) -> dict[str, Path]:
        """Tensor name -> the safetensors file holding it."""
        index = self.path / INDEX_FILE
        if index.is_file():
            return self._files_from_index(index)
        single = self.path / SINGLE_FILE
        if single.is_file():
            return dict.fromkeys(_read_header(single), single)
        if list(self.path.glob("*.bin")) or list(self.path.glob("*.pt")):
            raise CheckpointError(
                f"{self.path} holds pickled PyTorch weights (*.bin); symbiont reads safetensors "
                "only. Convert with: AutoModelForCausalLM.from_pretrained(dir)"
                ".save_pretrained(dir, safe_serialization=True)"
            )
        raise CheckpointError(
            f"{self.path} has no {SINGLE_FILE} and no {INDEX_FILE}; save the model with "
            "save_pretrained(dir, safe_serialization=True)"
        )

    def _files_from_index(self, index: Path) -> dict[str, Path]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index} is corrupt (no valid weight_map): {err}") from err
        files = {name: self.path / shard for name, shard in weight_map.items()}
        for shard in set(files.values()):
            if not shard.is_file():
                raise CheckpointError(f"{index} names shard {shard.name}, which is missing")
            _read_header(shard)
        return files

    def has(self, name: str) -> bool:
        return name in self.tensor_files

    def read(self, name: str, *, dtype: torch.dtype | None = None, device="cpu") -> torch.Tensor:
        """One tensor, read from disk alone (other tensors in the file stay unread)."""
        if name not in self.tensor_files:
            raise CheckpointError(f"tensor {name!r} is not in checkpoint {self.path}")
        try:
            with safe_open(self.tensor_files[name], framework="pt", device=str(device)) as f:
                tensor = f.get_tensor(name)
        except Exception as err:  # safetensors raises its own error types for bad bytes
            raise CheckpointError(
                f"cannot read {name!r} from {self.tensor_files[name]}: {err}"
            ) from err
        return tensor if dtype is None else tensor.to(dtype)

    @cached_property
    def fingerprint(self) -> str:
        """Digest of the config, every tensor's name/dtype/shape and sampled weight bytes.

        Hashing every byte would cost a full read of a multi-GB checkpoint on each client
        start; the header plus evenly spaced blocks tells apart any two real checkpoints
        (another model, another fine-tune, another dtype) at a fixed cost.
        """
        digest = hashlib.sha256()
        config = json.loads((self.path / "config.json").read_text())
        digest.update(json.dumps(config, sort_keys=True).encode())
        for file in sorted(set(self.tensor_files.values())):
            digest.update(_file_digest(file))
        return digest.hexdigest()[:32]


def _read_header(file: Path) -> dict[str, dict]:
    """Parse a safetensors header; tells a corrupt or truncated file apart early."""
    try:
        with open(file, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{file} is truncated (no safetensors header)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > 100 * 1024 * 1024:
                raise CheckpointError(f"{file} is corrupt (header length {header_len})")
            header = json.loads(f.read(header_len))
            file_size = os.fstat(f.fileno()).st_size
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{file} is corrupt (unreadable safetensors header)") from err
    header.pop("__metadata__", None)
    data_end = max((meta["data_offsets"][1] for meta in header.values()), default=0)
    if 8 + header_len + data_end > file_size:
        raise CheckpointError(
            f"{file} is truncated: header promises {8 + header_len + data_end} bytes, "
            f"file has {file_size}; re-save or re-copy the checkpoint"
        )
    return header


_SAMPLED_BLOCKS = 32
_BLOCK_BYTES = 1 << 16


def _file_digest(file: Path) -> bytes:
    digest = hashlib.sha256()
    size = file.stat().st_size
    digest.update(str(size).encode())
    with open(file, "rb") as f:
        if size <= _SAMPLED_BLOCKS * _BLOCK_BYTES:
            digest.update(f.read())
            return digest.digest()
        (header_len,) = struct.unpack("<Q", f.read(8))
        digest.update(f.read(header_len))
        stride = (size - _BLOCK_BYTES) // (_SAMPLED_BLOCKS - 1)
        for block in range(_SAMPLED_BLOCKS):
            f.seek(block * stride)
            digest.update(f.read(_BLOCK_BYTES))
    return digest.digest()
