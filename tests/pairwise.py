"""A small deterministic pairwise (2-way) covering array generator, for the combination matrix (test_matrix.py).

Greedy, in the spirit of AETG/IPOG: while some pair of (factor, value) choices is not yet in any row, start a row
from the first such pair and fill the other factors one by one with the value that covers the most new pairs
(ties: the cheaper value, then the first listed). `allowed(row)` says whether a partial row can exist; a value is
taken only if the row can still be completed, so every row is valid and a pair that no valid row can hold is
reported instead of covered. Own code, not a library: no well-kept PyPI package for this is installed here, and
this is ~50 lines whose only promise (every possible pair covered, every row valid) the unit test checks.
"""

from __future__ import annotations

from itertools import combinations


def _completable(row: dict, names: list, factors: dict, allowed) -> bool:
    """Some assignment of the factors missing from `row` makes a full allowed row (depth-first, first fit)."""
    if not allowed(row):
        return False
    rest = [n for n in names if n not in row]
    if not rest:
        return True
    return any(_completable({**row, rest[0]: v}, names, factors, allowed) for v in factors[rest[0]])


def possible_pairs(factors: dict, allowed=lambda row: True) -> tuple[set, set]:
    """(pairs some valid row can hold, pairs none can), each pair ((factor, value), (factor, value))."""
    names, ok, impossible = list(factors), set(), set()
    for a, b in combinations(names, 2):
        for va in factors[a]:
            for vb in factors[b]:
                pair = ((a, va), (b, vb))
                (ok if _completable({a: va, b: vb}, names, factors, allowed) else impossible).add(pair)
    return ok, impossible


def row_pairs(row: dict, names: list) -> set:
    return {((a, row[a]), (b, row[b])) for a, b in combinations(names, 2)}


def pairwise(factors: dict, allowed=lambda row: True, cost=lambda name, value: 0, seeds=()) -> list[dict]:
    """Rows (dicts factor -> value) that together hold every possible pair of values of two factors. `seeds`:
    partial rows that come first, each completed like any other row (the way to place an expensive value in a few
    rows of one's choosing: the greedy fill covers its pairs there, so no later row needs it)."""
    names = list(factors)
    order = {((a, va), (b, vb)): (names.index(a), factors[a].index(va), names.index(b), factors[b].index(vb))
             for a, b in combinations(names, 2) for va in factors[a] for vb in factors[b]}  # fmt: skip
    uncovered, _ = possible_pairs(factors, allowed)
    rows, seeds = [], list(seeds)
    while uncovered:
        if seeds:
            row = dict(seeds.pop(0))
            assert _completable(row, names, factors, allowed), f"seed {row} cannot be completed"
        else:
            (a, va), (b, vb) = min(uncovered, key=order.__getitem__)
            row = {a: va, b: vb}
        for name in names:
            if name in row:
                continue

            def gain(v, name=name, row=row):
                new = sum(((n, row[n]), (name, v)) in uncovered or ((name, v), (n, row[n])) in uncovered for n in row)
                return (-new, cost(name, v), factors[name].index(v))

            candidates = [v for v in factors[name] if _completable({**row, name: v}, names, factors, allowed)]
            row[name] = min(candidates, key=gain)
        row = {n: row[n] for n in names}
        uncovered -= row_pairs(row, names)
        rows.append(row)
    return rows
