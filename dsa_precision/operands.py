"""What the scoring kernels read: :class:`ScoringOperands`, the data where precision is visible.

Precision is decided once (:mod:`dsa_precision.prepare` builds the operands) and shows in the
operands' dtypes::

    bf16:  q (B, S_q, H, D) bf16   k (B, S_k, D) bf16   weights (B, S_q, H) bf16|fp32
           score = sm_scale * sum_h relu(q_h . k) * w_h
    fp8:   q (B, S_q, H, D) e4m3   k (B, S_k, D) e4m3   weights (B, S_q, H) fp32
           q_descale (B, S_q, H) fp32, k_descale (B, S_k) fp32
           score = k_descale * sum_h relu(q_h . k) * w_h,  w_h = (head weight * q_descale) * sm_scale

(the FP8 layout of DeepGEMM's ``fp8_mqa_logits`` and of cuDNN's SM90 ``precision="fp8"`` kernel:
the q descale is folded into the float32 head weights, the k descale is applied per key).
"""

from __future__ import annotations

import dataclasses

import torch

from .checks import _check_real, _check_same_device, _check_tensor
from .config import ScoringPrecision, _check_scoring_backend

__all__ = ["ScoringOperands"]

_WEIGHT_DTYPES = (torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class ScoringOperands:
    """Scoring operands, batch first (packed THD input has batch 1); see the module docstring.

    Construct through :func:`prepare_scoring_operands` / :func:`prepare_indexer_operands`, or
    directly from tensors of an engine (e.g. captured DeepGEMM operands); the constructor checks
    dtypes, shapes and devices (no data is read).
    """

    q: torch.Tensor  # (B, S_q, H, D) bf16 | float8_e4m3fn
    k: torch.Tensor  # (B, S_k, D) bf16 | float8_e4m3fn
    weights: torch.Tensor  # (B, S_q, H) bf16 | fp32; fp8: fp32 with q_descale and sm_scale folded
    q_descale: torch.Tensor | None = None  # (B, S_q, H) fp32, fp8 only (already in weights)
    k_descale: torch.Tensor | None = None  # (B, S_k) fp32, fp8 only
    sm_scale: float = 1.0  # applied by the kernel; fp8: 1.0 (folded into weights)
    # The scoring kernel the precision config chose (IndexerPrecisionConfig.scoring_backend):
    # what every scoring and select call of these operands runs unless it names another.
    backend: str = "auto"

    def __post_init__(self) -> None:
        q, k, w = self.q, self.k, self.weights
        for name, t in (("q", q), ("k", k), ("weights", w)):
            _check_tensor(name, t)
        fp8 = q.dtype == torch.float8_e4m3fn
        want = torch.float8_e4m3fn if fp8 else torch.bfloat16
        if q.dtype not in (torch.float8_e4m3fn, torch.bfloat16) or k.dtype != want:
            raise TypeError(
                f"ScoringOperands take bf16 or float8_e4m3fn q and k of the same dtype; got q "
                f"{q.dtype}, k {k.dtype} (build them with prepare_scoring_operands)."
            )
        if q.ndim != 4 or k.ndim != 3 or w.ndim != 3:
            raise ValueError(
                f"ScoringOperands are q (B, S_q, H, D), k (B, S_k, D), weights (B, S_q, H); got "
                f"q {tuple(q.shape)}, k {tuple(k.shape)}, weights {tuple(w.shape)}."
            )
        b, sq, h, d = q.shape
        if h == 0 or d == 0:
            which = "H = q.shape[2], the head count" if h == 0 else "D = q.shape[3], the head dim"
            raise ValueError(
                f"q has shape {tuple(q.shape)} (B, S_q, H, D): {which}, is 0, so {h} heads of "
                f"width {d} score nothing (every score would be 0); the indexer needs at least "
                "one head of nonzero width."
            )
        if k.shape[0] != b or k.shape[2] != d or tuple(w.shape) != (b, sq, h):
            raise ValueError(
                f"ScoringOperands shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)} "
                f"(expected ({b}, S_k, {d})), weights {tuple(w.shape)} (expected {(b, sq, h)})."
            )
        if fp8:
            if w.dtype != torch.float32 or self.q_descale is None or self.k_descale is None:
                raise TypeError(
                    "fp8 operands need float32 weights (q descale folded in) and float32 "
                    "q_descale and k_descale."
                )
            for name, t, shape in (
                ("q_descale", self.q_descale, (b, sq, h)),
                ("k_descale", self.k_descale, (b, k.shape[1])),
            ):
                if t.dtype != torch.float32 or tuple(t.shape) != shape:
                    raise ValueError(
                        f"{name} must be float32 {shape}, got {t.dtype} {tuple(t.shape)}."
                    )
            if self.sm_scale != 1.0:
                raise ValueError("fp8 operands fold sm_scale into the weights; pass sm_scale=1.0.")
        else:
            if w.dtype not in _WEIGHT_DTYPES:
                raise TypeError(f"bf16 operands take bf16 or float32 weights, got {w.dtype}.")
            if self.q_descale is not None or self.k_descale is not None:
                raise ValueError("bf16 operands carry no descales.")
        _check_real("sm_scale", self.sm_scale)
        _check_scoring_backend(self.backend, self.precision)
        _check_same_device(q=q, k=k, weights=w, q_descale=self.q_descale, k_descale=self.k_descale)

    @property
    def precision(self) -> ScoringPrecision:
        """FP8 for E4M3 operands, BF16 otherwise."""
        fp8 = self.q.dtype == torch.float8_e4m3fn
        return ScoringPrecision.FP8 if fp8 else ScoringPrecision.BF16

    @property
    def device(self) -> torch.device:
        return self.q.device

    def rows(self, start: int, stop: int) -> ScoringOperands:
        """The operands of query rows ``[start, stop)`` (views; keys unchanged); all of them:
        these operands (checked when they were built; nothing to rebuild)."""
        if start == 0 and stop == self.q.shape[1]:
            return self
        qs = None if self.q_descale is None else self.q_descale[:, start:stop]
        return self.replace_trusted(
            q=self.q[:, start:stop], weights=self.weights[:, start:stop], q_descale=qs
        )

    def check_finite(self) -> None:
        """``ValueError`` naming the first non-finite query row, key or head weight (reads the
        data: one host synchronisation; what ``validate=True`` of the scoring entry points runs).
        """
        checks = [
            ("q", self.q.float().isfinite().all(-1).all(-1)),
            ("k", self.k.float().isfinite().all(-1)),
        ]
        if self.k_descale is not None:
            checks[1] = ("k", checks[1][1] & self.k_descale.isfinite())
        checks.append(("weights", self.weights.float().isfinite().all(-1)))
        for name, ok in checks:
            if not bool(ok.all()):
                where = tuple(int(i) for i in (~ok).nonzero()[0])
                raise ValueError(
                    f"{name} has a non-finite vector at (batch, row) {where}; its scores would be "
                    "NaN (or, for BF16 keys on cuDNN, silently finite). Fix the inputs upstream."
                )

    def replace_trusted(self, **fields: torch.Tensor | str | None) -> ScoringOperands:
        """These operands with some tensors replaced by tensors of the same kind (dtype, device,
        and shapes that keep the operands consistent: a row slice, a lane permutation) derived
        from these, without running the constructor's checks again (:meth:`trusted`)."""
        current = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return ScoringOperands.trusted(**{**current, **fields})

    @classmethod
    def trusted(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        weights: torch.Tensor,
        q_descale: torch.Tensor | None = None,
        k_descale: torch.Tensor | None = None,
        sm_scale: float = 1.0,
        backend: str = "auto",
    ) -> ScoringOperands:
        """Operands built from inputs the caller checked (the fused kernel's outputs, whose
        dtypes, shapes and device follow from those inputs), without the constructor's checks
        (host time per call; the tests compare such operands with the checked reference's)."""
        new = object.__new__(cls)
        for name, value in (
            ("q", q), ("k", k), ("weights", weights), ("q_descale", q_descale),
            ("k_descale", k_descale), ("sm_scale", sm_scale), ("backend", backend),
        ):  # fmt: skip
            object.__setattr__(new, name, value)
        return new
