"""The problem description shared by the kernel, its tests, the analysis and the tuner.

* ``ModelShape``: per-shard attention config (heads, head_dim, dtypes).
* ``ServingLimits``: the static bounds a server compiles for (page size, token budget ...).
* ``Workload``: one ragged batch's metadata (per-sequence ``q_len`` and ``kv_len``, and the
  ``(i, j, k)`` case split), plus helpers that turn it into kernel inputs.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from .config import Case, cdiv, get_kv_cache_shape


@dataclasses.dataclass(frozen=True)
class ModelShape:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    q_dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"

    def __post_init__(self):
        for f in ("num_q_heads", "num_kv_heads", "head_dim"):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"{f}={v!r} must be a positive int")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads={self.num_q_heads} is not divisible by num_kv_heads={self.num_kv_heads}")

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


@dataclasses.dataclass(frozen=True)
class ServingLimits:
    page_size: int = 128
    max_num_tokens: int = 512
    max_num_seqs: int = 128
    max_model_len: int = 8192

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"{f.name}={v!r} must be a positive int")

    @property
    def pages_per_seq(self) -> int:
        return cdiv(self.max_model_len, self.page_size)


@dataclasses.dataclass(frozen=True)
class Workload:
    """Per-sequence ``q_lens``/``kv_lens`` (kv includes the new tokens) and the case split:
    sequences ``[0, i)`` decode, ``[i, j)`` prefill, ``[j, k)`` mixed, ``k = len(q_lens)``."""

    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    distribution: tuple[int, int, int]

    def __post_init__(self):
        object.__setattr__(self, "q_lens", tuple(int(x) for x in self.q_lens))
        object.__setattr__(self, "kv_lens", tuple(int(x) for x in self.kv_lens))
        object.__setattr__(self, "distribution", tuple(int(x) for x in self.distribution))
        n = len(self.q_lens)
        if len(self.kv_lens) != n:
            raise ValueError(f"{len(self.q_lens)} q_lens but {len(self.kv_lens)} kv_lens")
        i, j, k = self.distribution
        if not 0 <= i <= j <= k == n:
            raise ValueError(f"distribution={self.distribution} must satisfy 0 <= i <= j <= k == {n}")
        for s, (q, kv) in enumerate(zip(self.q_lens, self.kv_lens)):
            if q < 1 or kv < q:
                raise ValueError(f"sequence {s}: need 1 <= q_len <= kv_len, got q_len={q}, kv_len={kv}")
            if s < i and q != 1:
                raise ValueError(f"sequence {s} is a decode sequence but q_len={q} (decode needs 1)")

    # -- constructors ---------------------------------------------------------------
    @classmethod
    def of_case(cls, case: Case | str, q_lens: Sequence[int], kv_lens: Sequence[int]) -> "Workload":
        """All sequences in one case."""
        n = len(q_lens)
        case = Case.parse(case)
        dist = {Case.DECODE: (n, n, n), Case.PREFILL: (0, n, n), Case.MIXED: (0, 0, n), Case.VERIFY: (0, 0, n)}[case]
        return cls(tuple(q_lens), tuple(kv_lens), dist)

    @classmethod
    def concat(cls, decode: "Workload | None" = None, prefill: "Workload | None" = None,
               mixed: "Workload | None" = None) -> "Workload":
        parts = [w or cls((), (), (0, 0, 0)) for w in (decode, prefill, mixed)]
        q = sum((w.q_lens for w in parts), ())
        kv = sum((w.kv_lens for w in parts), ())
        i = len(parts[0].q_lens)
        j = i + len(parts[1].q_lens)
        return cls(q, kv, (i, j, len(q)))

    # -- derived --------------------------------------------------------------------
    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    def case_range(self, case: Case) -> tuple[int, int]:
        i, j, k = self.distribution
        return {Case.DECODE: (0, i), Case.PREFILL: (i, j), Case.MIXED: (j, k), Case.VERIFY: (j, k)}[Case.parse(case)]

    def check_fits(self, limits: ServingLimits) -> None:
        if self.num_seqs > limits.max_num_seqs:
            raise ValueError(f"workload has {self.num_seqs} sequences > max_num_seqs={limits.max_num_seqs}")
        if self.num_tokens > limits.max_num_tokens:
            raise ValueError(f"workload has {self.num_tokens} tokens > max_num_tokens={limits.max_num_tokens}")
        if self.kv_lens and max(self.kv_lens) > limits.max_model_len:
            raise ValueError(f"workload kv_len {max(self.kv_lens)} > max_model_len={limits.max_model_len}")

    def metadata(self, limits: ServingLimits, *, seed: int = 0, shuffle_pages: bool = True):
        """Kernel metadata arrays (NumPy int32) and the number of pages they reference.

        Each sequence gets its own pages; with ``shuffle_pages`` they are a random
        permutation of the pool, so sequences span non-contiguous pages.
        """
        self.check_fits(limits)
        S, ps, pps = limits.max_num_seqs, limits.page_size, limits.pages_per_seq
        kv_lens = np.zeros(S, np.int32)
        kv_lens[: self.num_seqs] = self.kv_lens
        cu = np.zeros(S + 1, np.int32)
        cu[1: self.num_seqs + 1] = np.cumsum(self.q_lens)
        cu[self.num_seqs + 1:] = cu[self.num_seqs]
        used = [cdiv(kv, ps) for kv in self.kv_lens]
        num_pages = max(1, sum(used)) + 1  # one spare page that no sequence owns
        pool = np.arange(num_pages, dtype=np.int32)
        if shuffle_pages:
            pool = np.random.default_rng(seed).permutation(pool).astype(np.int32)
        page_indices = np.zeros(S * pps, np.int32)
        nxt = 0
        for s, u in enumerate(used):
            page_indices[s * pps: s * pps + u] = pool[nxt: nxt + u]
            nxt += u
        return dict(kv_lens=kv_lens, page_indices=page_indices, cu_q_lens=cu,
                    distribution=np.asarray(self.distribution, np.int32)), num_pages


def make_inputs(model: ModelShape, limits: ServingLimits, workload: Workload, *, seed: int = 0,
                num_pages: int | None = None):
    """Seeded random kernel inputs (NumPy / ml_dtypes arrays) for a workload.

    The cache is filled with random values everywhere, so a test can check that slots
    the call must not write stay bit-identical.
    """
    import ml_dtypes  # noqa: F401  (registers bfloat16 / float8 with NumPy)
    rng = np.random.default_rng(seed)
    meta, needed = workload.metadata(limits, seed=seed)
    num_pages = max(num_pages or 0, needed)
    T = limits.max_num_tokens
    qd, kvd = np.dtype(model.q_dtype), np.dtype(model.kv_dtype)
    q = rng.standard_normal((T, model.num_q_heads, model.head_dim), np.float32).astype(qd)
    k = rng.standard_normal((T, model.num_kv_heads, model.head_dim), np.float32).astype(qd)
    v = rng.standard_normal((T, model.num_kv_heads, model.head_dim), np.float32).astype(qd)
    shape = get_kv_cache_shape(num_pages, limits.page_size, model.num_kv_heads, model.head_dim, kvd)
    cache = rng.standard_normal(shape, np.float32).astype(kvd)
    return dict(queries=q, keys=k, values=v, kv_cache=cache, **meta)
