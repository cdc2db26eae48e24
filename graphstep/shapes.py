"""Model shapes, the parallel topology and the per-rank sizes derived from them.

Every size the harness, the reference and the kernels use comes from here, so a
preset or topology change moves all of them together.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, fields, replace

Q_FORMATS = ("bf16", "fp8")
MLA_CACHE_FORMATS = ("bf16", "fp8")
# The FP8 scales (the indexer's q and k per 128, the fp8 MLA cache's latent per 128):
# "fp32" = max(amax, 1e-4) / 448; "ue8m0" = that rounded up to a power of two
# (DeepSeek-V3.2-Exp inference/kernel.py act_quant with scale_fmt set, which model.py uses
# for the indexer's q and k and, since its 2025-11 update, to simulate the FP8 MLA cache).
FP8_SCALE_FORMATS = ("fp32", "ue8m0")


def _positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}")


def check_positive_number(value, what: str, unit: str = "") -> None:
    """Raise ValueError naming `what` unless `value` is a finite int or float > 0."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"{what} must be a finite number{unit} > 0, got {value!r}")


@dataclass(frozen=True)
class RopeScaling:
    """YaRN RoPE scaling (DeepSeek-V3.2-Exp inference/model.py ModelArgs "yarn" fields; the
    Hugging Face config's rope_scaling names them type, factor, original_max_position_embeddings,
    beta_fast, beta_slow, mscale, mscale_all_dim)."""

    type: str = "yarn"
    factor: float = 40.0
    original_positions: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

    def __post_init__(self) -> None:
        if self.type != "yarn":
            raise ValueError(f"RopeScaling.type must be 'yarn', got {self.type!r}")
        _positive("RopeScaling", original_positions=self.original_positions)
        if not 1 < self.factor < math.inf:
            raise ValueError(f"RopeScaling.factor must be finite and > 1 (YaRN stretches context), got {self.factor}")
        if not math.inf > self.beta_fast >= self.beta_slow > 0:
            raise ValueError(
                f"RopeScaling needs finite beta_fast >= beta_slow > 0, got {self.beta_fast}, {self.beta_slow}"
            )
        if self.mscale != self.mscale_all_dim:
            # model.py scales the softmax by m(mscale)^2 and leaves cos/sin alone; Hugging Face
            # scales it by m(mscale_all_dim)^2 and cos/sin by m(mscale) / m(mscale_all_dim). The
            # two agree only when the two are equal (DeepSeek: 1.0 and 1.0).
            raise ValueError(f"RopeScaling.mscale must equal mscale_all_dim, got {self.mscale}, {self.mscale_all_dim}")

    @property
    def attention_factor(self) -> float:
        """m = 0.1 x mscale x ln(factor) + 1; the MLA softmax scale is multiplied by m^2."""
        return 0.1 * self.mscale * math.log(self.factor) + 1.0


@dataclass(frozen=True)
class ModelShape:
    """The query-stage shapes of one DSA layer (TP1 sizes; per-rank sizes in `RankShape`)."""

    name: str
    hidden: int = 7168
    heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_dim: int = 128
    qk_rope_dim: int = 64
    v_head_dim: int = 128
    index_heads: int = 64
    index_dim: int = 128
    index_rope_dim: int = 64
    index_topk: int = 2048
    page_size: int = 64
    rms_eps: float = 1e-6
    index_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # The context the model is built for: model.py applies YaRN only when it exceeds the
    # scaling's original positions (config_671B_v3.2.json: 163840).
    max_seq_len: int = 163840
    # Faithful to the public model by default; each can be turned off to compare with
    # engines that skip it: rope_scaling=None (plain RoPE and softmax scale),
    # index_rotation=False (no Hadamard rotation of the indexer q and k), fp8_scale_format="fp32".
    rope_scaling: RopeScaling | None = RopeScaling()
    index_rotation: bool = True
    fp8_scale_format: str = "ue8m0"
    # Fields whose values are assumed rather than taken from a public config.
    assumed: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        ints = {f.name: getattr(self, f.name) for f in fields(self) if f.type == "int"}
        _positive("ModelShape", **ints)
        for name in ("rms_eps", "index_norm_eps", "rope_theta"):
            # a norm's eps under a square root, RoPE's base under a logarithm
            check_positive_number(getattr(self, name), f"ModelShape.{name}")
        if self.q_lora_rank != 1536:
            # QueryNorm's thread mappings (192 x 8 and 32 lanes x 48) are written for 1536.
            raise ValueError(f"ModelShape.q_lora_rank must be 1536 (the kernels' mapping), got {self.q_lora_rank}")
        if self.qk_rope_dim % 2 or self.index_rope_dim % 2:
            raise ValueError("ModelShape rope dims must be even (RoPE rotates pairs)")
        if self.index_rope_dim > self.index_dim:
            raise ValueError("ModelShape.index_rope_dim must be <= index_dim")
        if self.kv_lora_rank % 128:
            raise ValueError(f"ModelShape.kv_lora_rank must be a multiple of 128, got {self.kv_lora_rank}")
        if self.fp8_scale_format not in FP8_SCALE_FORMATS:
            raise ValueError(
                f"ModelShape.fp8_scale_format must be one of {FP8_SCALE_FORMATS}, got {self.fp8_scale_format!r}"
            )
        if self.index_rotation and self.index_dim & (self.index_dim - 1):
            raise ValueError(f"ModelShape.index_rotation needs a power-of-two index_dim, got {self.index_dim}")

    @property
    def yarn(self) -> RopeScaling | None:
        """The RoPE scaling in effect: model.py (precompute_freqs_cis and MLA.__init__) applies
        YaRN's frequencies and softmax factor only if max_seq_len > original_seq_len."""
        scaling = self.rope_scaling
        return scaling if scaling is not None and self.max_seq_len > scaling.original_positions else None

    @property
    def qk_head_dim(self) -> int:
        """Per-head width of Q_B's output: nope then rope."""
        return self.qk_nope_dim + self.qk_rope_dim

    @property
    def query_row(self) -> int:
        """Absorbed query row: kv_lora_rank latent + rope = 576."""
        return self.kv_lora_rank + self.qk_rope_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times m^2 under YaRN (model.py MLA.__init__)."""
        scale = self.qk_head_dim**-0.5
        if self.yarn is not None:
            scale *= self.yarn.attention_factor**2
        return scale

    @property
    def packed_columns(self) -> dict[str, tuple[int, int]]:
        """Column ranges (start, end) of the packed projection row qkv [B, P]."""
        widths = [
            ("q_a", self.q_lora_rank),
            ("kv_a", self.kv_lora_rank),
            ("k_pe", self.qk_rope_dim),
            ("idx_k", self.index_dim),
            ("idx_w", self.index_heads),
        ]
        spans, start = {}, 0
        for name, width in widths:
            spans[name] = (start, start + width)
            start += width
        return spans

    @property
    def packed_width(self) -> int:
        """Columns of a packed qkv row: q_a | kv_a | k_pe | idx_k | idx_w (2304)."""
        return self.q_lora_rank + self.kv_lora_rank + self.qk_rope_dim + self.index_dim + self.index_heads

    @property
    def index_token_bytes(self) -> int:
        """Indexer cache bytes per token: fp8 key + one fp32 scale (132)."""
        return self.index_dim + 4

    def mla_token_bytes(self, cache_format: str = "bf16") -> int:
        """MLA cache bytes per token: bf16 576 x 2, or fp8 512 + 4 fp32 scales + 64 bf16 rope."""
        if cache_format == "bf16":
            return 2 * self.query_row
        if cache_format == "fp8":
            return self.kv_lora_rank + 4 * (self.kv_lora_rank // 128) + 2 * self.qk_rope_dim
        raise ValueError(f"MLA cache format {cache_format!r}: expected one of {MLA_CACHE_FORMATS}")


PRESETS: dict[str, ModelShape] = {
    # config_671B_v3.2.json, the rest model.py's ModelArgs defaults (YaRN: factor 40, 4096
    # original positions, beta_fast 32, beta_slow 1, mscale 1; scale_fmt "ue8m0").
    "deepseek-v3.2": ModelShape(name="deepseek-v3.2"),
    # Kimi K2 family sizes and RoPE (Kimi-K2-Instruct-0905 / K2-Thinking config.json:
    # rope_theta 50000, 262144 positions, YaRN factor 64 with beta_fast = beta_slow = 1); no
    # public K3.1 config exists, so the DSA-specific fields (heads, the indexer, its rotation
    # and FP8 scale format, taken as DeepSeek-V3.2's) are assumptions.
    "kimi-k3.1": ModelShape(
        name="kimi-k3.1",
        heads=64,
        rope_theta=50000.0,
        max_seq_len=262144,
        rope_scaling=RopeScaling(factor=64.0, beta_fast=1.0, beta_slow=1.0),
        assumed=(
            "heads",
            "index_heads",
            "index_dim",
            "index_topk",
            "index_rope_dim",
            "index_rotation",
            "fp8_scale_format",
        ),
    ),
}


def preset(name: str) -> ModelShape:
    """The ModelShape of a named preset (PRESETS); ValueError names the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}: expected one of {sorted(PRESETS)}") from None


# The most ranks a DCP group may have: CandidateSync has one lane, and DcpGroup one flag word, per
# rank (kernels/candidate_sync.py holds the same bound on the kernel side).
MAX_DCP = 32


@dataclass(frozen=True)
class Topology:
    """How one layer is spread: TP over heads, DCP over cached tokens.

    wide: the split query of TP1 (all heads on one rank); split: the split query of
    fewer heads under DCP. rank: the DCP rank this process simulates. q_format: the
    element format of the query rows and the DCP mailbox. mla_cache: the MLA cache format.
    """

    tp: int = 1
    dcp: int = 1
    wide: bool = False
    split: bool = False
    rank: int = 0
    q_format: str = "bf16"
    mla_cache: str = "bf16"

    def __post_init__(self) -> None:
        _positive("Topology", tp=self.tp, dcp=self.dcp)
        for name in ("wide", "split"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Topology.{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or not 0 <= self.rank < self.dcp:
            raise ValueError(f"Topology.rank must be an int in [0, {self.dcp}), got {self.rank!r}")
        if self.q_format not in Q_FORMATS:
            raise ValueError(
                f"Topology.q_format (query rows and mailbox) must be one of {Q_FORMATS}, got {self.q_format!r}"
            )
        if self.mla_cache not in MLA_CACHE_FORMATS:
            raise ValueError(f"Topology.mla_cache must be one of {MLA_CACHE_FORMATS}, got {self.mla_cache!r}")
        if self.wide and (self.tp != 1 or self.dcp != 1):
            raise ValueError(
                f"Topology.wide is the split query of TP1: needs tp=1, dcp=1, got tp={self.tp}, dcp={self.dcp}"
            )
        if self.split and self.dcp == 1:
            raise ValueError("Topology.split is the split query under DCP: needs dcp > 1, got dcp=1")

    @property
    def name(self) -> str:
        """A short name for tables and file names, e.g. "tp8-dcp2"."""
        parts = [f"tp{self.tp}"]
        if self.dcp > 1:
            parts.append(f"dcp{self.dcp}")
        if self.wide:
            parts.append("wide")
        if self.split:
            parts.append("split")
        return "-".join(parts)


@dataclass(frozen=True)
class RankShape:
    """Per-rank sizes of a shape under a topology."""

    model: ModelShape
    topology: Topology

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelShape) or not isinstance(self.topology, Topology):
            raise TypeError(
                "RankShape(model, topology) takes a ModelShape (e.g. preset('deepseek-v3.2')) and a Topology, "
                f"got {type(self.model).__name__} and {type(self.topology).__name__}"
            )
        if self.model.heads % self.topology.tp:
            raise ValueError(
                f"Topology.tp={self.topology.tp} must divide ModelShape.heads={self.model.heads} "
                f"(allowed tp: {[t for t in range(1, self.model.heads + 1) if self.model.heads % t == 0]})"
            )

    @property
    def heads(self) -> int:
        """MLA heads computed on this rank."""
        return self.model.heads // self.topology.tp

    @property
    def gathered(self) -> int:
        """Query head rows per token after the DCP gather (DCP x H/t)."""
        return self.topology.dcp * self.heads

    @property
    def q_heads(self) -> int:
        """Row stride of the query rows / mailbox per token: gathered, rounded up to the
        sparse core's head tile of 16 (pad rows are never published nor polled)."""
        return -(-self.gathered // 16) * 16

    @property
    def q_bytes(self) -> int:
        """Bytes per query-row value: 2 (bf16) or 1 (e4m3)."""
        return 2 if self.topology.q_format == "bf16" else 1

    @property
    def mailbox_row_chunks(self) -> int:
        """16-byte chunks per head row: 576 x q_bytes / 16 = 36 x q_bytes."""
        return self.model.query_row * self.q_bytes // 16

    @property
    def mla_token_bytes(self) -> int:
        """MLA cache bytes per token in this rank's cache format."""
        return self.model.mla_token_bytes(self.topology.mla_cache)

    def unsharded(self) -> "RankShape":
        """The layer a DCP group of this rank's topology shards: tp / dcp ranks' heads, no DCP
        (graphstep.dcp_group builds it; its caches hold every rank's tokens)."""
        topo = self.topology
        if topo.tp % topo.dcp:
            raise ValueError(f"tp {topo.tp} must be a multiple of dcp {topo.dcp}: the unsharded layer has tp / dcp")
        return RankShape(self.model, replace(topo, tp=topo.tp // topo.dcp, dcp=1, rank=0, split=False))

    def with_topology(self, **changes) -> "RankShape":
        """The same model under a topology with `changes` (dataclasses.replace)."""
        return RankShape(self.model, replace(self.topology, **changes))


def check_batch(batch: int, what: str = "batch") -> int:
    """`batch` as an int if it is a positive integer (numpy's and torch's integers too), else
    raise ValueError naming `what`."""
    try:  # (a bool, numpy's or torch's too, is no batch size)
        value = None if isinstance(batch, bool) or "bool" in str(getattr(batch, "dtype", "")) else operator.index(batch)
    except TypeError:
        value = None
    if value is None or value <= 0:
        raise ValueError(f"{what} must be a positive int, got {batch!r}")
    return value


def check_capture_sizes(capture_sizes) -> list[int]:
    """The batch sizes of a list to capture, sorted and distinct; raise naming what is wrong."""
    scalar = getattr(capture_sizes, "ndim", 1) == 0  # a 0-d numpy or torch array
    if isinstance(capture_sizes, int | str) or scalar or not hasattr(capture_sizes, "__iter__"):
        raise TypeError(f"capture_sizes must be a list of batch sizes, e.g. [1, 4], got {capture_sizes!r}")
    sizes = sorted({check_batch(size, "capture size") for size in capture_sizes})
    if not sizes:
        raise ValueError("capture_sizes must name at least one batch size")
    return sizes


def tiled_from(heads: int) -> int:
    """The batch from which the q_a RMSNorm uses the tiled (row per warp) variant.

    The row variant spends a 256-thread CTA per row; once a batch has enough rows
    that MlaQuery's grid (one CTA per head group) would recompute many rows per CTA,
    eight rows per CTA win. With fewer heads per rank there are fewer head groups,
    so the crossover comes later.
    """
    if heads <= 0:
        raise ValueError(f"heads must be positive, got {heads}")
    return 8 if heads >= 64 else 16
