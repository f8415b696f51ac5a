"""The pairwise generator of the combination matrix: every pair some valid row can hold is in a row, every row is
valid, the same factors give the same rows, and pairs no valid row can hold are named."""

from itertools import combinations

from pairwise import pairwise, possible_pairs, row_pairs
from test_matrix import COMPILE_ROWS, FACTORS, ROWS, allowed, cost


def check(factors, allowed=lambda row: True, cost=lambda n, v: 0, seeds=()):
    rows = pairwise(factors, allowed, cost, seeds)
    names = list(factors)
    assert all(set(r) == set(names) and all(r[n] in factors[n] for n in names) for r in rows)
    assert all(allowed(r) for r in rows)
    possible, impossible = possible_pairs(factors, allowed)
    covered = set().union(*(row_pairs(r, names) for r in rows))
    assert possible <= covered and not covered & impossible
    assert rows == pairwise(factors, allowed, cost, seeds)  # deterministic
    assert all(rows[i].items() >= seed.items() for i, seed in enumerate(seeds))  # each seed is a row, completed
    return rows, possible, impossible


def test_unconstrained_factors_are_covered_in_few_rows():
    factors = {"a": [0, 1, 2], "b": [0, 1, 2], "c": [0, 1], "d": [0, 1], "e": [0, 1, 2, 3]}
    rows, possible, impossible = check(factors)
    assert not impossible and len(possible) == sum(
        len(factors[a]) * len(factors[b]) for a, b in combinations(factors, 2)
    )
    assert 12 <= len(rows) <= 16  # at least 4 x 3 (the two largest factors); far fewer than the 216 of all rows


def test_constraints_are_kept_and_impossible_pairs_named():
    factors = {"x": ["p", "q"], "y": [0, 1], "z": [0, 1]}

    def no_q_with_y1(row):
        return not (row.get("x") == "q" and row.get("y") == 1)

    rows, possible, impossible = check(factors, no_q_with_y1)
    assert impossible == {(("x", "q"), ("y", 1))}


def test_the_matrix_of_test_matrix_covers_every_possible_pair():
    rows, possible, impossible = check(FACTORS, allowed, cost, COMPILE_ROWS)
    assert rows == ROWS and len(rows) < 30 and len(possible) > 500
    # torch.compile's pairs are all held by its seeded rows: no other row compiles
    assert [r for r in rows if r["compile"]] == rows[: len(COMPILE_ROWS)]
