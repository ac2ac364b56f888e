"""When two texts may hold one value (shared.text.may_restate): the guard a near vector needs
before a forget takes a row down with the value, or extraction refuses a fact as forgotten; and
when one may say again what the other says in other words (may_repeat: a pattern the
consolidation pass draws anew)."""

from __future__ import annotations

import pytest

from shared.text import may_repeat, may_restate


@pytest.mark.parametrize(("one", "other"), [
    ("I like hiking.", "I really like hiking."),
    ("I like hiking.", "i like hiking!"),
    ("I like hiking.", "I like hiking a lot."),
    ("Remember that I prefer tea over coffee.", "I prefer tea over coffee."),
    ("My wifi password is hunter2", "User's wifi password is hunter2."),
    # The rest of a longer note does not count, numbers in it included.
    ("My wifi password is hunter2", "Note: my wifi password is hunter2, the router is in room 2."),
])
def test_the_same_value_in_more_words(one: str, other: str) -> None:
    assert may_restate(one, other) and may_restate(other, one)


@pytest.mark.parametrize(("one", "other"), [
    ("The meeting with Sam is at 3pm on Tuesday.", "The meeting with Sam is at 4pm on Tuesday."),
    ("Alice's phone number is 555-0101.", "Alice's phone number is 555-0199."),
    ("The wifi password is hunter2.", "The wifi password is hunter3."),
    ("The spare key is under the blue flowerpot.", "The spare key is under the red flowerpot."),
    ("I prefer tea over coffee.", "I prefer coffee over tea."),
    ("I am allergic to peanuts.", "I am not allergic to peanuts."),
    ("I like hiking.", "I don't like hiking."),
    ("bulk note 1001", "bulk note 1002"),
    ("It is what it is.", "It is."),  # nothing but common words: only the same text holds it
])
def test_another_value_however_near(one: str, other: str) -> None:
    assert not may_restate(one, other) and not may_restate(other, one)


@pytest.mark.parametrize(("one", "other"), [
    ("The user prefers to work late at night.", "The user tends to work late into the night."),
    ("User reviews pull requests every morning.", "Every morning the user reviews pull requests."),
    ("The user runs 3 times a week.", "Every week the user goes for a run 3 times."),
    ("The user doesn't drink coffee.", "The user never drinks coffee."),
    ("The user runs three times a week.", "The user runs 3 times every week."),
    ("The user calls home twice a month.", "Twice a month, the user calls home: 2 calls."),
])
def test_other_words_may_say_the_same(one: str, other: str) -> None:
    assert may_repeat(one, other) and may_repeat(other, one)


@pytest.mark.parametrize(("one", "other"), [
    ("The user runs 3 times a week.", "The user runs 5 times a week."),
    ("The user runs three times a week.", "The user runs five times a week."),
    ("The user runs twice a week.", "The user runs a few times a week."),
    ("The user is vegetarian.", "The user is not vegetarian."),
    ("The user meets Sam at 3pm.", "The user meets Sam at 4pm."),
])
def test_another_number_or_a_negation_says_something_else(one: str, other: str) -> None:
    assert not may_repeat(one, other) and not may_repeat(other, one)
