"""Which parametrized cases run in the default suite (``make test``, CI) and which only with
the slow cases (``make test-all``).

CI has two cores and a time bound, so a family of cases that checks one thing over many
shapes, tunings or targets keeps a rotating share of them in the default suite: every
feature still runs there, and the whole matrix runs with the slow cases.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import pytest

SLOW = [pytest.mark.slow]


def every_nth(cases: Iterable[Any], n: int) -> list:
    """``cases`` as ``pytest.param``s: the first and every ``n``-th after it run in the
    default suite, the others are marked slow. A case that is a tuple holds the arguments
    of several parameter names; any other value is one argument (pytest derives the ids
    from the values, as it would for the plain list)."""
    return [pytest.param(*_values(case), marks=[] if i % n == 0 else SLOW)
            for i, case in enumerate(cases)]


def crossed(first: Sequence[Any], second: Sequence[Any], *,
            first_ids: Sequence[str] | None = None,
            second_ids: Sequence[str] | None = None) -> list:
    """Every pair of ``first`` x ``second`` as one ``pytest.param`` (a tuple in either
    gives several arguments, as in ``every_nth``), in the order and with the ids two
    stacked ``parametrize`` decorators give (``a-b``; ``first_ids`` and ``second_ids`` name
    the values where pytest cannot). In the default suite each ``a`` runs with one ``b``,
    rotating over ``second``; the other pairs are marked slow."""
    params = []
    for i, a in enumerate(first):
        for j, b in enumerate(second):
            case_id = None
            if first_ids is not None or second_ids is not None:
                case_id = (f"{a if first_ids is None else first_ids[i]}-"
                           f"{b if second_ids is None else second_ids[j]}")
            params.append(pytest.param(*_values(a), *_values(b), id=case_id,
                                       marks=[] if j == i % len(second) else SLOW))
    return params


def _values(case: Any) -> tuple:
    return case if isinstance(case, tuple) else (case,)
