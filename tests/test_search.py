"""Search ranking: fusion, post-processing, channels, intention rules and request checks."""

from __future__ import annotations

import pytest

from services.search import channels, stages
from services.search.config import SearchConfig
from services.search.fusion import fuse_sources, reciprocal_rank_fusion
from services.search.model import Candidate, Scope, SearchContext, SearchQuery
from services.search.pipeline import FULL_RANKING_RUNS, LITE_PIPELINE
from services.search.switches import FULL_RANKING
from shared.errors import ConfigError, InvalidArgument, TooLarge
from shared.limits import END_OF_CALENDAR_S

NOW = 1_800_000_000.0
DAY = 86400.0


def cand(
    memory_id: str,
    layer: str = "l3_fact",
    content: str | None = None,
    *,
    cosine: float | None = None,
    keyword: float | None = None,
    label: str = "",
    session: str = "",
    created_at: float = NOW,
    due_at: float | None = None,
) -> Candidate:
    return Candidate(
        memory_id=memory_id,
        layer=layer,
        content=content if content is not None else f"text of {memory_id}",
        label=label,
        session_id=session,
        created_at=created_at,
        due_at=due_at,
        cosine=cosine,
        keyword_fraction=keyword,
    )


def query(**overrides: object) -> SearchQuery:
    args: dict[str, object] = {
        "scope": Scope("u1"),
        "text": "what does the user like",
        "limit": 5,
        "layers": (),
        "min_score": None,
        "default_min_score": 0.6,
        "reader": "",
    }
    args.update(overrides)
    return SearchQuery.build(**args)  # type: ignore[arg-type]


def context(
    vector: list[Candidate] | None = None,
    keyword: list[Candidate] | None = None,
    ttl_s: float | None = 7 * DAY,
    **query_overrides: object,
) -> SearchContext:
    return SearchContext(
        query=query(**query_overrides),
        vector=vector or [],
        keyword=keyword or [],
        now=NOW,
        intention_ttl_s=ttl_s,
    )


def ids(ranked: list[Candidate]) -> list[str]:
    return [c.memory_id for c in ranked]


# Fusion


def test_rrf_adds_one_over_sixty_plus_rank_from_each_source() -> None:
    fused = reciprocal_rank_fusion(
        {"vector": [cand("a"), cand("b")], "keyword": [cand("c"), cand("a")]}
    )
    by_id = {c.memory_id: c for c in fused}
    assert by_id["a"].fused == pytest.approx(1 / 61 + 1 / 62)
    assert by_id["b"].fused == pytest.approx(1 / 62)
    assert by_id["c"].fused == pytest.approx(1 / 61)
    assert by_id["a"].ranks == {"vector": 1, "keyword": 2}


def test_memory_found_by_both_sources_outranks_each_sources_leader() -> None:
    vector = [cand("v1", cosine=0.9), cand("both", cosine=0.8)]
    keyword = [cand("k1", keyword=1.0), cand("both", keyword=1.0)]
    assert ids(fuse_sources(vector, keyword, min_score=0.6)) == ["both", "v1", "k1"]


def test_rrf_tie_goes_to_the_higher_cosine() -> None:
    vector = [cand("low", cosine=0.7)]
    keyword = [cand("high", cosine=0.9)]
    assert ids(reciprocal_rank_fusion({"vector": vector, "keyword": keyword})) == ["high", "low"]


def test_floor_drops_weak_vector_hits_but_never_keyword_hits() -> None:
    vector = [cand("strong", cosine=0.9), cand("weak", cosine=0.3)]
    keyword = [cand("exact", keyword=1.0)]
    fused = fuse_sources(vector, keyword, min_score=0.6)
    assert ids(fused) == ["strong", "exact"]
    assert fused[1].fused == pytest.approx(1 / 61)


def test_floor_does_not_shift_vector_ranks() -> None:
    vector = [cand("a", cosine=0.5), cand("b", cosine=0.95)]
    fused = fuse_sources(vector, [], min_score=0.6)
    assert ids(fused) == ["b"]
    assert fused[0].ranks == {"vector": 1}


def test_weak_vector_hit_found_by_keyword_reports_its_cosine_without_a_vector_rank() -> None:
    vector = [cand("weak", cosine=0.3)]
    keyword = [cand("weak", keyword=0.5)]
    [only] = fuse_sources(vector, keyword, min_score=0.6)
    assert only.ranks == {"keyword": 1}
    assert only.score == pytest.approx(0.3)


def test_zero_floor_keeps_every_vector_hit() -> None:
    vector = [cand("a", cosine=0.2), cand("b", cosine=-0.1)]
    assert ids(fuse_sources(vector, [], min_score=0.0)) == ["a", "b"]


def test_reported_score_is_the_cosine_else_the_share_of_query_terms() -> None:
    vector = [cand("both", cosine=0.7)]
    keyword = [cand("both", keyword=1.0), cand("kw", keyword=0.5)]
    by_id = {c.memory_id: c for c in fuse_sources(vector, keyword, min_score=0.6)}
    assert by_id["both"].score == pytest.approx(0.7)
    assert by_id["kw"].score == pytest.approx(0.5)


# Repeated text


def test_repeated_text_is_dropped_ignoring_case_and_spacing() -> None:
    ranked = [cand("a", content="User likes  Go"), cand("b", content="user likes go "), cand("c")]
    assert ids(stages.drop_repeated_text(ranked, context())) == ["a", "c"]


def test_l1_mirror_takes_its_l3_facts_place() -> None:
    ranked = [
        cand("fact", "l3_fact", "User prefers tea"),
        cand("other"),
        cand("mirror", "l1_profile", "user prefers tea"),
    ]
    assert ids(stages.drop_repeated_text(ranked, context())) == ["mirror", "other"]


def test_l3_fact_below_its_l1_mirror_is_dropped() -> None:
    ranked = [cand("mirror", "l1_profile", "Tea"), cand("fact", "l3_fact", "tea")]
    assert ids(stages.drop_repeated_text(ranked, context())) == ["mirror"]


def test_repeat_from_another_layer_does_not_replace_the_better_ranked_row() -> None:
    ranked = [cand("raw", "l2_raw", "tea"), cand("mirror", "l1_profile", "tea")]
    assert ids(stages.drop_repeated_text(ranked, context())) == ["raw"]


# L5 cap


@pytest.mark.parametrize(("limit", "cap"), [(1, 1), (2, 1), (5, 2), (10, 4), (100, 40)])
def test_knowledge_cap_is_two_fifths_of_the_limit_and_at_least_one(limit: int, cap: int) -> None:
    assert stages.knowledge_cap(limit) == cap


def test_l5_cap_drops_the_lower_ranked_knowledge_rows() -> None:
    ranked = [cand("k1", "l5_knowledge"), cand("k2", "l5_knowledge"), cand("f1")]
    ranked += [cand("k3", "l5_knowledge"), cand("f2")]
    capped = stages.cap_knowledge(ranked, context(limit=5))
    assert ids(capped) == ["k1", "k2", "f1", "f2"]


def test_l5_cap_is_off_when_a_layer_was_asked_for() -> None:
    ranked = [cand(f"k{i}", "l5_knowledge") for i in range(5)]
    assert len(stages.cap_knowledge(ranked, context(limit=5, layers=["l5_knowledge"]))) == 5


# Channels


@pytest.mark.parametrize(
    ("layer", "label", "channel"),
    [
        ("l8_entity", "", "pages"),
        ("l1_profile", "", "profile"),
        ("l6_schema", "", "profile"),
        ("l7_intention", "", "proactive"),
        ("l3_fact", "task_experience", "experiences"),
        ("l3_fact", "user_preferences", "normal"),
        ("l4_summary", "task_experience", "normal"),
        ("l2_raw", "", "normal"),
        ("l4_summary", "", "normal"),
        ("l5_knowledge", "", "normal"),
    ],
)
def test_each_layer_goes_to_its_channel(layer: str, label: str, channel: str) -> None:
    assert channels.channel_of(cand("x", layer, label=label)) == channel


def test_every_channel_is_present_in_display_order_and_keeps_the_ranking() -> None:
    ranked = [cand("n1", "l2_raw"), cand("p1", "l1_profile"), cand("n2", "l4_summary")]
    arranged = channels.arrange(ranked)
    assert list(arranged) == ["pages", "profile", "proactive", "experiences", "normal"]
    assert ids(arranged["normal"]) == ["n1", "n2"]
    assert ids(arranged["profile"]) == ["p1"]
    assert arranged["pages"] == []


def test_order_starts_with_now_only_when_there_is_a_now_page() -> None:
    assert channels.display_order(True) == [
        "now", "pages", "profile", "proactive", "experiences", "normal",
    ]
    assert channels.display_order(False)[0] == "pages"


def test_now_page_is_the_newest_l4_row_labelled_now_page() -> None:
    rows = [
        cand("episode", "l4_summary", label="episode", created_at=NOW),
        cand("old", "l4_summary", label="now_page", created_at=NOW - 100),
        cand("new", "l4_summary", label="now_page", created_at=NOW - 10),
    ]
    page = channels.pick_now_page(rows)
    assert page is not None and page.memory_id == "new"
    assert channels.pick_now_page(rows[:1]) is None


# Intentions


@pytest.mark.parametrize(
    ("created_ago", "due_in", "ttl_s", "live"),
    [
        (6 * DAY, None, 7 * DAY, True),
        (8 * DAY, None, 7 * DAY, False),
        (800 * DAY, None, None, True),
        (30 * DAY, 3 * DAY, 7 * DAY, True),
        (30 * DAY, -0.9 * DAY, 7 * DAY, True),
        (1 * DAY, -1.1 * DAY, 7 * DAY, False),
    ],
)
def test_intention_ttl_and_due_date_rules(
    created_ago: float, due_in: float | None, ttl_s: float | None, live: bool
) -> None:
    intention = cand(
        "i",
        "l7_intention",
        created_at=NOW - created_ago,
        due_at=None if due_in is None else NOW + due_in,
    )
    assert stages.intention_is_live(intention, NOW, ttl_s) is live


# 2024-05-15 kept alone, at its UTC midnight, as a model's or a client's date is.
MAY_15 = 1_715_731_200.0
HOUR = 3600.0


@pytest.mark.parametrize(
    ("offset_minutes", "now", "live"),
    [
        (-480, MAY_15 + DAY + 4 * HOUR, True),  # 20:00 on 15 May in Los Angeles: still due
        (-480, MAY_15 + DAY + 9 * HOUR, False),  # 01:00 on 16 May there: overdue
        (540, MAY_15 + 23 * HOUR, False),  # 23:00 on 15 May in UTC, 08:00 on 16 May in Tokyo
        (540, MAY_15 + 14 * HOUR, True),  # 23:00 on 15 May in Tokyo
        (0, MAY_15 + DAY - 1, True),
        (0, MAY_15 + DAY + 1, False),
    ],
)
def test_a_due_date_alone_is_due_until_its_day_ends_on_the_writers_clock(
    offset_minutes: int, now: float, live: bool
) -> None:
    intention = cand("i", "l7_intention", created_at=MAY_15 - 30 * DAY, due_at=MAY_15)
    intention.utc_offset_minutes = offset_minutes
    assert stages.intention_is_live(intention, now, 7 * DAY) is live
    assert ids(stages.due_soon([intention], now)) == (["i"] if live else [])


def test_intentions_due_soon_come_soonest_first_on_their_writers_clocks() -> None:
    tokyo = cand("tokyo", "l7_intention", due_at=MAY_15 + DAY)  # 16 May, from 15:00 UTC on 15 May
    tokyo.utc_offset_minutes = 540
    la = cand("la", "l7_intention", due_at=MAY_15 + DAY)  # 16 May, from 08:00 UTC on 16 May
    la.utc_offset_minutes = -480
    at_noon = cand("noon", "l7_intention", due_at=MAY_15 + DAY + 12 * HOUR)  # a time: as it is
    at_noon.utc_offset_minutes = -480
    utc = cand("utc", "l7_intention", due_at=MAY_15 + DAY)
    due = stages.due_soon([at_noon, la, utc, tokyo], MAY_15 + 12 * HOUR)
    assert ids(due) == ["tokyo", "utc", "la", "noon"]


def test_old_rows_of_other_layers_are_never_aged_out() -> None:
    ranked = [cand("fact", created_at=NOW - 900 * DAY), cand("i", "l7_intention", created_at=0)]
    assert ids(stages.drop_stale_intentions(ranked, context(ttl_s=DAY))) == ["fact"]


def test_callers_session_intentions_take_the_first_intention_places() -> None:
    ranked = [
        cand("i_other1", "l7_intention", session="s2"),
        cand("fact"),
        cand("i_mine", "l7_intention", session="s1"),
        cand("i_other2", "l7_intention", session="s3"),
    ]
    reordered = stages.own_session_intentions_first(ranked, context(session_id="s1"))
    assert ids(reordered) == ["i_mine", "fact", "i_other1", "i_other2"]
    assert stages.own_session_intentions_first(ranked, context()) == ranked


# Requests and readers


@pytest.mark.parametrize(
    ("reader", "sources"),
    [
        ("", ("vector", "keyword")),
        ("hybrid", ("vector", "keyword")),
        ("hybrid_tag", ("vector", "keyword")),
        ("legacy", ("vector",)),
        ("semantic", ("vector",)),
        ("Vector", ("vector",)),
        ("keyword", ("keyword",)),
    ],
)
def test_reader_selects_the_retrieval_sources(reader: str, sources: tuple[str, ...]) -> None:
    assert query(reader=reader).sources == sources


def test_unknown_reader_names_the_valid_ones() -> None:
    with pytest.raises(InvalidArgument, match="unknown reader 'fuzzy'.*legacy.*keyword"):
        query(reader="fuzzy")


@pytest.mark.parametrize("text", ["", "   "])
def test_empty_query_is_refused(text: str) -> None:
    with pytest.raises(InvalidArgument, match="query required"):
        query(text=text)


def test_scope_without_user_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="user_id"):
        query(scope=Scope(""))


@pytest.mark.parametrize(("asked", "limit"), [(0, 5), (7, 7), (100, 100)])
def test_limit_defaults_to_five_and_goes_up_to_a_hundred(asked: int, limit: int) -> None:
    assert query(limit=asked).limit == limit


def test_a_limit_over_a_hundred_or_negative_is_refused_not_cut() -> None:
    with pytest.raises(InvalidArgument, match="over the maximum of 100"):
        query(limit=101)
    with pytest.raises(InvalidArgument, match="limit must not be negative"):
        query(limit=-3)


def test_a_query_holding_a_nul_or_over_the_text_limit_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="query may not hold a NUL character"):
        query(text="what\x00 does the user like")
    with pytest.raises(TooLarge, match="query has 100,001 characters"):
        query(text="a" * 100_001)


def test_candidate_pool_is_three_times_the_limit_and_at_least_thirty() -> None:
    assert query(limit=5).pool == 30
    assert query(limit=40).pool == 120


def test_min_score_override_replaces_the_default_and_zero_disables() -> None:
    assert query().min_score == pytest.approx(0.6)
    assert query(min_score=0.0).min_score == 0.0
    assert query(min_score=0.99).min_score == pytest.approx(0.99)
    with pytest.raises(InvalidArgument, match="min_score"):
        query(min_score=1.5)


@pytest.mark.parametrize("minutes", [-1440, 1440, 2**31 - 1])
def test_a_utc_offset_of_a_day_or_more_is_refused(minutes: int) -> None:
    with pytest.raises(InvalidArgument, match=r"reference_utc_offset_minutes .* \(under a day\)"):
        query(reference_utc_offset_minutes=minutes)


def test_a_utc_offset_that_moves_the_reference_day_past_the_calendar_is_refused() -> None:
    last_hour = END_OF_CALENDAR_S - 3600
    assert query(reference_time=last_hour, reference_utc_offset_minutes=59).reference_time
    with pytest.raises(InvalidArgument, match="in the year 10000"):
        query(reference_time=last_hour, reference_utc_offset_minutes=60)


def test_unknown_layer_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="layer"):
        query(layers=["l9_dreams"])


# Pipeline


def test_lite_pipeline_dedupes_before_truncating_so_the_limit_holds_distinct_texts() -> None:
    vector = [cand(f"v{i}", cosine=0.9 - i / 100, content="same") for i in range(3)]
    vector += [cand("x", cosine=0.7), cand("y", cosine=0.69)]
    ranked, timings = LITE_PIPELINE.run(context(vector=vector, limit=3))
    assert ids(ranked) == ["v0", "x", "y"]
    assert [t.name for t in timings] == list(LITE_PIPELINE.names)
    assert timings[0].count == 5 and timings[-1].count == 3


def test_every_stage_of_the_full_ranking_runs_in_the_order_its_names_give() -> None:
    assert LITE_PIPELINE.names == FULL_RANKING
    assert set(FULL_RANKING_RUNS) == set(FULL_RANKING)  # no stage's code left unnamed


def test_switched_off_stage_no_longer_runs() -> None:
    vector = [cand(f"v{i}", cosine=0.9, content="same") for i in range(3)]
    ranked, _ = LITE_PIPELINE.without({"dedupe"}).run(context(vector=vector))
    assert len(ranked) == 3


def test_unknown_stage_name_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown search stage bogus"):
        LITE_PIPELINE.without({"bogus"})


def test_config_refuses_an_unknown_stage_and_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="HYATLAS_SEARCH_DISABLE_STAGES"):
        SearchConfig.from_env({"HYATLAS_SEARCH_DISABLE_STAGES": "dedupe,nope"})


def test_fusion_cannot_be_switched_off() -> None:
    with pytest.raises(ConfigError, match="unknown search stage fuse"):
        SearchConfig.from_env({"HYATLAS_SEARCH_DISABLE_STAGES": "fuse"})


def test_config_looks_for_now_pages_only_in_llm_modes() -> None:
    assert SearchConfig.from_env({"HYATLAS_MODE": "lite"}).now_pages is False
    pro = SearchConfig.from_env({"HYATLAS_MODE": "pro", "HYATLAS_SEARCH_DISABLE_STAGES": "l5_cap"})
    assert pro.now_pages is True
    assert pro.disabled_stages == {"l5_cap"}


def test_now_pages_are_kept_out_of_the_channels() -> None:
    ranked = [cand("now", "l4_summary", label="now_page"), cand("episode", "l4_summary")]
    assert ids(stages.drop_now_pages(ranked, context())) == ["episode"]
