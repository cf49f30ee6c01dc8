"""Converted weights kept on disk, so a second start neither parses nor dequantizes a file.

A GGUF file costs seconds to open (its metadata, tokenizer included, is parsed field by
field) and seconds more to dequantize. The first start saves what came out: the Hugging
Face style config, and every parameter in jaxpage's layout (linears [in, out], KV heads
not yet repeated) in the dtype it runs in. Later starts memory-map the saved tensors.

Layout under ``root`` (``$JAXPAGE_CACHE_DIR/weights``), one directory per source file::

    <sha256(absolute path)[:16]>/
        source.json                    path, size, mtime_ns, format, hf_config
        <dtype>[-<variant>]-<arch digest>/   one entry per dtype and architecture as run
                                       (variant: which parameters keep GGUF blocks)
            manifest.json              per tensor: keys, offset, shape, crc32
            params.bin                 the tensors, each 64-byte aligned

Invariants:

* An entry is never trusted: ``source.json`` must name the file's current size and mtime
  (else the whole directory is stale and removed), the manifest must match the format,
  dtype and architecture, ``params.bin`` its recorded size, and every tensor its CRC-32
  as it is read. Anything else raises ``StaleEntry`` and the caller converts again.
* Entries are written whole or not at all: into a temporary directory, renamed into
  place last. Two processes converting at once both succeed; one rename wins.
* A file of an entry is never modified in place, only replaced by a rename: on the CPU
  ``jnp.asarray`` of a memory-mapped tensor keeps the mapping (no copy), so a running
  engine's params are the file's pages.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import zlib
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from jaxpage.arch_config import ArchConfig

logger = logging.getLogger("jaxpage")

FORMAT = 1
_ALIGN = 64


class StaleEntry(Exception):
    """A cache entry that does not match its source or its own manifest."""


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _bytes(array: np.ndarray) -> memoryview:
    """The array's bytes without a copy (bfloat16 has no buffer format of its own)."""
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def _crc32(array: np.ndarray) -> int:
    return zlib.crc32(_bytes(array))


def _write_json(path: Path, value: Any) -> None:
    temporary = path.with_name(f"{path.name}.tmp{os.getpid()}")
    temporary.write_text(json.dumps(value))
    os.replace(temporary, path)


class ConvertedCache:
    """The cache of one source file (see the module)."""

    def __init__(self, root: str | os.PathLike, source_path: str) -> None:
        path = os.path.abspath(source_path)
        stat = os.stat(path)
        self.stamp = {"format": FORMAT, "path": path, "size": stat.st_size,
                      "mtime_ns": stat.st_mtime_ns}
        self.directory = Path(root, _digest(path)[:16])

    # -- the config -------------------------------------------------------------------

    def read_config(self) -> dict[str, Any] | None:
        """The saved HF config, or None (nothing saved, or saved for another version of
        the file: then every entry of the file is removed)."""
        try:
            saved = json.loads((self.directory / "source.json").read_text())
            config = saved.pop("hf_config")
            self.tensor_types = saved.pop("tensor_types", None)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, AttributeError, TypeError):
            saved, config = None, None
        if saved != self.stamp or not isinstance(config, dict):
            logger.info("converted weights under %s are stale; converting again",
                        self.directory)
            shutil.rmtree(self.directory, ignore_errors=True)
            return None
        return config

    tensor_types: dict[str, str] | None = None  # as read by read_config (None: not saved)

    def write_config(self, hf_config: dict[str, Any],
                     tensor_types: dict[str, str] | None = None) -> None:
        """Save the HF config (and each tensor's stored type, by HF name)."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            _write_json(self.directory / "source.json", {**self.stamp, "hf_config": hf_config,
                                                          "tensor_types": tensor_types})
        except OSError as error:  # a read-only or full disk costs speed, not correctness
            logger.warning("converted weights not cached (%s)", error)

    # -- the tensors ------------------------------------------------------------------

    def _entry(self, dtype: Any, arch: ArchConfig,
               variant: str = "") -> tuple[Path, dict[str, Any]]:
        name = np.dtype(dtype).name + (f"-{variant}" if variant else "")
        arch_text = repr(dataclasses.astuple(arch))
        identity = {**self.stamp, "dtype": name, "arch": arch_text}
        return self.directory / f"{name}-{_digest(arch_text)[:12]}", identity

    def load(self, dtype: Any, arch: ArchConfig,
             variant: str = "") -> Iterator[tuple[tuple, Any]] | None:
        """The saved (keys, array) pairs, memory-mapped, or None when there is no entry.
        ``variant`` names what else the entry depends on (e.g. which parameters keep their
        quantized blocks); such parameters come back as dicts of their parts.

        Each array's CRC-32 is checked as it is yielded; a mismatch (or any other
        disagreement with the manifest) raises ``StaleEntry``.
        """
        entry, identity = self._entry(dtype, arch, variant)
        try:
            manifest = json.loads((entry / "manifest.json").read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:
            raise StaleEntry(f"{entry}: unreadable manifest ({error})") from error
        if not isinstance(manifest, dict) or manifest.get("identity") != identity:
            raise StaleEntry(f"{entry}: manifest of another source, dtype or architecture")
        data = entry / "params.bin"
        try:
            if data.stat().st_size != manifest["nbytes"]:
                raise StaleEntry(f"{data}: {data.stat().st_size} bytes, expected "
                                 f"{manifest['nbytes']}")
        except (OSError, KeyError, TypeError) as error:
            raise StaleEntry(f"{entry}: {error}") from error
        return self._tensors(data, manifest, np.dtype(dtype))

    @staticmethod
    def _tensors(data: Path, manifest: dict[str, Any],
                 dtype: np.dtype) -> Iterator[tuple[tuple, Any]]:
        """Records are [keys, offset, shape, crc] (an array of the entry's dtype) or
        [keys, offset, shape, crc, dtype, part] (one part of a quantized parameter; a
        parameter's parts are consecutive)."""
        try:
            raw = np.memmap(data, dtype=np.uint8, mode="r") if manifest["nbytes"] else None
            pending: tuple[tuple, dict[str, np.ndarray]] | None = None
            for record in manifest["tensors"]:
                keys, offset, shape, crc = record[:4]
                kind = np.dtype(record[4]) if len(record) > 4 else dtype
                count = int(np.prod(shape, dtype=np.int64))
                array = raw[offset:offset + count * kind.itemsize].view(kind).reshape(shape)
                if _crc32(array) != crc:
                    raise StaleEntry(f"{data}: tensor {keys} fails its checksum")
                keys = tuple(keys)
                if pending is not None and (len(record) <= 4 or pending[0] != keys):
                    yield pending
                    pending = None
                if len(record) > 4:
                    pending = pending or (keys, {})
                    pending[1][record[5]] = array
                else:
                    yield keys, array
            if pending is not None:
                yield pending
        except (OSError, ValueError, TypeError, KeyError, IndexError) as error:
            raise StaleEntry(f"{data}: does not match its manifest ({error})") from error

    def save(self, dtype: Any, arch: ArchConfig, arrays: Iterable[tuple[tuple, Any]],
             nbytes: int = 0, variant: str = "") -> Iterator[tuple[tuple, Any]]:
        """Pass ``arrays`` through, converted to ``dtype``, writing each to a new entry;
        the entry appears once the last one is written (never on an error). A dict (a
        quantized parameter's parts) is written part by part, each in its own dtype.

        ``nbytes``: about how much will be written; nothing is when that is more than half
        the free disk space. A failure to write (disk full, read-only) is logged and the
        arrays still flow.
        """
        entry, identity = self._entry(dtype, arch, variant)
        temporary = entry.with_name(f"{entry.name}.tmp{os.getpid()}")
        dtype = np.dtype(dtype)
        writer = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.directory).free
            if nbytes > free // 2:
                logger.info("converted weights not cached: %.1f GiB, %.1f GiB free",
                            nbytes / 2**30, free / 2**30)
            else:
                shutil.rmtree(temporary, ignore_errors=True)
                temporary.mkdir(parents=True)
                writer = open(temporary / "params.bin", "wb")
        except OSError as error:
            logger.warning("converted weights not cached (%s)", error)
        tensors, offset = [], 0
        try:
            for keys, array in arrays:
                if isinstance(array, dict):
                    array = {part: np.ascontiguousarray(value) for part, value in array.items()}
                    pieces = [(value, [value.dtype.name, part]) for part, value in array.items()]
                else:
                    array = np.ascontiguousarray(np.asarray(array, dtype=dtype))
                    pieces = [(array, [])]
                for piece, extra in pieces:
                    if writer is None:
                        break
                    try:
                        padding = -offset % _ALIGN
                        writer.write(b"\0" * padding)
                        offset += padding
                        writer.write(_bytes(piece))
                        tensors.append([list(keys), offset, list(piece.shape), _crc32(piece),
                                        *extra])
                        offset += piece.nbytes
                    except OSError as error:
                        logger.warning("converted weights not cached (%s)", error)
                        writer.close()
                        writer = None
                yield keys, array
            if writer is not None:
                writer.close()
                writer = None
                self._commit(temporary, entry, {"identity": identity, "nbytes": offset,
                                                "tensors": tensors})
        finally:
            if writer is not None:
                writer.close()
            shutil.rmtree(temporary, ignore_errors=True)

    @staticmethod
    def _commit(temporary: Path, entry: Path, manifest: dict[str, Any]) -> None:
        try:
            _write_json(temporary / "manifest.json", manifest)
            shutil.rmtree(entry, ignore_errors=True)  # a stale entry of the same name
            os.rename(temporary, entry)
        except OSError as error:  # full disk, or another process renamed its copy first
            logger.info("converted weights not cached (%s)", error)

    def discard(self, dtype: Any, arch: ArchConfig, variant: str = "") -> None:
        shutil.rmtree(self._entry(dtype, arch, variant)[0], ignore_errors=True)
