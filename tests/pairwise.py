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


def spread_params(values, ways, ids=str, way_ids=str):
    """``pytest.param``s of every ``(value, way)`` (a case and the way it
    runs: a driver, a direction), in product order; in the default run every
    value the first way (the default one), and each other way once, with
    the values taken in turn; the rest marked slow. For two factors whose
    values do not interact in pairs beyond that (a layer and a time-loop
    driver): each value and each way runs, the whole product under
    ``-m slow``."""
    keep = {(i, 0) for i in range(len(values))}
    keep |= {((j - 1) % len(values), j) for j in range(1, len(ways))}
    params = []
    for i, value in enumerate(values):
        for j, way in enumerate(ways):
            marks = () if (i, j) in keep else (pytest.mark.slow,)
            params.append(pytest.param(value, way, id=f"{ids(value)}-{way_ids(way)}", marks=marks))
    return params
