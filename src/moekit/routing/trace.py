"""RoutingTrace: what every MoE layer decided for every recorded (non-padding) token."""
from __future__ import annotations

import ast
import hashlib
import json
import math
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .._fs import output, regular_file
from ..errors import MoekitError

FIELDS = ("layers", "num_experts", "languages", "ids", "weights", "token", "sample", "position", "lang", "meta")
# the per-language, per-layer, per-expert sums of one-shot pruning criteria (moekit.routing.capture), last axis:
# routed (token, slot) pairs, Σ g, Σ ‖f‖₂, Σ g·‖f‖₂ (g the weight the model applies), Σ p, Σ p·‖f‖₂ (p the plain
# softmax of the router's logits); traces recorded before the plain softmax was hold the first four only
SALIENCY = ("count", "gate", "norm", "gate_norm", "softmax", "softmax_norm")
MAX_BYTES = 64 << 30  # uncompressed arrays larger than this are refused (a zip bomb, not a trace)
# config keys that leave the model as it is (an FP8 checkpoint computes as the float model it encodes)
VOLATILE = ("transformers_version", "dtype", "torch_dtype", "quantization_config")


HEADERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


class TraceError(MoekitError):
    """A trace file is unreadable or two traces cannot be merged."""


@dataclass
class RoutingTrace:
    """N tokens routed by L MoE layers with up to k experts each.

    ids (L, N, k) int16 expert ids (-1 pads layers with a smaller k), weights (L, N, k) float32
    combine weights, token/sample/position (N,) int32, lang (N,) int16 index into `languages`,
    num_experts (L,) experts per layer, layers the MoE layers' module paths; saliency (Λ, L, E, 6) float64 the sums
    of SALIENCY per language, layer and expert (E the most experts of any layer; (Λ, L, E, 4) in older traces), or
    None when not recorded.
    """

    layers: list[str]
    num_experts: np.ndarray  # (L,)
    languages: list[str]
    ids: np.ndarray  # (L, N, k)
    weights: np.ndarray  # (L, N, k)
    token: np.ndarray  # (N,)
    sample: np.ndarray  # (N,)
    position: np.ndarray  # (N,)
    lang: np.ndarray  # (N,)
    meta: dict = field(default_factory=dict)
    saliency: np.ndarray | None = None  # (Λ, L, E, 6)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_tokens(self) -> int:
        return int(self.token.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.ids.shape[-1])

    def language_mask(self, language: str) -> np.ndarray:
        """(N,) bool: tokens of `language`; raises if the trace has none."""
        if language not in self.languages:
            raise TraceError(f"language {language!r} not in trace (has {', '.join(self.languages)})")
        return self.lang == self.languages.index(language)

    def select(self, mask: np.ndarray) -> RoutingTrace:
        """The sub-trace of the tokens where `mask` (N,) is true (without saliency sums: they are per language, not
        per token)."""
        return RoutingTrace(self.layers, self.num_experts, self.languages, self.ids[:, mask],
                            self.weights[:, mask], self.token[mask], self.sample[mask], self.position[mask],
                            self.lang[mask], dict(self.meta))

    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        """Write an .npz atomically (moekit._fs.output: temporary file, then rename)."""
        self.validate(str(path))
        with output(path, overwrite=overwrite, kind="file", what="trace") as tmp, open(tmp, "wb") as f:
            np.savez_compressed(f, layers=np.array(self.layers), num_experts=self.num_experts,
                                languages=np.array(self.languages), ids=self.ids, weights=self.weights,
                                token=self.token, sample=self.sample, position=self.position, lang=self.lang,
                                meta=np.array(json.dumps(self.meta)),
                                **({} if self.saliency is None else {"saliency": self.saliency}))
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> RoutingTrace:
        """Read and validate a trace (an untrusted file: sizes, shapes, dtypes and id ranges are checked)."""
        _check_size(Path(path))
        try:
            with np.load(path, allow_pickle=False) as z:
                missing = sorted(set(FIELDS) - set(z.files))
                if missing:
                    raise TraceError(f"{path}: not a moekit routing trace (missing {', '.join(missing)})")
                trace = cls([str(s) for s in z["layers"]], z["num_experts"], [str(s) for s in z["languages"]],
                            z["ids"], z["weights"], z["token"], z["sample"], z["position"], z["lang"],
                            _read_meta(str(z["meta"])), z["saliency"] if "saliency" in z.files else None)
        except TraceError:
            raise
        except Exception as e:  # noqa: BLE001  (zipfile, numpy and OS errors of a damaged file)
            raise TraceError(f"{path}: not a moekit routing trace ({type(e).__name__}: {e})") from None
        return trace.validate(str(path))

    def validate(self, name: str = "trace") -> RoutingTrace:
        """Shapes, dtypes and ranges: ids in [-1, E) per layer (-1 pads a smaller top-k), languages indexed."""
        L, n = len(self.layers), self.token.shape[0] if self.token.ndim == 1 else -1
        shapes = {"num_experts": (self.num_experts, (L,)), "ids": (self.ids, (L, n, self.ids.shape[-1] if self.ids.ndim else 0)),
                  "weights": (self.weights, self.ids.shape), "token": (self.token, (n,)),
                  "sample": (self.sample, (n,)), "position": (self.position, (n,)), "lang": (self.lang, (n,))}
        for key, (a, shape) in shapes.items():
            kind = "f" if key == "weights" else "iu"
            if a.ndim != len(shape) or tuple(a.shape) != tuple(shape) or a.dtype.kind not in kind:
                raise TraceError(f"{name}: {key} has shape {tuple(a.shape)} ({a.dtype}), expected {tuple(shape)} "
                                 f"({'float' if kind == 'f' else 'integer'}) for {L} layers and {n} tokens")
        if L and (self.num_experts.min() < 1 or len(set(self.layers)) != L):
            raise TraceError(f"{name}: layers must be distinct and have at least one expert each")
        bad = (self.ids < -1) | (self.ids >= self.num_experts.reshape(L, 1, 1))
        if bad.any():
            li = int(np.argwhere(bad)[0][0])
            raise TraceError(f"{name}: expert ids of layer {self.layers[li]} outside [0, {int(self.num_experts[li])}) "
                             "(-1, which pads a smaller top-k, is the only other id allowed)")
        if n and (self.lang.min() < 0 or self.lang.max() >= len(self.languages)):
            raise TraceError(f"{name}: language indices outside the {len(self.languages)} languages")
        if not np.isfinite(self.weights).all():
            raise TraceError(f"{name}: routing weights are not finite")
        if self.weights.dtype != np.float32:
            raise TraceError(f"{name}: routing weights are {self.weights.dtype}, expected float32 (as moekit writes "
                             "them: sums over many tokens stay finite)")
        if self.saliency is not None:
            self._check_saliency(name)
        return self

    def _check_saliency(self, name: str) -> None:
        """(Λ, L, E, 6) float64 (or 4 columns: older traces), whole counts, finite and non-negative sums, also summed
        over the languages as the selectors sum them (moekit.selection.oneshot)."""
        a, L = self.saliency, len(self.layers)
        want = (len(self.languages), L, int(self.num_experts.max()) if L else 0)
        if a.ndim != 4 or a.shape[:3] != want or a.shape[3] not in (4, len(SALIENCY)) or a.dtype != np.float64:
            raise TraceError(f"{name}: saliency has shape {a.shape} ({a.dtype}), expected {(*want, len(SALIENCY))} "
                             f"float64 (languages, layers, experts, {' / '.join(SALIENCY)})")
        with np.errstate(over="ignore", invalid="ignore"):
            finite = np.isfinite(a.sum(0)).all()
        if not finite or (a < 0).any():
            raise TraceError(f"{name}: saliency must hold finite, non-negative sums (also summed over its "
                             f"{len(self.languages)} languages)")
        if (a[..., 0] != np.floor(a[..., 0])).any():
            raise TraceError(f"{name}: saliency counts (routed token slots) must be whole numbers")

    @classmethod
    def merge(cls, traces: list[RoutingTrace]) -> RoutingTrace:
        """Concatenate traces of the same model; sample ids are offset so they stay distinct."""
        if not traces:
            raise TraceError("nothing to merge")
        first = traces[0]
        for t in traces[1:]:
            if t.layers != first.layers or not np.array_equal(t.num_experts, first.num_experts) or \
                    t.top_k != first.top_k or t.meta.get("config_sha256") != first.meta.get("config_sha256"):
                raise TraceError("cannot merge traces of different models (layers, experts, top-k or config differ)")
        languages = list(dict.fromkeys(lang for t in traces for lang in t.languages))
        offset, parts = 0, []
        for t in traces:
            remap = np.array([languages.index(lang) for lang in t.languages], dtype=np.int16)
            parts.append((t.sample + offset, remap[t.lang] if t.num_tokens else t.lang))
            offset += int(t.sample.max()) + 1 if t.num_tokens else 0
        cat = np.concatenate
        saliency = None
        columns = {None if t.saliency is None else t.saliency.shape[-1] for t in traces}
        if len(columns) == 1 and None not in columns:  # every trace has the same sums
            saliency = np.zeros((len(languages), *first.saliency.shape[1:]))  # (Λ, L, E, 6)
            for t in traces:
                for li, lang in enumerate(t.languages):
                    saliency[languages.index(lang)] += t.saliency[li]
        return cls(first.layers, first.num_experts, languages, cat([t.ids for t in traces], axis=1),
                   cat([t.weights for t in traces], axis=1), cat([t.token for t in traces]),
                   cat([p[0] for p in parts]).astype(np.int32), cat([t.position for t in traces]),
                   cat([p[1] for p in parts]).astype(np.int16), dict(first.meta), saliency)


def config_digest(config) -> str:
    """sha256 of a transformers config as it parses (defaults filled in: a sparse config.json and its re-saved copy
    agree), without what leaves the model as it is (private keys such as its path, VOLATILE): the model a trace was
    recorded on, which its selections carry (moekit.selection.selection.Source)."""
    data = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k not in VOLATILE}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def _check_size(path: Path) -> None:
    """Refuse a file that is not a regular file, or whose arrays would decompress to more than MAX_BYTES,
    before decompressing them."""
    regular_file(path, "trace", TraceError, limit=MAX_BYTES)
    try:
        with zipfile.ZipFile(path) as z:
            size = sum(i.file_size for i in z.infolist())
            if size > MAX_BYTES:
                raise TraceError(f"{path}: its arrays would take {size / 2**30:.1f} GiB (more than {MAX_BYTES >> 30} GiB)")
            for info in z.infolist():
                _check_member(z, info, path)
    except TraceError:
        raise
    except Exception as e:  # noqa: BLE001  (zipfile, zlib and numpy's header parser: a damaged file)
        raise TraceError(f"{path}: not a moekit routing trace ({type(e).__name__}: {e})") from None


def _check_member(z: zipfile.ZipFile, info: zipfile.ZipInfo, path: Path) -> None:
    """An array's .npy header declares no more bytes than its zip entry holds (numpy allocates the declared shape
    before it reads the data): read from the header alone."""
    if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
        raise TraceError(f"{path}: the zip entry {info.filename} claims {info.file_size} bytes but stores "
                         f"{info.compress_size}")
    with z.open(info) as f:
        read = HEADERS.get(np.lib.format.read_magic(f))
        if read is None:
            raise ValueError(f"{info.filename} is not a .npy array of format 1.0 or 2.0")
        shape, _, dtype = read(f, max_header_size=10_000)
        declared = math.prod(shape) * dtype.itemsize
        if declared > info.file_size - f.tell():
            raise TraceError(f"{path}: {info.filename} declares {declared} bytes of data but holds "
                             f"{info.file_size - f.tell()}")


def _read_meta(text: str) -> dict:
    """The trace's metadata: JSON (older traces: a Python literal, read with ast.literal_eval)."""
    try:
        meta = json.loads(text)
    except ValueError:
        try:
            meta = ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError) as e:
            raise TraceError(f"unreadable trace metadata ({type(e).__name__})") from None
    except RecursionError:
        raise TraceError("trace metadata is nested too deeply") from None
    if not isinstance(meta, dict):
        raise TraceError("trace metadata must be a mapping")
    return meta
