"""The full ranking's stages: weighted score fusion, date, entity, recency and usage boosts,
near-duplicate demotion and MMR diversity."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterator
from typing import cast

import numpy as np

from services.search.dates import asks_when, parse_dates, says_when
from services.search.entities import (
    mention_pattern,
    query_entities,
    speaker_pattern,
    subject_of,
)
from services.search.model import VECTOR, Candidate, SearchContext
from shared.dates import as_local_date
from shared.layers import REPLACED

# Question words that make a query question-like rather than a keyword lookup.
QUESTION_WORDS = frozenset(
    {
        "what",
        "when",
        "where",
        "who",
        "whom",
        "whose",
        "why",
        "how",
        "which",
        "did",
        "does",
        "do",
        "is",
        "are",
        "was",
        "were",
        "can",
        "could",
        "would",
        "should",
        "has",
        "have",
        "will",
    }
)
_TOKEN = re.compile(r"[^\W_]+")


def is_question(text: str) -> bool:
    """Whether a query reads as a question or sentence rather than a few keywords."""
    words = _TOKEN.findall(text.lower())
    return "?" in text or len(words) > 4 or bool(words and words[0] in QUESTION_WORDS)


def fusion_weights(text: str) -> tuple[float, float, float]:
    """(vector, own keywords, context keywords) weights for the kind of query.

    A question leans on meaning and on the talk around a turn; a few keywords (an identifier,
    a name) ask for the memories that hold them, so neighbours do not count. The context key
    holds the memory's own words too, so for a question the own keywords get half weight
    rather than counting the same words twice.
    """
    if is_question(text):
        return 1.0, 0.5, 1.0
    return 0.5, 1.0, 0.0


STRICT_BONUS = 0.2
"""Added for holding enough of the query's terms for the strict rule (the reference's tier)."""


def fuse_scores(ranked: list[Candidate], ctx: SearchContext) -> list[Candidate]:
    """Starts the ranking: a weighted sum of cosine and max-normalised keyword scores.

    The vector floor keeps a weak cosine from counting; keyword hits are never floored.
    """
    merged: dict[str, Candidate] = {}
    for source in (ctx.vector, ctx.keyword, ctx.context):
        for candidate in source:
            kept = merged.setdefault(candidate.memory_id, candidate)
            if kept is not candidate:
                if kept.cosine is None:
                    kept.cosine = candidate.cosine
                if kept.keyword_score is None:
                    kept.keyword_score = candidate.keyword_score
                    kept.keyword_fraction = candidate.keyword_fraction
                    kept.strict = candidate.strict
                if kept.context_score is None:
                    kept.context_score = candidate.context_score
    w_vec, w_own, w_context = fusion_weights(ctx.query.text)
    top_own = max((c.keyword_score for c in ctx.keyword if c.keyword_score), default=0.0) or 1.0
    top_context = max((c.context_score for c in ctx.context if c.context_score), default=0.0) or 1.0
    floor = ctx.floor
    keyword_only = VECTOR not in ctx.query.sources
    for candidate in merged.values():
        score = 0.0
        if candidate.cosine is not None and (floor <= 0 or candidate.cosine >= floor):
            score += w_vec * candidate.cosine
        if candidate.keyword_score is not None:
            score += w_own * max(candidate.keyword_score, 0.0) / top_own
            if candidate.strict:
                # Alone, keywords keep the reference's strict rule as a tier above the relaxed.
                score += 1.0 if keyword_only else STRICT_BONUS
        if candidate.context_score is not None:
            score += w_context * max(candidate.context_score, 0.0) / top_context
        candidate.fused = score
    found = [c for c in merged.values() if c.fused > 0]
    found.sort(key=lambda c: (-c.fused, -(c.cosine or -1.0)))
    # The boosts are modest (a date half again, a sitting a share of the best scores), so what
    # fusion leaves below the head never reaches the results; dropping it keeps later stages
    # cheap. The head is wide enough for a boost to lift a weak match of every source.
    return found[: max(HEAD_PER_RESULT * ctx.query.limit, MIN_HEAD)]


HEAD_PER_RESULT = 5
MIN_HEAD = 100


def _resort(ranked: list[Candidate]) -> list[Candidate]:
    return sorted(ranked, key=lambda c: -c.fused)


DATE_BOOST = 0.5
"""How much more a memory whose event time falls in a date the query names is worth."""


def boost_dates(ranked: list[Candidate], ctx: SearchContext) -> list[Candidate]:
    """Favours memories whose event time (else write time) falls in a date the query names; an
    event date alone (a fact's) is that date in the asker's days."""
    offset = ctx.query.reference_utc_offset_minutes
    ranges = parse_dates(ctx.query.text, ctx.reference_time, offset)
    if not ranges:
        return ranked
    for candidate in ranked:
        when = (
            as_local_date(candidate.event_at, offset)
            if candidate.event_at is not None
            else candidate.created_at
        )
        if any(r.contains(when) for r in ranges):
            candidate.fused *= 1.0 + DATE_BOOST
    return _resort(ranked)


TIME_BOOST = 1.0
"""How much more a memory that says when is worth to a query asking when."""
TIME_READ_CHARS = 2000
"""How much of a memory's text is read for a time: the cost of a search stays bounded however
long its candidates are (a text may hold 100,000 characters)."""


def favour_times(ranked: list[Candidate], ctx: SearchContext) -> list[Candidate]:
    """A query asking when (or for how long) favours memories that say when.

    Of the memories about a thing, the one that answers "when did we repaint the kitchen?" is
    the one that names a time: "we finished the kitchen yesterday", "last week", "in May",
    "for 3 years"; the others are talk about the kitchen. The boost doubles the score: a memory
    that names no time cannot answer, so it ranks above one that does only if it matches far
    better. (A boost of a half, three quarters or one and a half found fewer of LoCoMo's
    answers; see the README.)
    """
    if not asks_when(ctx.query.text):
        return ranked
    for candidate in ranked:
        if says_when(candidate.content[:TIME_READ_CHARS], ctx.reference_time):
            candidate.fused *= 1.0 + TIME_BOOST
    return _resort(ranked)


ENTITY_BOOST = 0.1
"""How much more a memory naming every entity the query names is worth."""


def boost_entities(ranked: list[Candidate], ctx: SearchContext) -> list[Candidate]:
    """Favours memories that name the people, places and things the query names."""
    names = query_entities(ctx.query.text)
    if not names:
        return ranked
    # Single words only: a phrase's words are in the list too, and counting both double-counts.
    words = [n for n in names if " " not in n] or names
    patterns = [mention_pattern(n) for n in words]
    for candidate in ranked:
        share = sum(1 for p in patterns if p.search(candidate.content)) / len(words)
        candidate.fused *= 1.0 + ENTITY_BOOST * share
    return _resort(ranked)


SPEAKER_BOOST = 0.15
"""How much more a transcript line is worth when its speaker is the person the query is about."""


def favour_the_speaker(ranked: list[Candidate], ctx: SearchContext) -> list[Candidate]:
    """A question about a named person favours what that person said.

    A memory kept as a transcript line ("Ana: I signed up for a pottery class") has a speaker.
    When the first name the query holds is that speaker ("what does Ana do to relax?"), the
    line is likelier to answer than one where someone else talks to Ana or about her, which the
    entity boost favours just as much.
    """
    subject = subject_of(ctx.query.text)
    if subject is None:
        return ranked
    said_by = speaker_pattern(subject)
    for candidate in ranked:
        if said_by.match(candidate.content):
            candidate.fused *= 1.0 + SPEAKER_BOOST
    return _resort(ranked)


# People a memory may be about besides its owner: "my <one of these>" names someone else.
_OTHERS = (
    "brother|brothers|sister|sisters|mother|mom|mum|father|dad|parents?|wife|husband|partner|"
    "son|sons|daughter|daughters|kids?|children|child|baby|friend|friends|boyfriend|girlfriend|"
    "fiance|fiancee|boss|manager|colleague|colleagues|coworker|coworkers|cousin|cousins|aunt|"
    "uncle|niece|nephew|grandma|grandpa|grandmother|grandfather|grandparents|neighbour|neighbor|"
    "roommate|flatmate|team|teacher|doctor|therapist|family|in-laws"
)
_ABOUT_OTHER = re.compile(rf"\b(?:my|our)\s+(?:\w+\s+)?(?:{_OTHERS})\b", re.IGNORECASE)
_SPEAKS_AS_ME = re.compile(
    r"(?:\bI\b|\bI'(?:m|ve|d|ll)\b|^\s*user\b)", re.IGNORECASE | re.MULTILINE
)
_ASKS_ABOUT_ME = re.compile(r"\b(?:i|me|my|mine|myself|i'm|i've)\b", re.IGNORECASE)
SELF_BOOST = 0.25
OTHER_DEMOTION = 0.5
"""A question about the owner ("where do I live?") lifts what the owner says of themself by
SELF_BOOST and scales what they say of someone else ("my brother lives in Berlin") by this."""


def asks_about_owner(query: str) -> bool:
    """Whether a question is about its asker: first person, and no one else named as "my X"."""
    return bool(_ASKS_ABOUT_ME.search(query)) and not _ABOUT_OTHER.search(query)


def speaks_of_someone_else(text: str) -> bool:
    """Whether a memory is about another person the owner knows, not about the owner."""
    return bool(_ABOUT_OTHER.search(text)) and not re.search(r"\bI\b", text)


def favour_the_owner(ranked: list[Candidate], ctx: SearchContext) -> list[Candidate]:
    """For a question about the asker, their own statements rise over ones about others."""
    if not asks_about_owner(ctx.query.text):
        return ranked
    for candidate in ranked:
        if speaks_of_someone_else(candidate.content):
            candidate.fused *= OTHER_DEMOTION
        elif _SPEAKS_AS_ME.search(candidate.content):
            candidate.fused *= 1.0 + SELF_BOOST
    return _resort(ranked)


RECENCY_BOOST = 0.03
RECENCY_HALF_LIFE_S = 30 * 86400.0


def boost_recency(ranked: list[Candidate], ctx: SearchContext) -> list[Candidate]:
    """Lets newer memories win close calls; age counts from the owner's newest candidate.

    Measuring from the newest memory rather than the clock is idle-time recency: an owner back
    after a month away finds the same order they left.
    """
    if not ctx.settings.recency or not ranked:
        return ranked
    newest = max(c.created_at for c in ranked)
    for candidate in ranked:
        age = max(0.0, newest - candidate.created_at)
        candidate.fused *= 1.0 + RECENCY_BOOST * 0.5 ** (age / RECENCY_HALF_LIFE_S)
    return _resort(ranked)


USAGE_BOOST = 0.1
USAGE_SATURATION = 10


def boost_usage(ranked: list[Candidate], ctx: SearchContext) -> list[Candidate]:
    """Favours memories replies have used before (HYATLAS_USAGE_LEARNING), with diminishing gain."""
    if not ctx.settings.usage_learning:
        return ranked
    if not any(c.hits for c in ranked):
        return ranked
    for candidate in ranked:
        if candidate.hits > 0:
            gain = math.log1p(min(candidate.hits, USAGE_SATURATION)) / math.log1p(USAGE_SATURATION)
            candidate.fused *= 1.0 + USAGE_BOOST * gain
    return _resort(ranked)


PAIRWISE_WORDS = 256
"""The pairwise passes know a memory by its first this many distinct words. A long memory's
opening tells a repeat from another text as well as the whole of it does, and the cap bounds
the matrix those passes build: a window of 300 memories of 100,000 characters held gigabytes."""


ONE_PASS_CHARS = 4096
"""A text up to this long has its words found in one pass (a third faster than word by word on
memories of a few hundred characters); a longer one is read word by word up to the cap."""


def tokens(text: str) -> frozenset[str]:
    """The first PAIRWISE_WORDS distinct lowercase words of a text."""
    lowered = text.lower()
    words = _TOKEN.findall(lowered) if len(lowered) <= ONE_PASS_CHARS else _opening(lowered)
    return frozenset(itertools.islice(dict.fromkeys(words), PAIRWISE_WORDS))


def _opening(lowered: str) -> Iterator[str]:
    """A text's words in order, up to the one that makes PAIRWISE_WORDS distinct."""
    seen: set[str] = set()
    for match in _TOKEN.finditer(lowered):
        seen.add(match[0])
        yield match[0]
        if len(seen) == PAIRWISE_WORDS:
            return


def words_of(candidate: Candidate) -> frozenset[str]:
    """A candidate's words, worked out once for the pairwise passes."""
    if candidate.words is None:
        candidate.words = tokens(candidate.content)
    return candidate.words


def overlaps(head: list[Candidate]) -> np.ndarray:
    """The Jaccard overlap of every two candidates' word sets (0 where either has none), as
    one matrix product over the words two or more of them use."""
    words = [words_of(candidate) for candidate in head]
    # Each word by its hash (string hashes are fixed within a process), numbered densely.
    hashed = np.fromiter((hash(word) for found in words for word in found), np.int64)
    _, columns, counts = np.unique(hashed, return_inverse=True, return_counts=True)
    rows = np.repeat(np.arange(len(head)), [len(found) for found in words])
    # A word of one candidate only adds to its size, not to what any two share.
    in_several = counts[columns] > 1
    _, columns = np.unique(columns[in_several], return_inverse=True)
    holds = np.zeros((len(head), int(columns.max(initial=-1)) + 1), dtype=np.float32)
    holds[rows[in_several], columns] = 1.0
    # Counts of at most PAIRWISE_WORDS are exact in 32-bit floats.
    shared = (holds @ holds.T).astype(np.float64)
    sizes = np.array([len(found) for found in words], dtype=np.float64)
    np.fill_diagonal(shared, sizes)
    union = sizes[:, None] + sizes[None, :] - shared
    return np.divide(shared, union, out=np.zeros_like(shared), where=union > 0)


def head_overlaps(head: list[Candidate], ctx: SearchContext) -> np.ndarray:
    """overlaps(head), taken from the matrix an earlier pairwise pass of the search worked out
    when it holds every one of them (near_duplicates and mmr mostly look at the same head)."""
    if ctx.overlaps is not None:
        rows, known = ctx.overlaps
        at = [rows.get(candidate.memory_id, -1) for candidate in head]
        if -1 not in at:
            return cast("np.ndarray", known[np.ix_(at, at)])
    matrix = overlaps(head)
    ctx.overlaps = ({candidate.memory_id: i for i, candidate in enumerate(head)}, matrix)
    return matrix


NEAR_DUPLICATE = 0.8
NEAR_DUPLICATE_PENALTY = 0.5
PAIRWISE_MIN_WINDOW = 20
"""The pairwise passes look at the best three times the limit, and at least this many."""


def demote_near_duplicates(ranked: list[Candidate], ctx: SearchContext) -> list[Candidate]:
    """Halves the score of a memory that nearly repeats a better-ranked one."""
    size = max(3 * ctx.query.limit, PAIRWISE_MIN_WINDOW)
    head, tail = ranked[:size], ranked[size:]
    overlap = head_overlaps(head, ctx)
    kept: list[int] = []
    for i, candidate in enumerate(head):
        if kept and overlap[i, kept].max() >= NEAR_DUPLICATE:
            candidate.fused *= NEAR_DUPLICATE_PENALTY
        else:
            kept.append(i)
    return _resort(head) + tail


SITTING_WINDOW = 3
SITTING_SHARE = 0.1
"""Each turn gains this share of the scores of the best SITTING_WINDOW candidates written in
the same sitting (session) as it."""


def favour_sittings(ranked: list[Candidate], ctx: SearchContext) -> list[Candidate]:
    """Turns of a sitting that the best candidates come from are worth more.

    A question is usually about one conversation: when several of the best matches were said in
    the same sitting, that sitting's other turns are likelier answers than a stray match from
    elsewhere. Memories without a session are left as they are.
    """
    window = ranked[:SITTING_WINDOW]
    totals: dict[str, float] = {}
    for candidate in window:
        if candidate.session_id:
            totals[candidate.session_id] = totals.get(candidate.session_id, 0.0) + candidate.fused
    if not totals:
        return ranked
    own = {candidate.memory_id: candidate.fused for candidate in window}
    for candidate in ranked:
        if candidate.session_id in totals:
            others = totals[candidate.session_id] - own.get(candidate.memory_id, 0.0)
            candidate.fused += SITTING_SHARE * others
    return _resort(ranked)


REPLY_SHARE = 0.999
"""A lifted reply's score as a share of its question's: just below it."""


def lift_replies(ranked: list[Candidate], ctx: SearchContext) -> list[Candidate]:
    """A turn that answers a question the ranking holds high comes right after that question.

    In a conversation the answer follows the question: when a turn that asks something is among
    the best matches, the turn after it (if any source found it at all) is most likely what
    is being looked for, even when it shares few words with the query.
    """
    asked = {c.memory_id: c for c in ranked[: ctx.query.limit] if "?" in c.content}
    if not asked:
        return ranked
    for candidate in ranked:
        question = asked.get(candidate.follows_id)
        if question is not None and candidate.fused < question.fused:
            candidate.fused = question.fused * REPLY_SHARE
    return _resort(ranked)


def mmr(ranked: list[Candidate], ctx: SearchContext) -> list[Candidate]:
    """Maximal marginal relevance over the best candidates (HYATLAS_MMR_LAMBDA; 1 is off).

    Each next pick maximises lambda * relevance - (1 - lambda) * its overlap with those picked.
    Only the head of the ranking (three times the limit) is reordered.
    """
    lam = ctx.settings.mmr_lambda
    if lam >= 1.0 or len(ranked) < 3:
        return ranked
    size = max(3 * ctx.query.limit, PAIRWISE_MIN_WINDOW)
    head, tail = ranked[:size], ranked[size:]
    top = head[0].fused or 1.0
    relevance = lam * np.array([c.fused for c in head]) / top
    pairs = head_overlaps(head, ctx)
    # The greatest overlap of each candidate with anything picked so far, kept up to date.
    overlap = np.zeros(len(head))
    left = np.ones(len(head), dtype=bool)
    picked: list[int] = []
    for _ in head:
        value = np.where(left, relevance - (1.0 - lam) * overlap, -np.inf)
        best = int(np.argmax(value))
        picked.append(best)
        left[best] = False
        overlap = np.maximum(overlap, pairs[:, best])
    return [head[i] for i in picked] + tail


def follow_their_facts(ranked: list[Candidate], ctx: SearchContext) -> list[Candidate]:
    """A turn that said a value since replaced comes right after the fact that replaced it.

    A fact's older versions (its `replaced`, from the store) name the turns they were learnt
    from: such a turn still says the old value ("I live in Porto") and may share more of the
    query's words than the fact now true ("User lives in Lisbon"). It stays in the results, as
    the conversation said it, but below what replaced it. A turn the fact itself rests on is
    left where it is.
    """
    place = {c.memory_id: i for i, c in enumerate(ranked)}
    after: dict[str, list[Candidate]] = {}
    moved: set[str] = set()
    for candidate in ranked:
        for turn_id in _outdated_turns(candidate) - moved:
            turn_place = place.get(turn_id)
            if turn_place is not None and turn_place < place[candidate.memory_id]:
                after.setdefault(candidate.memory_id, []).append(ranked[turn_place])
                moved.add(turn_id)
    if not moved:
        return ranked
    out: list[Candidate] = []
    for candidate in ranked:
        if candidate.memory_id not in moved:
            out.append(candidate)
            out.extend(after.get(candidate.memory_id, ()))
    return out


def _outdated_turns(candidate: Candidate) -> set[str]:
    """The rows the candidate's replaced versions were learnt from and it was not."""
    replaced = getattr(candidate.payload, "replaced", ())
    learnt = {s for old in replaced if old.superseded_how == REPLACED for s in old.source_ids}
    return learnt - set(candidate.source_ids)
