"""The full ranking's stages: query dates, entities, score fusion, boosts, demotion and MMR."""

from __future__ import annotations

import tracemalloc
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.search import ranking
from services.search.config import SearchConfig
from services.search.dates import (
    DATE_KINDS,
    LENGTH,
    asks_when,
    parse_dates,
    says_when,
    text_words,
)
from services.search.entities import MOST_QUERY_NAMES, mentions, query_entities, subject_of
from services.search.model import (
    Candidate,
    RankingSettings,
    Scope,
    SearchContext,
    SearchQuery,
)
from services.search.pipeline import LITE_PIPELINE, PLAIN_PIPELINE
from services.store.keys import clauses, context_text, own_keys, passage_of
from shared.calibration import calibrated_floor
from shared.errors import ConfigError
from shared.pb import common_pb2

# Wednesday 2024-05-15 14:30 UTC.
REF = datetime(2024, 5, 15, 14, 30, tzinfo=UTC).timestamp()
DAY = 86400.0


def spans(query: str) -> list[tuple[str, str]]:
    """Each range as (first day, last day), ISO dates."""
    out = []
    for found in parse_dates(query, REF):
        first = datetime.fromtimestamp(found.start, UTC).date().isoformat()
        last = datetime.fromtimestamp(found.end - 1, UTC).date().isoformat()
        out.append((first, last))
    return out


# Dates


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("what did I do yesterday", [("2024-05-14", "2024-05-14")]),
        ("plans for today?", [("2024-05-15", "2024-05-15")]),
        ("what is due tomorrow", [("2024-05-16", "2024-05-16")]),
        ("what did we decide last week", [("2024-05-06", "2024-05-12")]),
        ("anything this week", [("2024-05-13", "2024-05-19")]),
        ("where did we go last month", [("2024-04-01", "2024-04-30")]),
        ("trips last year", [("2023-01-01", "2023-12-31")]),
        ("what happened in May 2023", [("2023-05-01", "2023-05-31")]),
        ("what happened in March", [("2024-03-01", "2024-03-31")]),
        ("what happened in June", [("2023-06-01", "2023-06-30")]),
        ("what did we do in may at the lake", [("2024-05-01", "2024-05-31")]),
        ("what did we plan for this May.", [("2024-05-01", "2024-05-31")]),
        ("since May, what changed", [("2024-05-01", "2024-05-31")]),
        ("the talk on 8 May, 2023", [("2023-05-08", "2023-05-08")]),
        ("the talk on May 8th, 2023", [("2023-05-08", "2023-05-08")]),
        ("the release of 2023-05-08", [("2023-05-08", "2023-05-08")]),
        ("what did I buy 2 days ago", [("2024-05-12", "2024-05-14")]),
        ("the call three weeks ago", [("2024-04-21", "2024-04-27")]),
        ("what did we cook on Monday", [("2024-05-13", "2024-05-13")]),
        ("last Wednesday's meeting", [("2024-05-08", "2024-05-08")]),
        ("next Friday", [("2024-05-17", "2024-05-17")]),
        ("plans last weekend", [("2024-05-11", "2024-05-12")]),
        ("what did I read in 2022", [("2022-01-01", "2022-12-31")]),
    ],
)
def test_dates_in_a_query_are_read_against_the_reference_time(
    query: str, expected: list[tuple[str, str]]
) -> None:
    assert spans(query) == expected


def test_a_query_without_dates_names_no_range() -> None:
    assert parse_dates("what is my favourite tea", REF) == []
    # A month name that is also a word is only a date after "in", "last", "this"...
    assert parse_dates("may I ask about the march of progress", REF) == []


@pytest.mark.parametrize(
    "query", ["this may help", "I think this may be wrong", "since may I ask what we planned"]
)
def test_may_the_verb_is_not_read_as_the_month(query: str) -> None:
    assert parse_dates(query, REF) == []


@pytest.mark.parametrize(
    ("query", "reference_time", "kept"),
    [
        ("what did I do yesterday, and 99999999 days ago?", REF, "yesterday"),
        ("tomorrow, or 9999999999 years ago", REF, "tomorrow"),
        ("on 2023-02-30 or tomorrow", REF, "tomorrow"),
        ("next year and tomorrow", datetime(9999, 6, 1, tzinfo=UTC).timestamp(), "tomorrow"),
    ],
)
def test_a_date_off_the_calendar_is_skipped_and_the_querys_other_dates_kept(
    query: str, reference_time: float, kept: str
) -> None:
    assert [r.text for r in parse_dates(query, reference_time)] == [kept]


# 20:00 on Wednesday 2024-05-15 at UTC-8, when it is already Thursday in UTC.
EVENING_AT_UTC_MINUS_8 = datetime(2024, 5, 16, 4, tzinfo=UTC).timestamp()


def test_yesterday_runs_from_midnight_to_midnight_by_the_askers_clock() -> None:
    (found,) = parse_dates("what did I do yesterday", EVENING_AT_UTC_MINUS_8, -8 * 60)
    local = timezone(timedelta(hours=-8))
    assert found.start == datetime(2024, 5, 14, tzinfo=local).timestamp()
    assert found.end == datetime(2024, 5, 15, tzinfo=local).timestamp()
    # Without an offset the days are UTC's.
    (in_utc,) = parse_dates("what did I do yesterday", EVENING_AT_UTC_MINUS_8)
    assert in_utc.start == datetime(2024, 5, 15, tzinfo=UTC).timestamp()


@pytest.mark.parametrize(
    "query",
    [
        "today",
        "tomorrow",
        "last week",
        "this weekend",
        "on Monday",
        "next Friday",
        "3 days ago",
        "in May",
        "last month",
        "next year",
        "the talk on 8 May, 2023",
        "recently",
    ],
)
@pytest.mark.parametrize("offset_minutes", [-12 * 60, -8 * 60, 5 * 60 + 30, 14 * 60])
def test_every_date_is_read_in_the_askers_days(query: str, offset_minutes: int) -> None:
    # The asker's dates are those UTC reads at the same wall-clock time, each day starting
    # as much earlier as their clock is ahead.
    shift = offset_minutes * 60
    theirs = parse_dates(query, EVENING_AT_UTC_MINUS_8, offset_minutes)
    by_their_wall_clock = parse_dates(query, EVENING_AT_UTC_MINUS_8 + shift)
    assert theirs
    assert [(r.start, r.end) for r in theirs] == [
        (r.start - shift, r.end - shift) for r in by_their_wall_clock
    ]


def test_date_parsing_is_deterministic_and_follows_the_reference_time() -> None:
    later = REF + 31 * DAY
    assert parse_dates("yesterday", REF) == parse_dates("yesterday", REF)
    assert (
        parse_dates("yesterday", later)[0].start
        == parse_dates("yesterday", REF)[0].start + 31 * DAY
    )


def test_a_full_date_is_not_read_twice_as_its_month() -> None:
    assert spans("in May 2023") == [("2023-05-01", "2023-05-31")]


# Entities


def test_capitalised_names_are_entities_but_question_words_are_not() -> None:
    assert query_entities("When did Priya move to Lake Tahoe?") == [
        "Lake Tahoe",
        "Priya",
        "Tahoe",
        "Lake",
    ]


def test_possessives_and_quoted_names_count() -> None:
    names = query_entities('What is Jordan\'s plan for "garden app"?')
    assert "Jordan" in names
    assert "garden app" in names


def test_a_long_capitalised_query_is_searched_by_its_longest_names_only() -> None:
    text = " and ".join(f"Name{n:05d}" for n in range(5000)) + " and Featherstonehaugh"
    names = query_entities(text)
    assert len(names) == MOST_QUERY_NAMES and names[0] == "Featherstonehaugh"


def test_known_entities_are_found_in_any_case() -> None:
    assert query_entities("how is the foxtrot project going", known=["Foxtrot"]) == ["Foxtrot"]


def test_a_query_in_lower_case_names_no_entity() -> None:
    assert query_entities("what did i eat for dinner") == []


def test_mentions_matches_whole_words_only() -> None:
    assert mentions("Priya: we went hiking", "priya")
    assert not mentions("Priyanka went hiking", "Priya")


# Fusion and boosts


def cand(memory_id: str, content: str = "", **fields: object) -> Candidate:
    return Candidate(memory_id=memory_id, layer="l2_raw", content=content or memory_id, **fields)  # type: ignore[arg-type]


def ctx(
    text: str = "what did Priya cook",
    *,
    vector: list[Candidate] | None = None,
    keyword: list[Candidate] | None = None,
    context: list[Candidate] | None = None,
    settings: RankingSettings | None = None,
    reader: str = "",
    reference_time: float | None = REF,
    utc_offset_minutes: int = 0,
    limit: int = 10,
) -> SearchContext:
    query = SearchQuery.build(
        scope=Scope("u1"),
        text=text,
        limit=limit,
        layers=(),
        min_score=None,
        default_min_score=None,
        reader=reader,
        reference_time=reference_time,
        reference_utc_offset_minutes=utc_offset_minutes,
    )
    return SearchContext(
        query=query,
        vector=vector or [],
        keyword=keyword or [],
        now=REF,
        intention_ttl_s=None,
        context=context or [],
        settings=settings or RankingSettings(),
        model_floor=0.3,
    )


def ids(ranked: list[Candidate]) -> list[str]:
    return [c.memory_id for c in ranked]


def test_questions_lean_on_meaning_and_keywords_on_own_words() -> None:
    assert ranking.is_question("When did we adopt the puppy?")
    assert not ranking.is_question("HYATLAS_SYNC_EXTRACT staging")
    vec, own, _ = ranking.fusion_weights("HYATLAS_SYNC_EXTRACT staging")
    assert own > vec


def test_fusion_sums_cosine_and_normalised_keyword_scores_and_floors_weak_cosines() -> None:
    ranked = ranking.fuse_scores(
        [],
        ctx(
            vector=[cand("a", cosine=0.5), cand("weak", cosine=0.2)],
            keyword=[cand("a", keyword_score=4.0, strict=True), cand("b", keyword_score=2.0)],
            context=[cand("b", context_score=6.0)],
        ),
    )
    scores = {c.memory_id: round(c.fused, 3) for c in ranked}
    # a: 1.0*0.5 + 0.5*4/4 + 0.2 strict; b: 0.5*2/4 + 1.0*6/6; weak is under the floor.
    assert scores == {"a": 1.2, "b": 1.25}
    assert ids(ranked) == ["b", "a"]


def test_keyword_reader_ranks_the_strict_tier_above_relaxed_hits() -> None:
    ranked = ranking.fuse_scores(
        [],
        ctx(
            reader="keyword",
            keyword=[cand("loose", keyword_score=9.0), cand("all", keyword_score=1.0, strict=True)],
        ),
    )
    assert ids(ranked) == ["all", "loose"]


def test_memory_dated_in_the_range_the_query_names_is_favoured() -> None:
    may = datetime(2024, 5, 14, 9, tzinfo=UTC).timestamp()
    april = datetime(2024, 4, 2, tzinfo=UTC).timestamp()
    ranked = [cand("april", event_at=april, fused=1.0), cand("may", event_at=may, fused=0.9)]
    assert ids(ranking.boost_dates(ranked, ctx("what did we cook yesterday"))) == ["may", "april"]


@pytest.mark.parametrize("offset_minutes", [-12 * 60, -8 * 60, 0, 5 * 60 + 30, 14 * 60])
def test_a_facts_date_is_that_date_in_the_askers_days(offset_minutes: int) -> None:
    # A fact's event date is kept alone, at its UTC midnight: asked about "yesterday" on 15 May
    # anywhere, a fact of 14 May is of that day, and one of 13 or 15 May is not.
    evening = datetime(2024, 5, 15, 20, tzinfo=timezone(timedelta(minutes=offset_minutes)))
    ranked = [
        cand(day, event_at=datetime(2024, 5, int(day), tzinfo=UTC).timestamp(), fused=1.0 - i / 10)
        for i, day in enumerate(["13", "15", "14"])
    ]
    boosted = ranking.boost_dates(ranked, ctx("what did we cook yesterday",
                                              reference_time=evening.timestamp(),
                                              utc_offset_minutes=offset_minutes))
    assert ids(boosted) == ["14", "13", "15"]


def test_memory_naming_the_querys_entity_is_favoured() -> None:
    ranked = [
        cand("other", "Sam: I cooked pasta", fused=1.0),
        cand("hers", "Priya: I made dal", fused=0.95),
    ]
    assert ids(ranking.boost_entities(ranked, ctx("what did Priya cook"))) == ["hers", "other"]


@pytest.mark.parametrize(
    ("query", "asks"),
    [
        ("When did we repaint the kitchen?", True),
        ("so when was the party", True),
        ("For how long has Ana had her bike?", True),
        ("How many years did Ben live in Leeds?", True),
        ("what year did we move?", True),
        ("Since when does the shop open on Sundays?", True),
        ("What did Ana say when we left?", False),
        ("Where did we go last week?", False),
        ("how many cats does Ben have", False),
    ],
)
def test_a_query_asks_when_if_it_asks_for_a_time_or_a_length_of_time(
    query: str, asks: bool
) -> None:
    assert asks_when(query) is asks


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("We finished repainting the kitchen yesterday.", True),
        ("Ana: I've had them for 3 years now!", True),
        ("a few weeks of rain", True),
        ("the talk on May 8th, 2023", True),
        ("back in 2019", True),
        ("we cook on Mondays", True),
        ("Ben: lately it has been quiet", True),
        ("The kitchen is blue and the walls are bare.", False),
        ("this may help", False),
        ("I have 3 cats", False),
    ],
)
def test_a_text_says_when_if_it_names_a_date_or_a_length_of_time(text: str, says: bool) -> None:
    assert says_when(text, REF) is says


DATE_WORDS = [
    "yesterday", "today", "tonight", "tomorrow", "recently", "lately", "these", "days", "day",
    "week", "weeks", "weekend", "month", "months", "year", "years", "fortnight", "ago", "last",
    "this", "next", "past", "previous", "in", "on", "of", "since", "during", "the", "before",
    "may", "May", "march", "June", "Sept", "Sept.", "monday", "Mondays", "wed", "Thursday",
    "2", "8th", "31", "2023", "1999", "2023-05-08", "\u0661\u0669\u0669\u0669", "three", "a",
    "few", "couple", "we", "painted", "it", ",", ".", "-", "_", "5", "\u00e9", "\u0301",
    # Whole dates, so that each kind is found often: Arabic-Indic digits are digits to re.
    "these days", "3 weeks ago", "last weekend", "on Friday", "May 8, 2023", "8 May 2023",
    "in 20\u0662\u0663", "\u0662\u0660\u0662\u0663-\u0660\u0665-\u0660\u0668",
]
# Words glued to their neighbours too ("5may", "2023-05", "may_", "\u00e9may").
DATE_TEXTS = st.lists(st.sampled_from(DATE_WORDS), max_size=8).flatmap(
    lambda words: st.lists(st.sampled_from([" ", ""]), min_size=len(words), max_size=len(words))
    .map(lambda gaps: "".join(w + g for w, g in zip(words, gaps, strict=True)))
)


@given(DATE_TEXTS)
@settings(max_examples=1000)
def test_every_date_or_length_of_time_found_holds_a_word_its_kind_needs(text: str) -> None:
    # parse_dates and says_when look for a kind only in a text holding one of its words.
    lowered = text.lower()
    for kind in (*DATE_KINDS, LENGTH):
        if kind.pattern.search(lowered):
            assert not kind.needs.isdisjoint(text_words(lowered)), (kind.pattern, text)


@given(DATE_TEXTS)
@settings(max_examples=400)
def test_every_text_a_date_is_read_in_says_when(text: str) -> None:
    assert says_when(text, REF) or not parse_dates(text, REF)


def test_a_query_asking_when_lifts_the_memories_that_say_when() -> None:
    ranked = [
        cand("talk", "Ana: the kitchen looks great in blue", fused=1.0),
        cand("when", "Ana: we repainted the kitchen last week", fused=0.6),
        cand("other", "Ben: the garden needs work", fused=0.5),
    ]
    out = ranking.favour_times(ranked, ctx("When did Ana repaint the kitchen?"))
    assert ids(out) == ["when", "talk", "other"]
    assert out[0].fused == pytest.approx(0.6 * (1 + ranking.TIME_BOOST))


def test_a_long_memory_is_read_for_a_time_in_its_opening_only() -> None:
    filler = "the kitchen walls were bare " * (ranking.TIME_READ_CHARS // 10)
    ranked = [
        cand("late", filler + "and we painted them yesterday", fused=1.0),
        cand("early", "yesterday we painted the walls " + filler, fused=0.9),
    ]
    out = ranking.favour_times(ranked, ctx("When did we paint the walls?"))
    assert [(c.memory_id, c.fused) for c in out] == [
        ("early", pytest.approx(0.9 * (1 + ranking.TIME_BOOST))),
        ("late", 1.0),
    ]


def test_a_query_not_asking_when_leaves_the_order_as_it_was() -> None:
    ranked = [
        cand("talk", "the kitchen is blue", fused=1.0),
        cand("when", "painted it today", fused=0.6),
    ]
    out = ranking.favour_times(ranked, ctx("What colour is the kitchen?"))
    assert [(c.memory_id, c.fused) for c in out] == [("talk", 1.0), ("when", 0.6)]


def test_the_subject_of_a_query_is_the_first_name_it_holds() -> None:
    assert subject_of("What does Ana think of Ben's plan?") == "Ana"
    assert subject_of("Did Ben like the trip Ana planned?") == "Ben"
    assert subject_of("where do I live?") is None
    assert subject_of("what did we cook yesterday") is None


def test_a_line_said_by_the_person_asked_about_rises_over_one_said_to_them() -> None:
    ranked = [
        cand("to", "Ben: Ana, how was your pottery class?", fused=1.0),
        cand("by", "Ana: The pottery class calms me down.", fused=0.9),
        cand("about", "Ben said Ana: that is how he greets her", fused=0.95),
    ]
    out = ranking.favour_the_speaker(ranked, ctx("What does Ana think of pottery?"))
    assert ids(out) == ["by", "to", "about"]
    assert out[0].fused == pytest.approx(0.9 * (1 + ranking.SPEAKER_BOOST))


def test_a_query_naming_no_one_leaves_transcript_lines_as_they_were() -> None:
    ranked = [cand("to", "Ben: how was pottery?", fused=1.0), cand("by", "Ana: calm", fused=0.9)]
    out = ranking.favour_the_speaker(ranked, ctx("what calms me down?"))
    assert [(c.memory_id, c.fused) for c in out] == [("to", 1.0), ("by", 0.9)]


def test_recency_wins_close_calls_only_and_can_be_switched_off() -> None:
    old = cand("old", fused=1.0, created_at=REF - 200 * DAY)
    new = cand("new", fused=0.995, created_at=REF)
    far = cand("far", fused=0.5, created_at=REF)
    assert ids(ranking.boost_recency([old, new, far], ctx())) == ["new", "old", "far"]
    old.fused, new.fused = 1.0, 0.995
    off = ctx(settings=RankingSettings(recency=False))
    assert ids(ranking.boost_recency([old, new], off)) == ["old", "new"]


def test_used_memories_rise_unless_usage_learning_is_off() -> None:
    first, used = cand("first", fused=1.0), cand("used", fused=0.95, hits=5)
    assert ids(ranking.boost_usage([first, used], ctx())) == ["used", "first"]
    first.fused, used.fused = 1.0, 0.95
    off = ctx(settings=RankingSettings(usage_learning=False))
    assert ids(ranking.boost_usage([first, used], off)) == ["first", "used"]


def test_near_duplicate_is_demoted_below_a_distinct_memory() -> None:
    ranked = [
        cand("a", "we adopted a puppy named Biscuit in May", fused=1.0),
        cand("a2", "we adopted a puppy named Biscuit in May!!", fused=0.9),
        cand("b", "the vet visit is on Friday", fused=0.6),
    ]
    assert ids(ranking.demote_near_duplicates(ranked, ctx())) == ["a", "b", "a2"]


def _fact_replacing(memory_id: str, *olds: tuple[str, str], rests_on: str = "") -> Candidate:
    """A live fact whose older versions were each learnt from a turn, retired as given."""
    payload = common_pb2.ScoredMemory(
        replaced=[
            common_pb2.Memory(id=f"old-{turn}", source_ids=[turn], superseded_how=how)
            for turn, how in olds
        ]
    )
    sources = (rests_on,) if rests_on else ()
    return Candidate(memory_id, "l3_fact", memory_id, source_ids=sources, payload=payload)


def test_a_turn_saying_a_replaced_value_follows_the_fact_that_replaced_it() -> None:
    fact = _fact_replacing("fact", ("porto", "replaced"), ("detail", "updated"))
    ranked = [cand("porto"), cand("detail"), cand("other"), fact, cand("later")]
    assert ids(ranking.follow_their_facts(ranked, ctx())) == [
        "detail", "other", "fact", "porto", "later",
    ]
    # Below the fact already, or what the fact itself was learnt from: left where it is.
    below = [fact, cand("x"), cand("porto")]
    assert ids(ranking.follow_their_facts(below, ctx())) == ["fact", "x", "porto"]
    own = _fact_replacing("fact", ("both", "replaced"), rests_on="both")
    assert ids(ranking.follow_their_facts([cand("both"), own], ctx())) == ["both", "fact"]


def test_mmr_lifts_a_different_memory_over_a_repeat_of_the_first() -> None:
    ranked = [
        cand("a", "golden retriever puppy Biscuit adopted", fused=1.0),
        cand("a2", "golden retriever puppy Biscuit adopted today", fused=0.95),
        cand("b", "vet visit booked for Friday", fused=0.85),
    ]
    assert ids(ranking.mmr(list(ranked), ctx())) == ["a", "b", "a2"]
    assert ids(ranking.mmr(list(ranked), ctx(settings=RankingSettings(mmr_lambda=1.0)))) == [
        "a",
        "a2",
        "b",
    ]


def _jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    return len(a & b) / len(a | b) if a and b else 0.0


def _near_duplicates_pair_by_pair(ranked: list[Candidate]) -> list[str]:
    """The demotion as its docstring states it, one pair at a time."""
    seen: list[frozenset[str]] = []
    for candidate in ranked:
        words = ranking.tokens(candidate.content)
        if any(_jaccard(words, other) >= ranking.NEAR_DUPLICATE for other in seen):
            candidate.fused *= ranking.NEAR_DUPLICATE_PENALTY
        else:
            seen.append(words)
    return ids(sorted(ranked, key=lambda c: c.fused, reverse=True))


def _mmr_pair_by_pair(ranked: list[Candidate], lam: float) -> list[str]:
    """Maximal marginal relevance as its docstring states it, one pair at a time."""
    top = ranked[0].fused or 1.0
    left = list(ranked)
    picked: list[Candidate] = []
    while left:
        def value(c: Candidate) -> float:
            overlap = max(
                (_jaccard(ranking.tokens(c.content), ranking.tokens(p.content)) for p in picked),
                default=0.0,
            )
            return lam * c.fused / top - (1.0 - lam) * overlap

        best = max(left, key=value)
        picked.append(best)
        left.remove(best)
    return ids(picked)


_phrases = st.lists(
    st.sampled_from(["dog", "Dog", "walk", "park", "the", "a", "!", "vet"]), max_size=6
)


@settings(max_examples=300, deadline=None)
@given(
    contents=st.lists(_phrases.map(" ".join), min_size=3, max_size=25),
    scores=st.lists(st.sampled_from([1.0, 0.9, 0.9, 0.5, 0.25, 0.1]), min_size=25, max_size=25),
    lam=st.sampled_from([0.0, 0.3, 0.7, 0.99]),
)
def test_the_pairwise_passes_match_a_pair_by_pair_reading(
    contents: list[str], scores: list[float], lam: float
) -> None:
    def ranked() -> list[Candidate]:
        given = zip(contents, scores[: len(contents)], strict=True)
        found = [cand(f"m{i}", text, fused=score) for i, (text, score) in enumerate(given)]
        return sorted(found, key=lambda c: c.fused, reverse=True)

    pairs = ranking.overlaps(ranked())
    words = [ranking.tokens(c.content) for c in ranked()]
    assert pairs.tolist() == [[_jaccard(a, b) for b in words] for a in words]
    expected = _near_duplicates_pair_by_pair(ranked())
    assert ids(ranking.demote_near_duplicates(ranked(), ctx())) == expected
    settings_ = RankingSettings(mmr_lambda=lam)
    assert ids(ranking.mmr(ranked(), ctx(settings=settings_))) == _mmr_pair_by_pair(ranked(), lam)
    # Within one search, mmr after near_duplicates reads the overlaps that pass worked out for
    # a head of the same memories (in another order, fewer of them when there are more than
    # three: mmr leaves fewer as they are), and works out its own for one holding another.
    shared = ctx(settings=settings_)
    demoted = ranking.demote_near_duplicates(ranked(), shared)
    fewer = demoted[::-1][: max(3, len(demoted) - 1)]
    other = [*fewer, cand("new", "the dog walk", fused=0.5)]
    worked_out = []
    real = ranking.overlaps
    ranking.overlaps = lambda head: worked_out.append(len(head)) or real(head)  # type: ignore
    try:
        assert ids(ranking.mmr(list(fewer), shared)) == _mmr_pair_by_pair(list(fewer), lam)
        assert ids(ranking.mmr(list(other), shared)) == _mmr_pair_by_pair(list(other), lam)
    finally:
        ranking.overlaps = real  # type: ignore
    assert worked_out == [len(other)]


def test_the_pairwise_passes_know_a_long_memory_by_its_first_words() -> None:
    opening = " ".join(f"w{i}" for i in range(ranking.PAIRWISE_WORDS))
    same_start = [cand("a", f"{opening} apples"), cand("b", f"{opening} pears and plums")]
    assert ranking.overlaps(same_start).tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert ranking.tokens(f"x {opening}") == ranking.tokens(f"x x {opening} tail")


@pytest.mark.parametrize("repeats", [1, 40])
def test_a_memory_is_known_by_its_first_distinct_words_however_long(repeats: int) -> None:
    # Short texts are read in one pass, those past ONE_PASS_CHARS word by word.
    words = [f"W{i % 300}" for i in range(600)] * repeats
    text = "; ".join(words)
    assert (len(text) > ranking.ONE_PASS_CHARS) is (repeats > 1)
    first = list(dict.fromkeys(word.lower() for word in words))[: ranking.PAIRWISE_WORDS]
    assert ranking.tokens(text) == frozenset(first)
    assert ranking.tokens("The cat; the CAT, a_dog") == {"the", "cat", "a", "dog"}


def test_a_window_of_long_memories_holds_little_memory() -> None:
    # Sixty memories of 3,000 distinct words, each sharing half of them with the next: every
    # word is held by two memories, 91,500 in all (a 44 MB matrix counted word by word).
    block = 1500
    texts = [" ".join(f"w{n}" for n in range(i * block, (i + 2) * block)) for i in range(60)]
    head = [cand(f"m{i}", text, fused=1.0 - i / 100) for i, text in enumerate(texts)]
    tracemalloc.start()
    try:
        ranking.overlaps(head)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20


def test_a_request_can_switch_stages_off() -> None:
    ranked = [cand("a", "same words here", cosine=0.9), cand("b", "same words here", cosine=0.8)]
    query_ctx = ctx(vector=ranked)
    object.__setattr__(query_ctx.query, "skip_stages", frozenset({"dedupe"}))
    out, timings = LITE_PIPELINE.run(query_ctx)
    assert ids(out) == ["a", "b"]
    assert "dedupe" not in [t.name for t in timings]


def test_the_full_ranking_and_the_plain_baseline_keep_the_reference_post_processing() -> None:
    for pipeline in (LITE_PIPELINE, PLAIN_PIPELINE):
        names = pipeline.names
        assert names[0] == "fuse"
        assert names[-1] == "truncate"
        assert names.index("intention_ttl") < names.index("session_intentions")


# Floors and settings


def test_unset_min_score_uses_the_models_calibrated_floor() -> None:
    assert SearchConfig.from_env({}).min_score is None
    assert SearchConfig.from_env({"HYATLAS_MIN_SCORE": "0.6"}).min_score == 0.6
    assert calibrated_floor("bge-small-en-v1.5") == 0.60
    assert calibrated_floor("all-MiniLM-L6-v2-int8") < 0.5
    assert calibrated_floor("some-other-model") == 0.60


def test_ranking_settings_come_from_the_environment() -> None:
    config = SearchConfig.from_env(
        {"HYATLAS_RECENCY": "off", "HYATLAS_MMR_LAMBDA": "0.5", "HYATLAS_USAGE_LEARNING": "no"}
    )
    assert config.ranking == RankingSettings(recency=False, mmr_lambda=0.5, usage_learning=False)


def test_retrieval_switches_are_accepted_as_disabled_stages() -> None:
    config = SearchConfig.from_env({"HYATLAS_SEARCH_DISABLE_STAGES": "context_keys,mmr"})
    assert config.pipeline_stages_off() == {"mmr"}
    with pytest.raises(ConfigError, match="expected one of"):
        SearchConfig.from_env({"HYATLAS_SEARCH_DISABLE_STAGES": "contexts"})


# Extra keys


def test_a_long_memory_of_two_sentences_is_also_keyed_by_each() -> None:
    text = (
        "We moved the staging box to the new rack last week, after the old one failed "
        "during the heatwave. Priya owns the runbook and reviews every single change before Friday."
    )
    assert clauses(text) == [
        "We moved the staging box to the new rack last week, after the old one failed "
        "during the heatwave.",
        "Priya owns the runbook and reviews every single change before Friday.",
    ]
    assert [k.kind for k in own_keys(text)] == ["clause"] * 2


def test_a_long_memory_of_more_sentences_is_keyed_by_two_even_runs_of_them() -> None:
    text = (
        "We moved the staging box to the new rack last week. The garden app deploys there "
        "first now. Priya owns the runbook for it. Ok. She reviews every single change "
        "before Friday."
    )
    assert clauses(text) == [
        "We moved the staging box to the new rack last week. The garden app deploys there "
        "first now.",
        # a sentence too short to be a key on its own stays inside its run
        "Priya owns the runbook for it. Ok. She reviews every single change before Friday.",
    ]
    assert passage_of(text).span_texts() == clauses(text)


def test_a_short_memory_has_no_sentence_keys() -> None:
    assert clauses("I adopted a puppy. Her name is Biscuit.") == []


def test_context_key_holds_the_turn_with_its_neighbours() -> None:
    assert context_text("Sam: any plans?", "Priya: hiking", "Sam: nice") == (
        "Sam: any plans?\nPriya: hiking\nSam: nice"
    )
    assert context_text(None, "Priya: hiking", None) == "Priya: hiking"


def test_a_reply_to_a_question_among_the_best_comes_right_after_it() -> None:
    ranked = [
        cand("q", "Where did you go on the road trip?", fused=1.0),
        cand("x", "road trips are fun", fused=0.9),
        cand("y", "the trip was long", fused=0.8),
        cand("a", "We drove to Woodhaven.", fused=0.2, follows_id="q"),
    ]
    assert ids(ranking.lift_replies(ranked, ctx())) == ["q", "a", "x", "y"]


def test_a_reply_is_not_lifted_when_its_turn_asked_nothing_or_ranks_below_the_limit() -> None:
    ranked = [
        cand("s", "We went on a road trip.", fused=1.0),
        cand("q", "Where did you go?", fused=0.9),
        cand("b", "Nice, tell me more", fused=0.5, follows_id="s"),
        cand("a", "Woodhaven.", fused=0.2, follows_id="q"),
    ]
    # "s" asked nothing; "q" is outside a limit of one.
    assert ids(ranking.lift_replies(list(ranked), ctx(limit=1))) == ["s", "q", "b", "a"]
    assert ids(ranking.lift_replies(list(ranked), ctx(limit=2))) == ["s", "q", "a", "b"]


def test_turns_of_the_sitting_the_best_matches_share_rise_over_a_stray_match() -> None:
    ranked = [
        cand("a1", fused=1.0, session_id="s1"),
        cand("a2", fused=0.9, session_id="s1"),
        cand("stray", fused=0.5, session_id="s2"),
        cand("a3", fused=0.35, session_id="s1"),
        cand("loose", fused=0.34),
    ]
    out = ranking.favour_sittings(ranked, ctx())
    assert ids(out) == ["a1", "a2", "a3", "stray", "loose"]
    # A sitting's own best turns gain from each other, not from themselves.
    assert out[0].fused == pytest.approx(1.0 + ranking.SITTING_SHARE * 0.9)
    assert out[-1].fused == pytest.approx(0.34)
