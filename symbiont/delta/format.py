"""The delta folder on disk: `manifest.json` plus one safetensors file (optionally zstd).

    DIR/manifest.json             what was compressed, against which base, how, and the
                                  sha256 and size of every data file
    DIR/delta.safetensors         packed linear layers (see packing.py) and the other
      or delta.safetensors.zst    parameters' fp16 deltas, with --zstd compressed whole

Other parameters (norms, biases, embeddings) that differ from the base are stored as fp16
deltas: `NAME.delta` of the parameter's shape, or for an embedding only its changed rows,
`NAME.rows` (int64 [k]) and `NAME.delta` (fp16 [k, dim]). Parameters equal to the base
are not stored.

Reading is all-or-nothing: `read_delta` checks the manifest, every file's hash and every
layer's tensors before it returns, so a bad delta is refused whole with the reason.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from symbiont.delta.packing import DeltaFormatError, PackedLayer

FORMAT = "symbiont-delta"
VERSION = 1
MANIFEST = "manifest.json"
DATA_FILE = "delta.safetensors"
ZSTD_SUFFIX = ".zst"
# zstd gains about 1.2x on packed layers and fp16 deltas (BENCHMARKS.md, issue 16); a file inflating past this many
# times its size (or MIN_INFLATED_BYTES, for tiny ones) is refused before it fills memory
MAX_INFLATION = 64
MIN_INFLATED_BYTES = 64 << 20


class ParamKind:
    FULL = "fp16_delta"  # NAME.delta: the whole parameter's delta
    ROWS = "fp16_rows_delta"  # NAME.rows + NAME.delta: changed rows of an embedding


@dataclass(frozen=True)
class ParamDelta:
    """A non-linear parameter's fp16 delta (whole, or changed rows of an embedding)."""

    name: str
    kind: str
    shape: tuple[int, ...]  # the parameter's shape
    delta: torch.Tensor  # fp16: [*shape] or [k, dim]
    rows: torch.Tensor | None = None  # int64 [k] for ROWS

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f"{self.name}.delta": self.delta}
        if self.rows is not None:
            out[f"{self.name}.rows"] = self.rows
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def apply_to(self, base: torch.Tensor) -> torch.Tensor:
        """base + delta, computed in fp32, returned in base's dtype."""
        merged = base.float().clone()
        if self.rows is None:
            merged += self.delta.float()
        else:
            merged[self.rows] += self.delta.float()
        return merged.to(base.dtype)

    def validate(self) -> None:
        where = f"parameter {self.name}"
        if self.delta.dtype != torch.float16:
            raise DeltaFormatError(f"{where}: delta should be float16, got {self.delta.dtype}")
        if self.kind == ParamKind.FULL:
            ok = tuple(self.delta.shape) == self.shape and self.rows is None
        elif self.kind == ParamKind.ROWS:
            ok = (
                self.rows is not None
                and len(self.shape) == 2
                and self.rows.dtype == torch.int64
                and tuple(self.delta.shape) == (self.rows.numel(), self.shape[1])
                and bool(((self.rows >= 0) & (self.rows < self.shape[0])).all())
                and self.rows.unique().numel() == self.rows.numel()  # each row once
            )
        else:
            raise DeltaFormatError(f"{where}: unknown kind {self.kind!r}; re-compress the delta")
        if not ok:
            raise DeltaFormatError(
                f"{where}: stored tensors do not match the manifest shape {list(self.shape)}; "
                "the file is corrupt, re-compress the delta"
            )
        if not bool(torch.isfinite(self.delta).all()):
            raise DeltaFormatError(
                f"{where}: the delta holds NaN or infinite values; the fine-tuned checkpoint "
                "it came from is broken or beyond fp16's range, re-compress a sound one"
            )


@dataclass(frozen=True)
class CompressedDelta:
    """A whole verified delta: its manifest, packed linear layers and parameter deltas."""

    path: Path
    manifest: dict
    layers: dict[str, PackedLayer]  # module name of an nn.Linear -> its packed weight delta
    params: dict[str, ParamDelta]  # parameter name -> its fp16 delta

    @property
    def base_fingerprint(self) -> str:
        return self.manifest["base"]["fingerprint"]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_delta(
    out: Path,
    manifest: dict,
    layers: list[PackedLayer],
    params: list[ParamDelta],
    *,
    zstd: bool,
) -> dict:
    """Write the folder atomically (staged next to `out`, renamed last); returns the manifest."""
    tensors: dict[str, torch.Tensor] = {}
    for item in [*layers, *params]:
        tensors.update(item.tensors())
    payload = save_safetensors(tensors)
    name = DATA_FILE
    if zstd:
        import zstandard

        payload = zstandard.ZstdCompressor(level=19).compress(payload)
        name += ZSTD_SUFFIX
    staging = out.parent / f".{out.name}.staging-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    try:
        (staging / name).write_bytes(payload)
        manifest = {
            **manifest,
            "files": {name: {"sha256": file_sha256(staging / name), "bytes": len(payload)}},
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # only an empty folder may be replaced (checked by the caller)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def check_output_folder(out: Path) -> None:
    """Refuse an --out that cannot take the result, before any long work starts."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not an empty folder; choose a new path")
    parent = next((p for p in out.absolute().parents if p.exists()), None)
    if parent is not None and (not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK)):
        raise ValueError(
            f"--out {out}: {parent} is not a folder this user can write in; choose another path"
        )


def read_manifest(folder: str | os.PathLike) -> dict:
    path = Path(folder).expanduser()
    file = path / MANIFEST
    if not path.exists():
        raise DeltaFormatError(
            f"{path} does not exist; pass a delta folder (symbiont delta compress)"
        )
    if not file.is_file():
        raise DeltaFormatError(
            f"{path} has no {MANIFEST}: not a delta folder written by `symbiont delta compress`"
        )
    try:
        manifest = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DeltaFormatError(f"{file} is not valid JSON ({err}); re-compress the delta") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DeltaFormatError(f"{file} is not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise DeltaFormatError(
            f"{file} has format version {manifest.get('version')}, this symbiont reads "
            f"version {VERSION}; re-compress the delta with this version"
        )
    kinds = {"base": dict, "layers": list, "params": list, "files": dict, "compression": dict}
    for key, kind in kinds.items():
        if not isinstance(manifest.get(key), kind):
            raise DeltaFormatError(
                f"{file} lacks {key!r} (a JSON {kind.__name__}); re-compress the delta"
            )
    entries = [*manifest["layers"], *manifest["params"], *manifest["files"].values()]
    if not all(isinstance(entry, dict) for entry in entries):
        raise DeltaFormatError(f"{file} has a malformed layer, parameter or file entry")
    for entry in [*manifest["layers"], *manifest["params"]]:
        shape = entry.get("shape")
        if not isinstance(entry.get("name"), str) or not (
            isinstance(shape, list) and all(type(n) is int and n >= 1 for n in shape)
        ):
            raise DeltaFormatError(
                f"{file} has a malformed entry {str(entry)[:200]}: each needs a string 'name' "
                "and a 'shape' list of positive integers; re-compress the delta"
            )
    for name, meta in manifest["files"].items():
        if name not in (DATA_FILE, DATA_FILE + ZSTD_SUFFIX):
            raise DeltaFormatError(
                f"{file} names data file {name[:200]!r}; a delta's data file is {DATA_FILE} "
                f"or {DATA_FILE + ZSTD_SUFFIX} in its own folder, re-compress the delta"
            )
        if type(meta.get("bytes")) is not int or not isinstance(meta.get("sha256"), str):
            raise DeltaFormatError(f"{file}: {name} needs integer 'bytes' and a 'sha256'")
    _refuse_links_out(path, file)
    return manifest


def _refuse_links_out(folder: Path, file: Path) -> None:
    """A server reads deltas only from folders it was told to trust: a manifest or data
    file that links elsewhere would let a tenant's folder read any file of the host."""
    if not file.resolve().is_relative_to(folder.resolve()):
        raise DeltaFormatError(
            f"{file} is a link that leaves the delta folder {folder}; copy the file into the "
            "folder instead of linking to it"
        )


def read_delta(folder: str | os.PathLike) -> CompressedDelta:
    """Load and verify a delta folder; raises DeltaFormatError with the reason, loads nothing
    half-way."""
    path = Path(folder).expanduser()
    manifest = read_manifest(path)
    tensors = _read_verified_tensors(path, manifest["files"])
    layers = {entry["name"]: _layer_from(entry, tensors) for entry in manifest["layers"]}
    params = {entry["name"]: _param_from(entry, tensors) for entry in manifest["params"]}
    return CompressedDelta(path.resolve(), manifest, layers, params)


def _read_verified_tensors(path: Path, files: dict) -> dict[str, torch.Tensor]:
    if len(files) != 1:
        raise DeltaFormatError(f"{path / MANIFEST} must name exactly one data file")
    ((name, meta),) = files.items()
    file = path / name
    if not file.is_file():
        raise DeltaFormatError(f"{file} is missing; copy the whole delta folder")
    _refuse_links_out(path, file)
    size = file.stat().st_size
    if size != meta.get("bytes"):
        raise DeltaFormatError(
            f"{file} has {size} bytes, the manifest says {meta.get('bytes')}: the file is "
            "truncated or was modified; copy the delta folder again"
        )
    with open(file, "rb") as handle:  # read once: the bytes hashed are the bytes parsed
        payload = handle.read(size + 1)
    digest = hashlib.sha256(payload).hexdigest()
    if len(payload) != size or digest != meta.get("sha256"):
        raise DeltaFormatError(
            f"{file} has sha256 {digest[:16]}..., the manifest says "
            f"{str(meta.get('sha256'))[:16]}...: the file was tampered with or corrupted; "
            "copy the delta folder again"
        )
    if name.endswith(ZSTD_SUFFIX):
        import zstandard

        limit = max(MIN_INFLATED_BYTES, MAX_INFLATION * len(payload))
        try:
            reader = zstandard.ZstdDecompressor().stream_reader(payload)
            payload = reader.read(limit + 1)  # a bounded read: no zstd bomb fills memory
        except zstandard.ZstdError as err:
            raise DeltaFormatError(f"{file} is not valid zstd data: {err}") from err
        if len(payload) > limit:
            raise DeltaFormatError(
                f"{file} inflates to more than {limit} bytes ({MAX_INFLATION}x its size), "
                "more than any delta compresses; it is not a delta written by symbiont"
            )
    try:
        return load_safetensors(payload)
    except Exception as err:  # safetensors raises its own error types for bad bytes
        raise DeltaFormatError(f"{file} is not a valid safetensors file: {err}") from err


def _tensor(tensors: dict, key: str) -> torch.Tensor:
    if key not in tensors:
        raise DeltaFormatError(f"tensor {key!r} named by the manifest is not in the data file")
    return tensors[key]


def _layer_from(entry: dict, tensors: dict) -> PackedLayer:
    try:
        name, shape = entry["name"], tuple(int(n) for n in entry["shape"])
        bits, sparsity, group_size = int(entry["bits"]), entry["sparsity"], int(entry["group_size"])
    except (KeyError, TypeError, ValueError) as err:
        raise DeltaFormatError(f"manifest layer entry {entry!r} is malformed: {err}") from err
    if len(shape) != 2 or min(shape) < 1:
        raise DeltaFormatError(f"layer {name}: shape {list(shape)} is not [out, in]")
    if sparsity not in ("2:4", "none"):
        raise DeltaFormatError(f"layer {name}: unknown sparsity {sparsity!r} (2:4 or none)")
    two_four = sparsity == "2:4"
    layer = PackedLayer(
        name=name,
        shape=shape,
        bits=bits,
        two_four=two_four,
        group_size=group_size,
        codes=_tensor(tensors, f"{name}.codes"),
        mask=_tensor(tensors, f"{name}.mask") if two_four else tensors.get(f"{name}.mask"),
        scale=_tensor(tensors, f"{name}.scale"),
        zero=_tensor(tensors, f"{name}.zero"),
    )
    if not two_four and layer.mask is not None:
        raise DeltaFormatError(
            f"layer {name}: the manifest says sparsity none but the file holds a mask"
        )
    layer.validate()
    return layer


def _param_from(entry: dict, tensors: dict) -> ParamDelta:
    try:
        name, kind, shape = entry["name"], entry["kind"], tuple(int(n) for n in entry["shape"])
    except (KeyError, TypeError, ValueError) as err:
        raise DeltaFormatError(f"manifest parameter entry {entry!r} is malformed: {err}") from err
    rows = tensors.get(f"{name}.rows")
    param = ParamDelta(name, kind, shape, _tensor(tensors, f"{name}.delta"), rows)
    param.validate()
    return param
