"""Parameters that cover every pair of values: a cross product's cases with
a small set of them in the default run and the rest under ``-m slow``.

Where a test's factors interact in pairs (a cell and a direction, a
direction and a layer count, a dtype and any of them), every pair of values
meets in the default run; the whole product, which repeats those pairs,
runs under ``-m slow``."""

import itertools

import pytest


def covering(factors):
    """Indices of combinations of ``factors`` (lists of values) in which every
    pair of values of any two factors meets at least once: greedily, each
    next combination the one meeting the most pairs not met yet (the first
    such in product order, so the choice is the same in every run)."""
    sizes = [len(values) for values in factors]
    pairs = list(itertools.combinations(range(len(factors)), 2))
    unmet = {(i, a, j, b) for i, j in pairs for a in range(sizes[i]) for b in range(sizes[j])}
    chosen = []
    combos = list(itertools.product(*(range(size) for size in sizes)))
    while unmet:
        best = max(combos, key=lambda c: sum((i, c[i], j, c[j]) in unmet for i, j in pairs))
        chosen.append(best)
        unmet -= {(i, best[i], j, best[j]) for i, j in pairs}
    return chosen


def pairwise_params(factors, ids):
    """``pytest.param``s of the whole product of ``factors`` (lists of values),
    in product order, each with the id ``"-".join(ids[k](value))``; the ones
    outside ``covering(factors)`` marked slow."""
    keep = set(covering(factors))
    params = []
    for combo in itertools.product(*(range(len(values)) for values in factors)):
        values = [factors[k][i] for k, i in enumerate(combo)]
        name = "-".join(str(ids[k](value)) for k, value in enumerate(values))
        marks = () if combo in keep else (pytest.mark.slow,)
        params.append(pytest.param(*values, id=name, marks=marks))
    return params
