"""The two small configuration records of ``qops.llama``: the model's shape (``LlamaArgs``) and
what is quantized and how (``QuantConfig``)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

ACT_SCHEMES = ("dynamic", "static")
KV_DTYPES = ("int8", "int4", "fp16")
KV_GROUPS = (1, 4)
WEIGHT_GROUPS = (64, 128)  # int4 weights: channels of K per scale (qops.w4a16_gemm's group sizes)
_SQ_DEFAULT = ("qkv", "gate_up", "down")
# the Hugging Face model types qops.llama runs (the Llama decoder and its close relatives)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
QKV_BIAS_FAMILIES: tuple[str, ...] = ("qwen2",)  # q/k/v projections with biases (o and the MLP without)
QK_NORM_FAMILIES: tuple[str, ...] = ("qwen3",)  # RMSNorm of each q and k head before RoPE


@dataclass
class LlamaArgs:
    """The shape of a Llama model (what ``qops.llama`` needs of a ``transformers.LlamaConfig``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    model_type: str = "llama"
    qkv_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_hf(cls, cfg) -> LlamaArgs:
        """From a ``transformers.LlamaConfig`` (transformers 4.x or 5.x), or the config of another
        family of the Llama architecture: ``MistralConfig``, ``Qwen2Config`` (q/k/v biases:
        ``qkv_bias``), ``Qwen3Config`` (per-head RMSNorm of q and k: ``qk_norm``)."""
        model_type = str(getattr(cfg, "model_type", None) or "llama")
        heads = cfg.num_attention_heads
        theta = getattr(cfg, "rope_theta", None)
        if theta is None:
            theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(theta),
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            bos_token_id=getattr(cfg, "bos_token_id", None),
            eos_token_id=getattr(cfg, "eos_token_id", None),
            model_type=model_type,
            qkv_bias=model_type in QKV_BIAS_FAMILIES,
            qk_norm=model_type in QK_NORM_FAMILIES,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def qkv_size(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim


@dataclass
class QuantConfig:
    """What ``qops.llama.quantize`` quantizes.

    Attributes:
        weights: what the linears q/k/v (fused), o, gate/up (fused) and down become.
            ``"int8"`` (or ``True``, its synonym; the default): W8A8, int8 weights with
            per-output-channel scales and int8 activations (``qops.w8a8_gemm``). ``"int4"``:
            W4A16, int4 weights with one scale (and zero) per group of ``group_size`` input
            channels, RTN-quantized (``qops.w4a16.quantize_weight_int4``), and float16/bfloat16
            activations (``qops.w4a16_gemm``). ``False`` keeps float linears (the KV-only and
            fp16 variants of the same harness). Stored normalized: ``False``, ``True`` (W8A8)
            or ``"int4"``.
        group_size: int4 weights: input channels per scale (and zero), 64 or 128.
        weight_zeros: int4 weights: asymmetric quantization, a scale and a zero per group
            (``q * scale + zero``), instead of symmetric, scale-only (``q * scale``).
        activations: W8A8: ``"dynamic"`` per-token scales computed on the fly (default), or
            ``"static"`` per-tensor scales calibrated once (needs calibration tokens). W4A16 keeps
            the activations in float16/bfloat16: ``"static"`` is refused.
        kv_cache: ``"int8"`` (paged int8 cache + the int8 decode kernel), ``"int4"`` (paged int4
            rows with fp16 scale/shift per group + ``qops.int4_gqa_decode``; optionally SKVQ's
            full-precision sinks and window, docs/int4.md) or ``"fp16"`` (a paged cache in the
            model's dtype, attention in PyTorch).
        kv_scales: ``"dynamic"`` per-(token, head) scales written with the cache (default), or
            ``"static"`` per-layer per-tensor scales calibrated once (int8 cache only).
        kv_groups: int4 cache: scale/shift groups per (token, head) row, 1 or 4.
        kv_window: int4 cache: the newest ``kv_window`` tokens of each sequence stay in full
            precision (SKVQ's sliding window; 0: none).
        kv_sinks: int4 cache: the first ``kv_sinks`` tokens of each sequence stay in full
            precision (attention sinks; 0: none).
        kv_clip: int4 cache: SKVQ's clipping ratio in (0, 1] (1: plain min/max quantization).
        smoothquant: W8A8: migrate activation outliers into the weights (SmoothQuant) before
            quantizing; needs calibration tokens. Refused with int4 weights (W4A16 does not
            quantize activations; smoothing would only make the weights harder to quantize).
        smooth_alpha: migration strength ``alpha`` in ``s = amax(x)^a / amax(W)^(1-a)``.
        smooth_targets: which linears to smooth: ``"qkv"`` and ``"gate_up"`` (folded into the
            RMSNorm weights), ``"down"`` (folded into up_proj), ``"o"`` (folded into v_proj).
            Default: qkv, gate_up and down (on SmolLM2, down's input holds the outliers that
            cost the most; o gains little).
        block_size: tokens per KV-cache block.
    """

    weights: bool | str = True
    activations: str = "dynamic"
    kv_cache: str = "int8"
    kv_scales: str = "dynamic"
    smoothquant: bool = False
    smooth_alpha: float = 0.5
    smooth_targets: tuple[str, ...] = _SQ_DEFAULT
    block_size: int = 16
    kv_groups: int = 1
    kv_window: int = 0
    kv_sinks: int = 0
    kv_clip: float = 1.0
    group_size: int = 128
    weight_zeros: bool = False

    def __post_init__(self) -> None:
        w = self.weights
        if w is True or w == "int8":
            self.weights = True  # stored as before W4A16: W8A8 configs (and their JSON) unchanged
        elif w is not False and w != "int4":
            raise ValueError(
                f"QuantConfig.weights must be False (float linears), True or 'int8' (W8A8) or 'int4' (W4A16), got {w!r}"
            )
        if self.group_size not in WEIGHT_GROUPS:
            raise ValueError(f"QuantConfig.group_size must be one of {WEIGHT_GROUPS}, got {self.group_size!r}")
        if (self.group_size, self.weight_zeros) != (128, False) and self.weights != "int4":
            raise ValueError(
                f"QuantConfig: group_size and weight_zeros apply to weights='int4', got weights={self.weights!r}"
            )
        if self.weights == "int4":
            if self.smoothquant:
                raise ValueError(
                    "QuantConfig: smoothquant=True applies to W8A8 (weights='int8'): W4A16 (weights='int4') "
                    "keeps the activations in float16/bfloat16, there is no activation range to smooth"
                )
            if self.activations != "dynamic":
                raise ValueError(
                    f"QuantConfig: activations={self.activations!r} applies to W8A8 (weights='int8'): W4A16 "
                    f"(weights='int4') does not quantize activations; leave activations='dynamic' (unused)"
                )
        if self.activations not in ACT_SCHEMES:
            raise ValueError(f"QuantConfig.activations must be one of {ACT_SCHEMES}, got {self.activations!r}")
        if self.kv_scales not in ACT_SCHEMES:
            raise ValueError(f"QuantConfig.kv_scales must be one of {ACT_SCHEMES}, got {self.kv_scales!r}")
        if self.kv_cache not in KV_DTYPES:
            raise ValueError(f"QuantConfig.kv_cache must be one of {KV_DTYPES}, got {self.kv_cache!r}")
        if self.kv_groups not in KV_GROUPS:
            raise ValueError(f"QuantConfig.kv_groups must be one of {KV_GROUPS}, got {self.kv_groups!r}")
        if (
            not (isinstance(self.kv_window, int) and isinstance(self.kv_sinks, int))
            or min(self.kv_window, self.kv_sinks) < 0
        ):
            raise ValueError(
                f"QuantConfig.kv_window and kv_sinks must be ints >= 0, got {self.kv_window!r} and {self.kv_sinks!r}"
            )
        if not 0.0 < self.kv_clip <= 1.0:
            raise ValueError(f"QuantConfig.kv_clip must be in (0, 1], got {self.kv_clip}")
        int4_opts = (self.kv_groups, self.kv_window, self.kv_sinks, self.kv_clip) != (1, 0, 0, 1.0)
        if int4_opts and self.kv_cache != "int4":
            raise ValueError(
                f"QuantConfig: kv_groups, kv_window, kv_sinks and kv_clip apply to kv_cache='int4', "
                f"got kv_cache={self.kv_cache!r}"
            )
        if self.kv_scales == "static" and self.kv_cache != "int8":
            raise ValueError(f"QuantConfig: static kv_scales need kv_cache='int8', got kv_cache={self.kv_cache!r}")
        bad = set(self.smooth_targets) - {"qkv", "gate_up", "down", "o"}
        if bad:
            raise ValueError(f"QuantConfig.smooth_targets: unknown targets {sorted(bad)}")
        if not 0.0 <= self.smooth_alpha <= 1.0:
            raise ValueError(f"QuantConfig.smooth_alpha must be in [0, 1], got {self.smooth_alpha}")
        self.smooth_targets = tuple(self.smooth_targets)

    @property
    def w8a8(self) -> bool:
        """int8 weights and int8 activations (``weights=True`` or ``"int8"``)."""
        return self.weights is True

    @property
    def w4a16(self) -> bool:
        """int4 weights, float16/bfloat16 activations (``weights="int4"``)."""
        return self.weights == "int4"

    @property
    def needs_calibration(self) -> bool:
        return (
            (self.smoothquant and self.w8a8)
            or (self.w8a8 and self.activations == "static")
            or (self.kv_cache == "int8" and self.kv_scales == "static")
        )

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["smooth_targets"] = list(self.smooth_targets)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> QuantConfig:
        d = dict(d)
        d["smooth_targets"] = tuple(d.get("smooth_targets", _SQ_DEFAULT))
        return cls(**d)

    @property
    def skvq(self) -> bool:
        """An int4 cache with full-precision sinks or a window beside it (SKVQ)."""
        return self.kv_cache == "int4" and self.kv_window + self.kv_sinks > 0

    def kv_label(self) -> str:
        """The KV part of ``label()``: ``KV8[-static]``, ``KV4[-g4][-w<window>][s<sinks>][-c<clip>]``
        or ``""`` (a float cache)."""
        if self.kv_cache == "int8":
            return "KV8" + ("-static" if self.kv_scales == "static" else "")
        if self.kv_cache != "int4":
            return ""
        name = "KV4" + ("-g4" if self.kv_groups == 4 else "")
        if self.kv_window or self.kv_sinks:
            w = f"w{self.kv_window}" if self.kv_window else ""
            name += f"-{w}" + (f"s{self.kv_sinks}" if self.kv_sinks else "")
        if self.kv_clip != 1.0:
            name += f"-c{self.kv_clip:g}"
        return name

    def weight_label(self) -> str:
        """The weights' part of ``label()``: ``W8A8[-static]``, ``W4A16[-g64][-asym]`` or ``""``
        (float linears)."""
        if self.w8a8:
            return "W8A8" + ("-static" if self.activations == "static" else "")
        if self.w4a16:
            return "W4A16" + ("-g64" if self.group_size == 64 else "") + ("-asym" if self.weight_zeros else "")
        return ""

    def label(self) -> str:
        """A short name: ``fp16``, ``KV8``, ``KV4``, ``W8A8``, ``W8A8+KV8``, ``W4A16``,
        ``W4A16+KV8``, with ``-static`` for static scales, the int4 weights' options
        (``W4A16-g64-asym``: groups of 64 input channels, a scale and a zero per group; group 128
        and scale-only are the default), the int4 cache's options (``KV4-g4-w128s4``: 4 groups per
        row, a window of 128 and 4 sinks in full precision) and ``+SQ<alpha>`` for SmoothQuant
        (``QuantConfig.from_label`` reads it back)."""
        parts = []
        if self.weights:
            parts.append(self.weight_label())
        if self.kv_cache != "fp16":
            parts.append(self.kv_label())
        name = "+".join(parts) or "fp16"
        if self.smoothquant and self.w8a8:
            t = set(self.smooth_targets)
            suffix = {
                frozenset(_SQ_DEFAULT): "",
                frozenset(("qkv", "gate_up")): "n",
                frozenset(("qkv", "gate_up", "down", "o")): "all",
            }.get(frozenset(t))
            if suffix is None:
                suffix = "[" + ",".join(self.smooth_targets) + "]"
            name += f"+SQ{self.smooth_alpha:g}{suffix}"
        return name

    @classmethod
    def from_label(cls, name: str, **overrides) -> QuantConfig:
        """Parse a variant name: ``"fp16"``, or ``+``-joined parts ``W8A8[-static]``,
        ``W4A16`` with ``-``-joined options (``g64``/``g128``: the group size, default 128;
        ``asym``: a zero per group), ``KV8[-static]``, ``KV4`` with ``-``-joined options (``g1``/``g4``: groups per row;
        ``w<N>``, ``s<N>`` or ``w<N>s<M>``: SKVQ's full-precision window and sinks; ``c<ratio>``:
        clipping), e.g. ``KV4-g4-w128s4``, and ``SQ<alpha>`` (SmoothQuant with that alpha on qkv,
        gate_up and down), ``SQ<alpha>n`` (only the norm-folded qkv and gate_up) or
        ``SQ<alpha>all`` (also o)."""
        cfg: dict = dict(weights=False, kv_cache="fp16")
        if name not in ("fp16", "bf16"):
            for part in name.split("+"):
                if part in ("W8A8", "W8A8-static"):
                    cfg.update(weights="int8", activations="static" if part.endswith("static") else "dynamic")
                elif part == "W4A16" or part.startswith("W4A16-"):
                    cfg.update(weights="int4", **_w4_options(part, name))
                elif part in ("KV8", "KV8-static"):
                    cfg.update(kv_cache="int8", kv_scales="static" if part.endswith("static") else "dynamic")
                elif part == "KV4" or part.startswith("KV4-"):
                    cfg.update(kv_cache="int4", **_kv4_options(part, name))
                elif part.startswith("SQ"):
                    targets: tuple[str, ...]
                    spec, targets = part[2:], _SQ_DEFAULT
                    if spec.endswith("all"):
                        spec, targets = spec[:-3], ("qkv", "gate_up", "down", "o")
                    elif spec.endswith("n"):
                        spec, targets = spec[:-1], ("qkv", "gate_up")
                    elif spec.endswith("]") and "[" in spec:
                        spec, t = spec[:-1].split("[")
                        targets = tuple(t.split(","))
                    cfg.update(smoothquant=True, smooth_alpha=float(spec or 0.5), smooth_targets=targets)
                else:
                    raise ValueError(
                        f"unknown variant part {part!r} in {name!r} (expected fp16, W8A8[-static], "
                        "W4A16[-g64][-asym], KV8[-static], KV4[-g4][-w<N>s<M>][-c<ratio>], SQ<alpha>[n|all])"
                    )
        cfg.update(overrides)
        return cls(**cfg)


def _w4_options(part: str, name: str) -> dict:
    """The options of a ``W4A16[-opt]...`` part: ``g64``/``g128`` (group size), ``asym`` (zeros)."""
    opts: dict = {}
    for opt in part.split("-")[1:]:
        m = re.fullmatch(r"g([0-9]+)", opt)
        if m is not None:
            opts["group_size"] = int(m.group(1))
        elif opt == "asym":
            opts["weight_zeros"] = True
        else:
            raise ValueError(f"unknown W4A16 option {opt!r} in {name!r} (expected g64 or g128, asym)")
    return opts


def _kv4_options(part: str, name: str) -> dict:
    """The options of a ``KV4[-opt]...`` part: ``g1``/``g4``, ``w<N>``, ``s<N>``, ``w<N>s<M>``,
    ``c<ratio>``."""
    opts: dict = {}
    for opt in part.split("-")[1:]:
        m = re.fullmatch(r"g([0-9]+)|(?:w([0-9]+))?(?:s([0-9]+))?|c([0-9.]+)", opt)
        if not opt or m is None:
            raise ValueError(
                f"unknown KV4 option {opt!r} in {name!r} (expected g1 or g4, w<window>, s<sinks>, "
                "w<window>s<sinks>, c<clip ratio>)"
            )
        g, w, s, c = m.groups()
        if g is not None:
            opts["kv_groups"] = int(g)
        if w is not None:
            opts["kv_window"] = int(w)
        if s is not None:
            opts["kv_sinks"] = int(s)
        if c is not None:
            opts["kv_clip"] = float(c)
    return opts


# The variants the demo and the evaluation compare (labels as in the report).
VARIANTS = {
    "fp16": QuantConfig(weights=False, kv_cache="fp16"),
    "KV8": QuantConfig(weights=False, kv_cache="int8"),
    "KV4": QuantConfig(weights=False, kv_cache="int4"),
    "KV4-w128s4": QuantConfig(weights=False, kv_cache="int4", kv_window=128, kv_sinks=4),
    "W8A8": QuantConfig(weights=True, kv_cache="fp16"),
    "W8A8+KV8": QuantConfig(weights=True, kv_cache="int8"),
    "W8A8+KV4-w128s4": QuantConfig(weights=True, kv_cache="int4", kv_window=128, kv_sinks=4),
    "W4A16": QuantConfig(weights="int4", kv_cache="fp16"),
    "W4A16+KV8": QuantConfig(weights="int4", kv_cache="int8"),
}
