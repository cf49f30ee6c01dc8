"""Prompt-lookup proposals (``jaxpage.core.sched.ngram_proposer``): exact tokens on hand-made
sequences, and agreement with a plain Python search on random ones."""

import numpy as np
import pytest

from jaxpage.core.sched.ngram_proposer import propose_ngram


def test_the_tokens_after_the_first_occurrence_of_the_suffix():
    assert propose_ngram([1, 2, 3, 4, 2, 3], k=4, min_n=2, max_n=2).tolist() == [4, 2, 3]
    assert propose_ngram([1, 2, 3, 4, 2, 3], k=1, min_n=2, max_n=2).tolist() == [4]
    # the first occurrence, not the latest
    assert propose_ngram([7, 8, 1, 7, 8, 2, 7, 8], k=2, min_n=2, max_n=2).tolist() == [1, 7]


def test_the_longest_recurring_suffix_wins():
    # suffix [5, 6, 7] recurs at 4..6 (followed by 9); [6, 7] alone recurs first at 0..1
    seq = [6, 7, 1, 0, 5, 6, 7, 9, 3, 5, 6, 7]
    assert propose_ngram(seq, k=2, min_n=2, max_n=3).tolist() == [9, 3]
    assert propose_ngram(seq, k=2, min_n=2, max_n=2).tolist() == [1, 0]


def test_no_occurrence_or_too_short_proposes_nothing():
    assert propose_ngram([1, 2, 3, 4], k=3, min_n=1, max_n=3).size == 0
    assert propose_ngram([5], k=3, min_n=1, max_n=3).size == 0
    assert propose_ngram([], k=3, min_n=1, max_n=3).size == 0
    assert propose_ngram([1, 2, 1, 2], k=3, min_n=3, max_n=4).size == 0  # only n=2 recurs
    assert propose_ngram([4, 4], k=3, min_n=1, max_n=2).tolist() == [4]


@pytest.mark.parametrize("k, min_n, max_n", [(0, 1, 2), (3, 0, 2), (3, 3, 2)])
def test_bad_settings_are_refused(k, min_n, max_n):
    with pytest.raises(ValueError, match="min_n"):
        propose_ngram([1, 2, 1], k=k, min_n=min_n, max_n=max_n)


def _by_hand(seq, k, min_n, max_n):
    for n in range(max_n, min_n - 1, -1):
        if n >= len(seq):
            continue
        suffix = seq[-n:]
        for start in range(len(seq) - n):
            if seq[start:start + n] == suffix:
                return seq[start + n:start + n + k]
    return []


def test_agrees_with_a_plain_search_on_random_sequences():
    rng = np.random.default_rng(0)
    for _ in range(300):
        seq = rng.integers(0, 4, rng.integers(0, 40)).tolist()
        k, min_n = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 3))
        got = propose_ngram(seq, k, min_n, max_n)
        assert got.dtype == np.int32
        assert got.tolist() == _by_hand(seq, k, min_n, max_n), (seq, k, min_n, max_n)
