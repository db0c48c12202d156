"""The wording helper the commands print counts with."""

import pytest

from search.text import count


@pytest.mark.parametrize("n, expected", [(0, "0 trials"), (1, "1 trial"), (2, "2 trials"), (100, "100 trials")])
def test_count(n, expected):
    assert count(n, "trial") == expected


def test_count_of_a_phrase():
    assert count(1, "COMPLETE trial") == "1 COMPLETE trial" and count(3, "knob") == "3 knobs"
