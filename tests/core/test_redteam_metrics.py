import dataclasses
import itertools
import math

import pytest
import torch
from sacrebleu.metrics import BLEU

from redteam_grpo.core.metrics.redteam import (
    RedTeamMetrics,
    embedding_diversity,
    quality_at,
    redteam_metrics,
    self_bleu_diversity,
    sentence_bleu_per_order,
)

# Two texts with no word in common, used to build sets whose diversity is known by hand.
A = "the cat sat on the mat"
B = "dogs bark at every passing car"


def unit(i: int, dim: int = 4) -> list[float]:
    return [1.0 if j == i else 0.0 for j in range(dim)]


# -- quality@τ -----------------------------------------------------------------------------------------------------


def test_quality_counts_missing_scores_as_failures_in_the_denominator():
    scores = [0.95, 0.5, 0.7, None, float("nan"), 0.2]
    # >= 0.5: 0.95, 0.5, 0.7 | >= 0.6 and >= 0.7: 0.95, 0.7 | >= 0.8 and >= 0.9: 0.95 — always out of 6
    assert quality_at(scores) == pytest.approx({0.5: 3 / 6, 0.6: 2 / 6, 0.7: 2 / 6, 0.8: 1 / 6, 0.9: 1 / 6})


def test_quality_threshold_is_inclusive():
    assert quality_at([0.5, 0.4999999], thresholds=(0.5,)) == {0.5: 0.5}
    assert quality_at([0.7], thresholds=(0.7,)) == {0.7: 1.0}


def test_quality_of_no_test_cases_is_nan_not_an_error():
    result = quality_at([], thresholds=(0.5, 0.9))
    assert list(result) == [0.5, 0.9]
    assert all(math.isnan(v) for v in result.values())


# -- sentence BLEU -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hypothesis", "references"),
    [
        ("a b c d e f", ["a b c d x f", "q b c d e r"]),
        ("hello, world! how are you?", ["hello world how are you", "are you there?"]),
        ("one", ["one two", "three"]),  # shorter than every order: effective order 1
        ("a b c", ["a b c d e f g h", "b c"]),  # brevity penalty, effective order 3
        ("x y z w", ["p q r s"]),  # nothing matches
    ],
)
def test_sentence_bleu_per_order_equals_sacrebleu_at_each_order(hypothesis, references):
    by_order = sentence_bleu_per_order(hypothesis, references, ngram_orders=(1, 2, 3, 4, 5))
    for n, value in by_order.items():
        expected = BLEU(max_ngram_order=n, effective_order=True).sentence_score(hypothesis, references).score / 100
        assert value == pytest.approx(min(expected, 1.0), abs=1e-12), n


def test_a_perfect_match_scores_exactly_1():
    assert sentence_bleu_per_order(A, [A]) == {2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0}


# -- SelfBLEU diversity --------------------------------------------------------------------------------------------


def test_identical_texts_have_no_selfbleu_diversity():
    assert self_bleu_diversity([A] * 5) == 0.0


def test_texts_without_a_shared_word_have_full_selfbleu_diversity():
    texts = ["the cat sat on the mat", "dogs bark at every passing car", "rain falls slowly tonight"]
    assert self_bleu_diversity(texts) == 1.0


def test_selfbleu_diversity_by_hand_for_one_and_two_orders():
    texts = ["a b c d", "a b c e"]  # each against the other: 3/4 unigrams, 2/3 bigrams, 1/2 trigrams match
    bleu2 = math.sqrt(3 / 4 * 2 / 3)
    bleu3 = (3 / 4 * 2 / 3 * 1 / 2) ** (1 / 3)
    assert self_bleu_diversity(texts, ngram_orders=(2,)) == pytest.approx(1 - bleu2)
    assert self_bleu_diversity(texts, ngram_orders=(2, 3)) == pytest.approx(1 - (bleu2 + bleu3) / 2)


def test_selfbleu_compares_each_text_with_all_the_others():
    # A against {A, B}: 1; A against {A, B}: 1; B against {A, A}: 0 → SelfBLEU 2/3
    assert self_bleu_diversity([A, A, B]) == pytest.approx(1 / 3)


def test_more_shared_ngrams_mean_less_selfbleu_diversity():
    def texts_sharing(k: int) -> list[str]:
        shared = [f"s{j}" for j in range(k)]
        return [" ".join(shared + [f"t{i}x{j}" for j in range(8 - k)]) for i in range(4)]

    diversities = [self_bleu_diversity(texts_sharing(k)) for k in (0, 2, 4, 6, 8)]
    assert diversities[0] == 1.0
    assert diversities[-1] == 0.0
    assert all(a > b for a, b in itertools.pairwise(diversities)), diversities


@pytest.mark.parametrize("texts", [[], [A]])
def test_selfbleu_diversity_needs_two_texts(texts):
    assert math.isnan(self_bleu_diversity(texts))


# -- subsets -------------------------------------------------------------------------------------------------------


def test_fewer_texts_than_a_subset_are_used_whole_once():
    expected = 1 / 3  # as in test_selfbleu_compares_each_text_with_all_the_others
    for seed in (0, 1, 2):
        for n_subsets in (1, 7):
            assert self_bleu_diversity([A, A, B], n_subsets=n_subsets, seed=seed) == pytest.approx(expected)
    embeddings = torch.tensor([unit(0), unit(0), unit(1)])
    assert embedding_diversity(embeddings, seed=1, n_subsets=3) == pytest.approx(2 / 3)


def test_subsets_are_drawn_uniformly_and_averaged():
    # Subsets of 2 out of {A, A, B}: {A, A} (diversity 0) with probability 1/3, {A, B} (diversity 1) otherwise.
    diversity = self_bleu_diversity([A, A, B], subset_size=2, n_subsets=1000)
    assert diversity == pytest.approx(2 / 3, abs=0.06)
    assert 0 < diversity < 1  # both kinds of subset were drawn


def test_subset_averaging_is_deterministic_for_a_seed():
    texts = [A, A, B]
    assert self_bleu_diversity(texts, subset_size=2, n_subsets=50, seed=3) == self_bleu_diversity(
        texts, subset_size=2, n_subsets=50, seed=3
    )
    assert self_bleu_diversity(texts, subset_size=2, n_subsets=50, seed=3) != self_bleu_diversity(
        texts, subset_size=2, n_subsets=50, seed=4
    )


def test_both_diversities_average_over_the_same_subsets():
    # A, A, B behave exactly like unit(0), unit(0), unit(1): diversity 0 for the pair of equals, 1 otherwise.
    embeddings = torch.tensor([unit(0), unit(0), unit(1)])
    for seed in range(5):
        by_text = self_bleu_diversity([A, A, B], subset_size=2, n_subsets=40, seed=seed)
        by_embedding = embedding_diversity(embeddings, subset_size=2, n_subsets=40, seed=seed)
        assert by_text == pytest.approx(by_embedding, abs=1e-12)


def test_a_subset_needs_two_items():
    with pytest.raises(ValueError, match="subset_size"):
        self_bleu_diversity([A, B, A], subset_size=1)
    with pytest.raises(ValueError, match="n_subsets"):
        embedding_diversity(torch.eye(3), subset_size=2, n_subsets=0)


# -- embedding diversity -------------------------------------------------------------------------------------------


def test_identical_embeddings_have_no_diversity():
    assert embedding_diversity(torch.tensor([[0.3, -1.2, 2.0]] * 4)) == pytest.approx(0.0, abs=1e-12)


def test_orthogonal_unit_embeddings_have_diversity_1():
    assert embedding_diversity(torch.eye(4)) == pytest.approx(1.0)


def test_opposite_embeddings_have_diversity_2():
    e = torch.tensor([0.6, 0.8])
    assert embedding_diversity(torch.stack([e, -e])) == pytest.approx(2.0)


def test_embedding_diversity_leaves_out_the_diagonal():
    # off-diagonal cosines of e1, e1, e2: 1, 1 and four 0s → mean 1/3 (with the diagonal it would be 5/9)
    assert embedding_diversity(torch.tensor([unit(0), unit(0), unit(1)])) == pytest.approx(2 / 3)


def test_embedding_diversity_normalises_rows():
    # cos([1, 0], [1, 1]) = 1/√2; the raw dot product would be 1
    assert embedding_diversity(torch.tensor([[1.0, 0.0], [1.0, 1.0]])) == pytest.approx(1 - 1 / math.sqrt(2))


def test_embedding_diversity_is_scale_invariant():
    embeddings = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    scales = torch.tensor([0.01, 1.0, 3.0, 50.0, 0.5, 7.0])[:, None]
    assert embedding_diversity(embeddings * scales) == pytest.approx(embedding_diversity(embeddings), abs=1e-9)


def test_embedding_diversity_refuses_rows_without_a_direction():
    with pytest.raises(ValueError, match="zero or non-finite"):
        embedding_diversity(torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="zero or non-finite"):
        embedding_diversity(torch.tensor([[1.0, 0.0], [float("nan"), 1.0]]))
    with pytest.raises(ValueError, match=r"\[N, D\]"):
        embedding_diversity(torch.ones(3))


@pytest.mark.parametrize("n_rows", [0, 1])
def test_embedding_diversity_needs_two_rows(n_rows):
    assert math.isnan(embedding_diversity(torch.ones(n_rows, 3)))


# -- all metrics per threshold -------------------------------------------------------------------------------------


def test_diversity_is_of_the_successful_test_cases_only():
    c = "rain falls slowly tonight"
    texts = [A, A, B, c]
    scores = [0.9, 0.95, 0.3, None]  # c has no score: never successful
    embeddings = torch.tensor([unit(0), unit(0), unit(1), unit(2)])
    metrics = redteam_metrics(texts, scores, embeddings, thresholds=(0.0, 0.5, 0.99))

    assert metrics.n_test_cases == 4
    assert metrics.n_successful == {0.0: 3, 0.5: 2, 0.99: 0}
    assert metrics.quality == pytest.approx({0.0: 3 / 4, 0.5: 2 / 4, 0.99: 0.0})
    # τ = 0: A, A, B (not c, whose score is missing); τ = 0.5: the two copies of A
    assert metrics.selfbleu_diversity[0.0] == pytest.approx(1 / 3)
    assert metrics.selfbleu_diversity[0.5] == 0.0
    assert metrics.embedding_diversity[0.0] == pytest.approx(2 / 3)
    assert metrics.embedding_diversity[0.5] == pytest.approx(0.0, abs=1e-12)
    # nothing passes τ = 0.99
    assert math.isnan(metrics.selfbleu_diversity[0.99])
    assert math.isnan(metrics.embedding_diversity[0.99])


def test_embeddings_follow_their_test_cases():
    # The successful cases are the last two; their embeddings are orthogonal while the first two are equal.
    metrics = redteam_metrics(
        ["w x", "w x", "y z", "u v"],
        [0.1, 0.1, 0.8, 0.9],
        torch.tensor([unit(0), unit(0), unit(1), unit(2)]),
        thresholds=(0.5,),
    )
    assert metrics.embedding_diversity[0.5] == pytest.approx(1.0)
    assert metrics.selfbleu_diversity[0.5] == 1.0


def test_a_single_successful_case_has_no_diversity():
    metrics = redteam_metrics([A, B], [0.9, 0.1], torch.eye(2), thresholds=(0.5,))
    assert metrics.quality == {0.5: 0.5}
    assert math.isnan(metrics.selfbleu_diversity[0.5])
    assert math.isnan(metrics.embedding_diversity[0.5])


def test_without_embeddings_the_embedding_diversity_is_nan():
    metrics = redteam_metrics([A, B], [0.9, 0.9], thresholds=(0.5, 0.9))
    assert metrics.selfbleu_diversity == {0.5: 1.0, 0.9: 1.0}
    assert all(math.isnan(v) for v in metrics.embedding_diversity.values())


def test_no_test_cases_give_nan_everywhere():
    metrics = redteam_metrics([], [], torch.zeros(0, 3), thresholds=(0.5,))
    (row,) = metrics.as_rows()
    assert row["n_successful"] == 0
    assert all(math.isnan(row[key]) for key in ("quality", "selfbleu_diversity", "embedding_diversity"))


def test_rows_are_one_flat_record_per_threshold_in_order():
    metrics = redteam_metrics([A, A, B], [0.9, 0.95, 0.6], thresholds=(0.9, 0.5))
    rows = list(metrics.as_rows())
    assert [row["tau"] for row in rows] == [0.9, 0.5]
    assert set(rows[0]) == {"tau", "n_successful", "quality", "selfbleu_diversity", "embedding_diversity"}
    assert rows[0]["quality"] == pytest.approx(2 / 3)
    assert rows[0]["selfbleu_diversity"] == 0.0
    assert rows[1]["quality"] == 1.0
    assert rows[1]["selfbleu_diversity"] == pytest.approx(1 / 3)


def test_metrics_are_frozen():
    metrics = redteam_metrics([A, B], [0.9, 0.9], thresholds=(0.5,))
    assert isinstance(metrics, RedTeamMetrics)
    with pytest.raises(dataclasses.FrozenInstanceError):
        metrics.quality = {}  # type: ignore[misc]


def test_mismatched_inputs_are_refused():
    with pytest.raises(ValueError, match="2 texts but 1 scores"):
        redteam_metrics([A, B], [0.9])
    with pytest.raises(ValueError, match="2 texts but 3 embeddings"):
        redteam_metrics([A, B], [0.9, 0.9], torch.eye(3))
