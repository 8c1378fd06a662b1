"""Next-token fidelity of a quantized model against its float reference: mean KL divergence of
the next-token distributions and top-1 agreement, at selected token positions.

Why not perplexity: for the composed vision-language model the question is how much the quantized
graph changes what the model predicts after seeing the image, and KL/top-1 against the float model
answer it per position without needing labels the synthetic composition does not have.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z -= z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@dataclass
class Fidelity:
    """Running sums over positions (add batches with ``update``)."""

    kl_sum: float = 0.0
    agree: int = 0
    positions: int = 0

    def update(self, ref_logits: np.ndarray, test_logits: np.ndarray, positions: np.ndarray) -> None:
        """``*_logits`` [B, S, V]; ``positions`` [B, S] bool: where to compare."""
        positions = np.asarray(positions, bool)
        ref, test = ref_logits[positions], test_logits[positions]  # [n, V]
        if not ref.shape[0]:
            return
        lp, lq = _log_softmax(ref), _log_softmax(test)
        self.kl_sum += float((np.exp(lp) * (lp - lq)).sum())
        self.agree += int((ref.argmax(-1) == test.argmax(-1)).sum())
        self.positions += int(ref.shape[0])

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / max(self.positions, 1)

    @property
    def top1(self) -> float:
        return self.agree / max(self.positions, 1)

    def as_dict(self) -> dict:
        return {"mean_kl": self.mean_kl, "top1_agreement": self.top1, "positions": self.positions}
