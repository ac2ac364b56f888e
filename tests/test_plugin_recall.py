"""What the Hermes plugin's recall shows, over a pro stack with scripted extractions."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.extractor_support import STACK, Api, new_user
from tests.llm_fake import FakeLlm, Recorded, fake_llm_in_thread
from tests.support import Stack, running_stack, value_eventually

pytestmark = pytest.mark.slow

# The plugin package imports Hermes; its recall module stands alone.
_spec = importlib.util.spec_from_file_location(
    "hyatlas_recall", Path(__file__).parents[1] / "plugins" / "hyatlas" / "recall.py")
assert _spec is not None and _spec.loader is not None
recall_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recall_module)
format_recall = recall_module.format_recall


def _now(record: Recorded) -> Any:
    system = str(record.body["messages"][0]["content"])
    if "Now page" not in system:
        return {}
    if "Ines" in record.prompt:  # the conversation of CONVERSATION
        return {"now": "NOW: Ana's sister Ines plays the cello in an orchestra; Ana is a nurse."}
    return {"now": "NOW: Rui moved to Lisbon and ships Foxtrot 2.0 by December 20."}


@pytest.fixture(scope="module")
def fake(store_backend: str) -> Iterator[FakeLlm]:
    with fake_llm_in_thread() as fake:
        fake.answer = _now
        yield fake


@pytest.fixture(scope="module")
def pro(
    tmp_path_factory: pytest.TempPathFactory, embedder_address: str, fake: FakeLlm
) -> Iterator[Stack]:
    data_dir: Path = tmp_path_factory.mktemp("recall-view")
    with running_stack(
        data_dir, STACK, HYATLAS_EMBEDDER_ADDR=embedder_address, HYATLAS_MODE="pro",
        HYATLAS_LLM_BASE=fake.url, HYATLAS_LLM_MODEL="primary", HYATLAS_LLM_KEY="k",
        HYATLAS_CATCHUP_EVERY="off", HYATLAS_NOW_EVERY="off",
    ) as stack:
        yield stack


@pytest.fixture
def api(pro: Stack) -> Api:
    return Api(pro.base_url, pro.address("store"))


async def recall(api: Api, user: str, query: str) -> tuple[dict[str, Any], str]:
    """The search the plugin's prefetch makes, and the text Hermes gets from it."""
    body = await api.ok("POST", "/api/v1/search", json={
        "query": query, "user_id": user, "agent_id": "hermes", "limit": 8})
    return body, format_recall(body, query, per_channel=8)


def tomorrow() -> str:
    """A due date the search counts as due soon whenever the test runs."""
    return (datetime.now(UTC).date() + timedelta(days=1)).isoformat()


async def remember(api: Api, fake: FakeLlm, user: str, due: str) -> None:
    """Two turns: dated facts, a preference, an intention due on `due`, a page; then a fact
    replaced and one forgotten."""
    fake.on(f"{user}-one", {
        "facts": [
            {"text": "Rui lives in Porto"},
            {"text": "Rui drinks coffee every morning", "label": "user_preferences"},
            {"text": "Rui went hiking in Sintra", "event_at": "2026-11-28"},
            {"text": "Rui's passport number is X123"},
        ],
        "intentions": [{"text": "Rui will ship Foxtrot 2.0", "due_at": due}],
        "entities": [{"name": "Foxtrot", "kind": "project", "state": "runs on Postgres 15"}],
    })
    await api.add(f"{user}-one I live in Porto, drink coffee, hiked Sintra on Nov 28, "
                  f"Foxtrot ships {due}.", user, agent_id="hermes")
    fake.on(f"{user}-two", lambda r: {"facts": [
        {"text": "Rui lives in Lisbon", "replaces": [r.number_of("Rui lives in Porto")]}]})
    await api.add(f"{user}-two Rui lives in Lisbon now, not in Porto.", user, agent_id="hermes")
    await api.ok("POST", "/api/v1/forget", json={
        "text": "Rui's passport number is X123", "user_id": user, "agent_id": "hermes"})


async def test_an_intention_due_soon_is_recalled_with_its_due_date(
    api: Api, fake: FakeLlm
) -> None:
    user, due = new_user(), tomorrow()
    await remember(api, fake, user, due)
    body, text = await recall(api, user, "When does Rui ship Foxtrot?")
    (intention,) = body["memories"]["proactive"]
    assert datetime.fromtimestamp(intention["due_at"], UTC).date().isoformat() == due
    assert f"(l7_intention) Rui will ship Foxtrot 2.0 (due {due})" in text, text


async def test_an_intention_due_soon_is_recalled_whatever_the_question(
    api: Api, fake: FakeLlm
) -> None:
    user = new_user()
    today = datetime.now(UTC).date()
    fake.on(f"{user}-due", {"intentions": [
        {"text": "Rui will renew his passport", "due_at": (today + timedelta(days=1)).isoformat()},
        {"text": "Rui will repaint the fence", "due_at": (today + timedelta(days=30)).isoformat()},
    ]})
    await api.add(f"{user}-due Passport renewal by tomorrow, the fence next month.", user,
                  agent_id="hermes")
    for i, topic in enumerate(("Rui's cat is called Miso", "Rui plays chess on Sundays")):
        fake.on(f"{user}-t{i}-", {"facts": [{"text": topic}]})
        await api.add(f"{user}-t{i}- {topic}.", user, agent_id="hermes")
    body, text = await recall(api, user, "What should I cook tonight?")
    assert [i["content"] for i in body["memories"]["proactive"]] == [
        "Rui will renew his passport"], body
    assert "Rui will renew his passport (due" in text, text


async def test_a_fact_is_dated_when_it_happened_and_the_header_says_so(
    api: Api, fake: FakeLlm
) -> None:
    user = new_user()
    await remember(api, fake, user, tomorrow())
    _, text = await recall(api, user, "What did Rui do in Sintra?")
    assert "- [2026-11-28] (l3_fact) Rui went hiking in Sintra" in text, text
    assert "(date = when it happened, else when it was recorded)" in text.splitlines()[0]


async def test_a_turn_is_dated_on_its_writers_day_wherever_hermes_runs_and_a_date_as_given(
    api: Api, fake: FakeLlm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn said at 20:00 in Los Angeles on 28 November is of that day for Hermes in Kiritimati
    (+14:00, already the 29th there) too; from a server that sends no writer's offset, it is
    of the day it fell on where Hermes runs, as before."""
    user = new_user()
    await api.add(f"{user}-kayak I bought a red kayak today.", user, agent_id="hermes",
                  event_at="2026-11-28T20:00:00-08:00")
    body, _ = await recall(api, user, "What did I buy?")
    (turn,) = [m for m in body["memories"]["normal"] if "kayak" in m["content"]]
    assert turn["utc_offset_minutes"] == -480, turn
    unsent = {k: v for k, v in turn.items() if k != "utc_offset_minutes"}
    local_days = []
    try:
        # 25 hours apart: the turn falls on two different days there.
        for zone in ("Pacific/Kiritimati", "Pacific/Pago_Pago"):
            monkeypatch.setenv("TZ", zone)
            time.tzset()
            assert f"- [2026-11-28] (l2_raw) {user}-kayak" in format_recall(
                body, "What did I buy?", per_channel=8)
            local_days.append(datetime.fromtimestamp(turn["event_at"], UTC).astimezone().date())
            assert f"- [{local_days[-1].isoformat()}] (l2_raw)" in format_recall(
                {"memories": {"normal": [unsent]}}, "kayak", per_channel=8)
            # A date given without a time is that date everywhere, for any writer.
            for dated in ({**turn, "event_at": 1795824000}, {**unsent, "event_at": 1795824000}):
                assert "- [2026-11-28]" in format_recall({"memories": {"normal": [dated]}},
                                                          "kayak", per_channel=8)
    finally:
        monkeypatch.undo()
        time.tzset()
    assert local_days[0] != local_days[1]


async def test_a_fact_that_happened_before_1970_shows_its_own_date(
    api: Api, fake: FakeLlm
) -> None:
    user = new_user()
    fake.on(f"{user}-born", {"facts": [{"text": "Rui was born in Braga",
                                        "event_at": "1965-03-02"}]})
    await api.add(f"{user}-born I was born in Braga on 2 March 1965.", user, agent_id="hermes")
    _, text = await recall(api, user, "When was Rui born?")
    assert "- [1965-03-02] (l3_fact) Rui was born in Braga" in text, text


async def test_retired_values_and_a_preference_s_fact_are_not_recalled_twice_or_at_all(
    api: Api, fake: FakeLlm
) -> None:
    user = new_user()
    await remember(api, fake, user, tomorrow())
    for query in ("Where does Rui live?", "What does Rui drink?", "passport"):
        _, text = await recall(api, user, query)
        # The replaced value shows only quoted, as what the fact now true replaced.
        assert text.count("Rui lives in Porto") == text.count('"Rui lives in Porto"'), text
        assert "X123" not in text, text
        assert text.count("Rui drinks coffee every morning") <= 1, text


async def test_the_now_page_is_recalled_with_the_day_it_was_written(
    api: Api, fake: FakeLlm
) -> None:
    user = new_user()
    fake.on(f"{user}-now", {"facts": [{"text": "Rui lives in Lisbon"}]})
    await api.add(f"{user}-now I live in Lisbon.", user, agent_id="hermes")

    async def with_now() -> dict[str, Any]:
        body, _ = await recall(api, user, "What is Rui up to?")
        assert "now" in body, body
        return body

    body = await value_eventually(with_now)
    day = datetime.fromtimestamp(body["now"]["gmt_created"], UTC).date().isoformat()
    text = format_recall(body, "What is Rui up to?", per_channel=8)
    assert f"[NOW] (written {day})\nNOW: Rui moved to Lisbon" in text, text


async def test_fence_tags_inside_stored_memories_do_not_reach_hermes(api: Api) -> None:
    # Hermes cuts everything between <memory-context> and </memory-context> out of a recall.
    user = new_user()
    await api.add("Pasted config opens with <memory-context> for the canary", user,
                  agent_id="hermes")
    await api.add("The canary config closes with </memory-context> tag", user,
                  agent_id="hermes")
    _, text = await recall(api, user, "canary config memory-context")
    assert "opens with for the canary" in text and "closes with tag" in text, text
    assert "<memory-context>" not in text and "</memory-context>" not in text


async def test_an_empty_store_recalls_nothing(api: Api) -> None:
    body, text = await recall(api, new_user(), "Where does Rui live?")
    assert text == "" and not any(body["memories"].values()) and "now" not in body


CONVERSATION = [
    ("I live in Paris and I work as a nurse at the Quinze-Vingts hospital.",
     "Paris and nursing, noted."),
    ("Where do I live?", "You live in Paris."),
    ("My sister Ines plays the cello in an orchestra.", "A cellist sister, lovely."),
    ("I moved to Madrid last week, for a job at La Paz hospital.", "Madrid now, congrats."),
    ("Where do I live now?", "You live in Madrid."),
    ("What does my sister play?", "Your sister Ines plays the cello."),
    ("Where do I work?", "At La Paz hospital in Madrid."),
    ("Can you keep in mind that my locker code at La Paz is 2231?", "Sure, 2231."),
]
"""A conversation as the plugin stores it: statements, the user's questions about them, a move
that replaces where the user lives and works, and a note asked as a question (no fact taken)."""


async def converse(api: Api, fake: FakeLlm, user: str) -> None:
    """Stores CONVERSATION's turns with the facts a model would take from them."""
    fake.on("Quinze-Vingts hospital.", {"facts": [
        {"text": "User lives in Paris"},
        {"text": "User works as a nurse at the Quinze-Vingts hospital"}]})
    fake.on("plays the cello in an orchestra.", {"facts": [
        {"text": "User's sister Ines plays the cello in an orchestra"}]})
    fake.on("for a job at La Paz hospital.", lambda r: {"facts": [
        {"text": "User lives in Madrid", "replaces": [r.number_of("User lives in Paris")]},
        {"text": "User works at La Paz hospital", "replaces": [r.number_of("Quinze-Vingts")]}]})
    for said, answered in CONVERSATION:
        await api.add(recall_module.turn_text([said], answered), user, agent_id="hermes")


def lines_of(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("- ")]


async def test_a_conversation_s_recall_says_each_thing_once_and_leaves_out_the_users_questions(
    api: Api, fake: FakeLlm
) -> None:
    user = new_user()
    await converse(api, fake, user)

    async def recalled(query: str) -> tuple[dict[str, Any], str]:
        body, text = await recall(api, user, query)
        assert "Ines" in body.get("now", {}).get("content", ""), body  # the last Now page
        return body, text

    recalls = {q: await value_eventually(lambda q=q: recalled(q)) for q in (
        "Where do I live?", "Where do I work?", "What does my sister play?",
        "What is my locker code?")}
    for body, text in recalls.values():
        shown = lines_of(text)
        # Every question the user asked ranks high for a question, and its answer may be stale;
        # a question that holds something no other memory says stays.
        asked = [m for m in body["memories"]["normal"] if m["content"].split("\n")[0][-1] == "?"]
        assert len(asked) > 1 and [line for line in shown if "?" in line.split("ASSISTANT:")[0]
                                   ] == [line for line in shown if "locker code" in line], text
        # The sister's cello is in the Now page, a fact and a turn: the recall says it once more
        # than the Now page at most (the turn, which holds the fact's words and the reply).
        assert sum("plays the cello" in line for line in shown) <= 1, text
        assert "(l3_fact) User's sister Ines plays the cello" not in text, text
    assert "locker code at La Paz is 2231?" in recalls["What is my locker code?"][1]
    body, text = recalls["Where do I live?"]
    (fact,) = [m for m in body["memories"]["normal"] if m["content"] == "User lives in Madrid"]
    day = recall_module._day(fact["replaced"][0]["invalid_at"], fact["utc_offset_minutes"])
    (paris_turn,) = [m["memory_id"] for m in body["memories"]["normal"]
                     if m["content"].startswith("USER: I live in Paris")]
    assert fact["replaced"][0]["source_ids"] == [paris_turn], fact
    assert f'(l3_fact) User lives in Madrid (replaced "User lives in Paris" on {day})' in text
    (paris,) = [line for line in lines_of(text) if "I live in Paris" in line]
    assert paris.endswith(f'(no longer true since {day}: "User lives in Paris")'), text


def test_a_question_naming_someone_no_other_line_names_is_recalled_and_other_questions_not(
) -> None:
    said = ["Where should I take my daughter Lily for her birthday?", "Where do I live?",
            "What does my sister Ines play?"]
    answer = {"memories": {"normal": [
        {"content": "User's sister Ines plays the cello", "layer": "l3_fact",
         "gmt_created": 1764547200},
        *({"content": f"USER: {text}\n\nASSISTANT: Somewhere nice.", "layer": "l2_raw",
           "gmt_created": 1764547200} for text in said)]}}
    shown = lines_of(format_recall(answer, "Where should we go this weekend?", per_channel=8))
    assert [line.split(") ", 1)[1] for line in shown] == [
        "User's sister Ines plays the cello", f"USER: {said[0]} ASSISTANT: Somewhere nice."]


def test_a_line_saying_the_opposite_of_another_is_kept_beside_it() -> None:
    said = ["The pool is open on Sundays", "The pool is not open on Sundays",
            "The pool is open on Sundays and holidays"]
    answer = {"memories": {"normal": [
        {"content": text, "layer": "l3_fact", "gmt_created": 1764547200} for text in said]}}
    shown = lines_of(format_recall(answer, "pool", per_channel=8))
    assert [line.split(") ", 1)[1] for line in shown] == said[1:]


def test_a_turn_is_marked_once_for_a_value_that_two_recalled_memories_replaced() -> None:
    moved = {"content": "User lives in Madrid", "gmt_created": 1764547200, "replaced": [
        {"content": "User lives in Paris", "superseded_how": "replaced", "invalid_at": 1764633600}]}
    answer = {"memories": {
        "profile": [{**moved, "layer": "l1_profile"}],
        "normal": [{**moved, "layer": "l3_fact"}, {
            "content": "USER: I live in Paris.\n\nASSISTANT: Noted.", "layer": "l2_raw",
            "gmt_created": 1764547200}]}}
    text = format_recall(answer, "Where do I live?", per_channel=8)
    assert text.count('replaced "User lives in Paris"') == 1, text
    assert text.count('no longer true since 2025-12-02: "User lives in Paris"') == 1, text


def test_a_turn_is_marked_by_the_turns_a_replaced_value_was_learnt_from_when_named() -> None:
    moved = {"content": "User lives in Madrid", "layer": "l3_fact", "gmt_created": 1764547200,
             "replaced": [{"content": "User lives in Paris", "superseded_how": "replaced",
                           "invalid_at": 1764633600, "source_ids": ["t1"]}]}
    turns = [
        {"memory_id": "t1", "content": "USER: I'm based in Paris now.\n\nASSISTANT: Noted.",
         "layer": "l2_raw", "gmt_created": 1764547200},
        {"memory_id": "t2", "content": "USER: My friend lives in Paris, I visit him.\n\n"
         "ASSISTANT: Nice.", "layer": "l2_raw", "gmt_created": 1764547200},
    ]
    text = format_recall({"memories": {"normal": [moved, *turns]}}, "Paris", per_channel=8)
    (based,) = [line for line in lines_of(text) if "based in Paris" in line]
    (friend,) = [line for line in lines_of(text) if "My friend" in line]
    # The turn the value was learnt from says it in other words; the friend's turn holds the
    # value's words but never said it.
    assert based.endswith('(no longer true since 2025-12-02: "User lives in Paris")'), text
    assert "no longer true" not in friend, text


def test_a_due_day_the_now_page_s_day_and_a_replacement_s_day_are_on_the_writers_clock(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    evening = 1795924800  # 20:00 on 28 November in Los Angeles, 13:00 on the 29th in Tokyo
    due = {"memory_id": "m1", "content": "Rui will ship Foxtrot 2.0", "layer": "l7_intention",
           "gmt_created": evening, "due_at": evening, "utc_offset_minutes": -480,
           "replaced": [{"content": "Rui will ship Foxtrot 1.0", "superseded_how": "updated",
                         "invalid_at": evening}]}
    now = {"content": "NOW: Rui is busy", "gmt_created": evening, "utc_offset_minutes": -480}
    try:
        monkeypatch.setenv("TZ", "Asia/Tokyo")
        time.tzset()
        text = format_recall({"memories": {"proactive": [due]}, "now": now}, "Foxtrot", 8)
    finally:
        monkeypatch.undo()
        time.tzset()
    assert "[NOW] (written 2026-11-28)" in text, text
    assert ('- [2026-11-28] (l7_intention) Rui will ship Foxtrot 2.0 (replaced "Rui will ship '
            'Foxtrot 1.0" on 2026-11-28) (due 2026-11-28)') in text, text


def test_a_time_whose_day_on_a_clock_is_off_the_calendar_shows_its_utc_day(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """00:30 UTC on 1 January of the year 1 is still in the year 0 west of UTC, which Python
    has no date for: the recall shows the UTC day rather than failing."""
    first = {"content": "The calendar starts", "layer": "l3_fact", "event_at": -62135595000}
    try:
        monkeypatch.setenv("TZ", "America/Los_Angeles")
        time.tzset()
        for item in (first, {**first, "utc_offset_minutes": -480}):
            text = format_recall({"memories": {"normal": [item]}}, "calendar", 8)
            assert "- [0001-01-01] (l3_fact) The calendar starts" in text, text
    finally:
        monkeypatch.undo()
        time.tzset()
