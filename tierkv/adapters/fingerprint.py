"""The engine fingerprint: what an engine says about the KV bytes it writes, named in the namespace.

A record's key is the engine's block hash (chained over token ids) and a group index: nothing in it
says which weights, which quantization or which KV layout produced the bytes. Two engines that
differ in any of those and share a tier would hand each other wrong KV under the right key. Every
adapter therefore names its namespace with an :func:`engine_namespace`: a fixed prefix and the
canonical JSON of the fields below (docs/design.md, "What a key means", says what each prevents).
The namespace is hashed into the tier's directory name with the layout, so a change of any field
is another directory (misses, never wrong bytes), and the namespace's manifest (``layout.json``)
keeps the fields readable: ``tierkv inspect URL`` prints them (:func:`parse_engine_namespace`).

A field the engine does not expose is :data:`UNKNOWN`; an adapter never fails to start for one.

The weights revision (:func:`weights_revision`) is the commit of a Hugging Face cache snapshot, or
for any other local model a digest of its weight files' names, sizes and modification times (no
byte of them is read: ``bench/fingerprint_digest.py`` measures it on 10 GB of weights).

Engines whose block hashes are seeded per process (vLLM's ``xxhash`` without ``PYTHONHASHSEED``)
write keys no other process will ask for: :func:`persistent_tiers` tells the adapters which lower
tiers outlive the process, so they can refuse such a configuration instead of filling a disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from tierkv.adapter import redact_url

__all__ = [
    "FORMAT",
    "UNKNOWN",
    "WEIGHT_SUFFIXES",
    "engine_namespace",
    "files_digest",
    "hub_commit",
    "parse_engine_namespace",
    "persistent_tiers",
    "snapshot_commit",
    "text",
    "weights_revision",
]

#: the prefix of every engine namespace (the format of what follows: canonical JSON of the fields)
FORMAT = "tierkv-engine-v1"
#: the value of a field the engine did not expose
UNKNOWN = "unknown"
#: files whose names, sizes and modification times make a local model's revision
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".ggml", ".h5", ".msgpack",
                   ".npz", ".onnx", ".tensors")
#: files beside the weights that change the KV too (the architecture, rope, head counts)
CONFIG_FILES = frozenset({"config.json", "params.json", "model.safetensors.index.json",
                          "pytorch_model.bin.index.json", "quantize_config.json", "quant_config.json",
                          "hf_quant_config.json"})
#: how deep below the model directory weight files are looked for (sharded layouts nest one level)
MAX_DEPTH = 3
_COMMIT = re.compile(r"[0-9a-f]{40}")
_SNAPSHOT = re.compile(r"(?:^|/)snapshots/([0-9a-f]{40})(?:/(.*))?$")


def text(value: Any) -> str:
    """A field's value as the namespace spells it: ``None`` and ``""`` are :data:`UNKNOWN`; enums
    by their name; everything else ``str()``."""
    if value is None or value == "":
        return UNKNOWN
    name = getattr(value, "name", None)
    if isinstance(name, str) and type(value).__module__ != "builtins" and hasattr(value, "value"):
        return name  # an Enum member
    return str(value)


def engine_namespace(fields: Mapping[str, Any], user: str = "") -> str:
    """The namespace string of an engine: :data:`FORMAT`, a space, and the canonical JSON (sorted
    keys, no spaces) of ``fields`` (values through :func:`text`) plus ``user`` (the adapter's
    ``namespace`` setting, which only ever adds). Any change of a field changes the string."""
    doc = {str(k): text(v) for k, v in fields.items()}
    doc["user"] = user
    return f"{FORMAT} " + json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def parse_engine_namespace(namespace: str | None) -> dict[str, str] | None:
    """The fields of an :func:`engine_namespace` string; None for any other namespace."""
    if not namespace or not namespace.startswith(FORMAT + " "):
        return None
    try:
        doc = json.loads(namespace[len(FORMAT) + 1:])
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    return {str(k): str(v) for k, v in doc.items()}


# ---- the weights' revision ------------------------------------------------------------------------
def snapshot_commit(path: str) -> str | None:
    """``hf:<commit>`` when ``path`` is (or is inside) a Hugging Face cache snapshot
    (``.../snapshots/<40 hex digits>/``), with the file's path inside the snapshot when it is a
    file (a GGUF, say); else None."""
    m = _SNAPSHOT.search(os.path.abspath(path).replace(os.sep, "/"))
    if m is None:
        return None
    inner = (m.group(2) or "").strip("/")
    return f"hf:{m.group(1)}" + (f":{inner}" if inner else "")


def _is_weight(name: str) -> bool:
    return name in CONFIG_FILES or name.endswith(WEIGHT_SUFFIXES)


def files_digest(path: str) -> str:
    """``files:<digest>`` of the weight files of a local model directory (or of one weight file):
    their paths relative to ``path``, sizes and modification times (nanoseconds), sorted; up to
    :data:`MAX_DEPTH` levels down, hidden directories skipped. Only ``stat`` calls: no byte of a
    weight file is read. :data:`UNKNOWN` when nothing can be listed."""
    entries: list[tuple[str, int, int]] = []
    try:
        if os.path.isfile(path):
            st = os.stat(path)
            entries.append((os.path.basename(path), st.st_size, st.st_mtime_ns))
        else:
            _scan(path, "", 0, entries)
    except OSError:
        return UNKNOWN
    if not entries:
        return UNKNOWN
    h = hashlib.sha256(b"tierkv-weights-v1\0")
    for rel, size, mtime in sorted(entries):
        h.update(f"{rel}\0{size}\0{mtime}\n".encode("utf-8", "surrogateescape"))
    return f"files:{h.hexdigest()[:32]}"


def _scan(root: str, rel: str, depth: int, out: list[tuple[str, int, int]]) -> None:
    with os.scandir(os.path.join(root, rel) if rel else root) as it:
        for e in it:
            name = e.name
            if name.startswith("."):
                continue
            sub = f"{rel}/{name}" if rel else name
            if e.is_dir():
                if depth + 1 < MAX_DEPTH:
                    _scan(root, sub, depth + 1, out)
            elif _is_weight(name):
                st = e.stat()  # follows links: a snapshot's files are links to its blobs
                out.append((sub, st.st_size, st.st_mtime_ns))


def _hub_cache() -> str:
    try:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    except Exception:
        home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
        return os.environ.get("HF_HUB_CACHE") or os.path.join(home, "hub")


def hub_commit(repo_id: str, revision: str | None = None, cache_dir: str | None = None) -> str | None:
    """The commit the local Hugging Face cache resolved ``repo_id`` at ``revision`` (default
    ``main``) to, from the cache's ``refs`` (what the engine loaded: it downloads before it
    serves); a revision that is itself a commit is taken as it is. None when the cache has no
    answer. No network."""
    if revision and _COMMIT.fullmatch(revision):
        return revision
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", repo_id or ""):
        return None
    folder = os.path.join(cache_dir or _hub_cache(), "models--" + repo_id.replace("/", "--"))
    try:
        with open(os.path.join(folder, "refs", revision or "main")) as f:
            commit = f.read().strip()
    except (OSError, ValueError):
        return None
    return commit if _COMMIT.fullmatch(commit) else None


def weights_revision(model: str | None, revision: str | None = None, cache_dir: str | None = None) -> str:
    """What names the weights an engine serves as ``model`` (a path or a hub id):

    - ``hf:<commit>`` for a Hugging Face cache snapshot directory (or a file in one), or a hub id
      the local cache resolves (``revision``, default ``main``, through its ``refs``);
    - ``files:<digest>`` for any other local directory or file (:func:`files_digest`);
    - ``rev:<revision>`` for a hub id the cache cannot resolve, when a revision was given;
    - :data:`UNKNOWN` otherwise.
    """
    if not model:
        return UNKNOWN
    if os.path.exists(model):
        commit = snapshot_commit(model)
        return commit if commit is not None else files_digest(model)
    found = hub_commit(model, revision, cache_dir)
    if found is not None:
        return f"hf:{found}"
    return f"rev:{revision}" if revision else UNKNOWN


# ---- tiers that outlive the process ---------------------------------------------------------------
_VOLATILE = frozenset({"memory", "cpu", "device"})


def persistent_tiers(tiers: Iterable[Mapping[str, Any]]) -> list[str]:
    """The lower tiers (as ``kind`` or ``kind url``) whose records outlive this process: ``fsspec``,
    ``mooncake``, a pool with a ``shm_path`` file, and any kind tierkv does not know (a plugin:
    assumed to persist). ``memory`` and plain ``cpu`` / ``device`` pools die with the process."""
    out = []
    for tier in tiers:
        kind = str(tier.get("kind", ""))
        inner = tier.get("inner")
        if isinstance(inner, Mapping):  # a wrapper (faulty): what it wraps decides
            out += [f"{kind}({d})" for d in persistent_tiers([inner])]
            continue
        if kind in _VOLATILE and not tier.get("shm_path"):
            continue
        url = tier.get("url")
        where = redact_url(str(url)) if url else (tier.get("shm_path") or tier.get("master") or "")
        out.append(f"{kind} {where}".strip())
    return out
