"""The ONNX model: tokenise, run onnxruntime, pool and normalise."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tokenizers import Encoding, Tokenizer, normalizers, pre_tokenizers, processors
from tokenizers.models import WordPiece

from services.embedder.models import ModelFiles, ModelSpec
from shared.errors import ConfigError
from shared.passages import Passage
from shared.runtime import trim_heap

log = logging.getLogger(__name__)

# A model run costs about as much as this many padded tokens before any token is processed
# (measured: ~2.5 ms fixed against ~0.25 ms per token on 2 threads); it decides when a
# length-sorted batch is worth splitting into several runs.
RUN_OVERHEAD_TOKENS = 12
# The most texts in one model run (the batcher sends up to HYATLAS_EMBED_MAX_BATCH memories, and
# their sentences come on top).
MAX_RUN = 64
# The most padded tokens (texts x the longest) in one model run: onnxruntime's working memory
# grows with them (64 texts of 256 tokens peaked at ~1.5 GB), while 64 ordinary memories of up
# to 64 tokens still share one run. The batcher bounds what it takes at once by it too (guessing
# tokens from characters), so that a query waits behind about one such run (16 texts at the
# 256-token limit), not 64 long texts.
RUN_TOKENS = 4096
# After a run of texts longer than this many tokens, onnxruntime's memory arena gives back what
# the run took (16 texts of 256 tokens left it holding ~370 MB). Runs of ordinary memories keep
# it (at most ~220 MB, 32 texts of 128 tokens): the arena keeps them fast (without it the
# service's throughput on LoCoMo turns fell 18-48% in four alternating runs of bench/embedder).
SHRINK_AFTER_TOKENS = 128
# When the batcher has had no call for a second (batcher.IDLE_S) after this many texts were run
# since the arena last gave back memory, one run of two tokens has it give back what their
# runs took (300 memories of ~70 tokens left the service ~250 MB larger), and glibc its freed
# pages: the service's memory at rest no longer depends on what it ran last (bench.compare saw
# the embedder hold 218 MiB after one run and 296 after another). Writes coming one by one pay
# for it once every few hundred: a run of two tokens and the arena's regrowth.
GIVE_BACK_AFTER_TEXTS = 256
# A text is tokenised from its first max_tokens x this many characters (see encode_cut): English
# takes 4 to 5 characters a token, so the cut falls far past the tokens the model sees.
CHARS_PER_TOKEN = 16


def load_tokenizer(path: Path, max_tokens: int) -> Tokenizer:
    """A tokenizer from tokenizer.json or a WordPiece vocab.txt, truncating at max_tokens."""
    try:
        tokenizer = (
            wordpiece_tokenizer(path)
            if path.name == "vocab.txt"
            else Tokenizer.from_file(str(path))
        )
    except Exception as exc:  # tokenizers raises bare Exception on a bad file
        raise ConfigError(f"{path} is not a usable tokenizer: {exc}") from exc
    # tokenizer.json files often carry fixed padding to 128 and truncation at 128; this
    # encoder pads each run to its longest text itself, and truncates at the model's limit.
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_tokens)
    return tokenizer


def wordpiece_tokenizer(vocab_path: Path) -> Tokenizer:
    """A lower-casing BERT WordPiece tokenizer ([CLS] text [SEP]) from a vocab.txt."""
    tokenizer = Tokenizer(WordPiece.from_file(str(vocab_path), unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    if cls_id is None or sep_id is None:
        raise ConfigError(f"{vocab_path} has no [CLS] or [SEP] token")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return tokenizer


def encode_cut(tokenizer: Tokenizer, texts: Sequence[str], max_tokens: int) -> list[Encoding]:
    """Each text's encoding as if uncut, tokenised from as few of its first characters as that
    takes (a truncating tokenizer still keeps every token it cuts off: ~25k of them for a
    100,000-character text).

    Tokenizers split text into words at whitespace and punctuation and tokenise each word alone,
    so cutting a text can change only the tokens of the word the cut falls in. When the encoding
    of the cut text is full and its tokens end in the cut's first half, that word comes after
    them (or is over half the cut long, which WordPiece makes one [UNK] ending at the cut).
    Otherwise (long runs of spaces, huge words) the cut is doubled until that holds or nothing
    is cut.
    """
    cut = max_tokens * CHARS_PER_TOKEN
    encodings = tokenizer.encode_batch([text[:cut] for text in texts])
    for index, text in enumerate(texts):
        size = cut
        while size < len(text) and not _settled(encodings[index], size, max_tokens):
            size *= 2
            encodings[index] = tokenizer.encode(text[:size])
    return encodings


def _settled(encoding: Encoding, size: int, max_tokens: int) -> bool:
    """Whether the encoding of a text's first `size` characters is that of the whole text."""
    ends = [
        last
        for (_, last), special in zip(encoding.offsets, encoding.special_tokens_mask, strict=True)
        if not special
    ]
    return len(encoding.ids) == max_tokens and bool(ends) and ends[-1] <= size // 2


def plan_runs(
    lengths: Sequence[int],
    overhead_tokens: int = RUN_OVERHEAD_TOKENS,
    most: int = MAX_RUN,
    budget: int = RUN_TOKENS,
) -> list[list[int]]:
    """Splits texts, by index, into runs of similar token length so padding costs little.

    Texts are taken shortest first; a text joins the current run unless the padding it would
    add to the run's earlier texts costs more than starting a new run, or the run holds `most`
    texts already, or its padded tokens (texts x the longest) would pass `budget` (these two
    bound a run's memory).
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    runs: list[list[int]] = []
    longest = 0
    for index in order:
        length = lengths[index]
        run = runs[-1] if runs else []
        if (
            run
            and len(run) < most
            and (len(run) + 1) * length <= budget
            and len(run) * (length - longest) <= overhead_tokens
        ):
            run.append(index)
        else:
            runs.append([index])
        longest = length
    return runs


class OnnxEncoder:
    """Turns texts into unit vectors with one ONNX sentence-embedding model."""

    def __init__(self, files: ModelFiles, threads: int, pooled_spans: bool = False) -> None:
        """pooled_spans: a span's vector is the mean of its tokens' states in its text's run
        (mean-pooling models only); otherwise each span is embedded alone."""
        self.spec: ModelSpec = files.spec
        self._pooled_spans = pooled_spans and files.spec.pooling == "mean"
        self._tokenizer = load_tokenizer(files.tokenizer_path, files.spec.max_tokens)
        self._pad_id = self._tokenizer.token_to_id("[PAD]") or 0
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Idle worker threads sleep instead of spinning: on a small machine the spinning took
        # the CPU the store and the search service needed (about 25 ms per query embedded).
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            self._session = ort.InferenceSession(
                str(files.onnx_path), options, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # onnxruntime's load errors share no base class
            raise ConfigError(f"{files.onnx_path} is not a loadable ONNX model: {exc}") from exc
        self._shrink = ort.RunOptions()
        self._shrink.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        self._texts_held = 0
        """Texts run since the last give_back."""
        self._inputs = {item.name for item in self._session.get_inputs()}
        outputs = self._session.get_outputs()
        self._output = (
            "last_hidden_state"
            if any(o.name == "last_hidden_state" for o in outputs)
            else outputs[0].name
        )
        width = next(o for o in outputs if o.name == self._output).shape[-1]
        if isinstance(width, int) and width != self.spec.ndim:
            self.spec = dataclasses.replace(self.spec, ndim=width)
        trim_heap()  # building the session read and parsed the model file, then freed it
        log.info(
            "loaded %s from %s (%s pooling, %d threads)",
            self.spec.model_id,
            files.onnx_path,
            self.spec.pooling,
            threads,
        )

    def tokens_guess(self, passage: Passage) -> int:
        """About how many tokens of a passage's text the model takes, before tokenising it (an
        English token takes 4 to 5 characters, so this rather guesses over)."""
        return min(self.spec.max_tokens, len(passage.text) // 4 + 2)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """One L2-normalised float32 row per text, in order."""
        return self.encode_passages([Passage(text) for text in texts])

    def encode_passages(self, passages: Sequence[Passage]) -> np.ndarray:
        """Rows for each passage in order: its text's, then each span's (see shared.passages)."""
        if not passages:
            return np.zeros((0, self.spec.ndim), dtype=np.float32)
        encodings = encode_cut(
            self._tokenizer, [p.text for p in passages], self.spec.max_tokens
        )
        rows: list[list[np.ndarray | None]] = [[] for _ in passages]
        for run in plan_runs([len(e.ids) for e in encodings]):
            hidden, mask = self._hidden([encodings[i] for i in run])
            pooled = self._pool(hidden, mask)
            for row, i in enumerate(run):
                spans = passages[i].spans
                rows[i] = [pooled[row], *(self._span(hidden[row], encodings[i], s) for s in spans)]
        self._embed_left_over(passages, rows)
        return np.stack([vector for vectors in rows for vector in vectors if vector is not None])

    def _span(
        self, hidden: np.ndarray, encoding: Encoding, span: tuple[int, int]
    ) -> np.ndarray | None:
        """The mean of a span's token states; None when spans are not pooled or the span was
        cut off by the token limit."""
        if not self._pooled_spans:
            return None
        start, end = span
        tokens = [
            t
            for t, ((first, last), special) in enumerate(
                zip(encoding.offsets, encoding.special_tokens_mask, strict=True)
            )
            if not special and first >= start and last <= end and last > first
        ]
        if not tokens:
            return None
        return _unit(hidden[tokens].mean(axis=0))

    def _embed_left_over(
        self, passages: Sequence[Passage], rows: list[list[np.ndarray | None]]
    ) -> None:
        """Embeds on their own the spans pooling could not give a vector."""
        missing = [
            (i, j) for i, vectors in enumerate(rows) for j, v in enumerate(vectors) if v is None
        ]
        if not missing:
            return
        texts = [passages[i].span_texts()[j - 1] for i, j in missing]
        for (i, j), vector in zip(missing, self.encode(texts), strict=True):
            rows[i][j] = vector

    def _hidden(
        self, encodings: list[Encoding], shrink: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """The model's token states for a run of texts, and their attention mask; with shrink,
        or for long texts, the arena gives back what it holds once the run ends."""
        width = max(len(e.ids) for e in encodings)
        ids = np.full((len(encodings), width), self._pad_id, dtype=np.int64)
        mask = np.zeros((len(encodings), width), dtype=np.int64)
        types = np.zeros((len(encodings), width), dtype=np.int64)
        for row, encoding in enumerate(encodings):
            n = len(encoding.ids)
            ids[row, :n] = encoding.ids
            mask[row, :n] = 1
            types[row, :n] = encoding.type_ids
        shrink = shrink or width > SHRINK_AFTER_TOKENS
        self._texts_held += len(encodings)
        feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        hidden = self._session.run(
            [self._output],
            {k: v for k, v in feed.items() if k in self._inputs},
            self._shrink if shrink else None,
        )[0]
        return hidden, mask

    @property
    def holding(self) -> bool:
        """Whether enough texts ran since the arena last gave back memory that it should now
        (see GIVE_BACK_AFTER_TEXTS)."""
        return self._texts_held >= GIVE_BACK_AFTER_TEXTS

    def give_back(self) -> None:
        """Has the arena give back what runs took (one run of [CLS] [SEP]), and glibc the
        pages freed."""
        self._hidden([self._tokenizer.encode("")], shrink=True)
        trim_heap()  # the runs' other buffers, freed but kept by the allocator
        self._texts_held = 0

    def _pool(self, hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
        if self.spec.pooling == "cls":
            pooled = hidden[:, 0, :]
        else:
            weights = mask[:, :, None].astype(np.float32)
            pooled = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        return (pooled / np.maximum(norms, 1e-12)).astype(np.float32)


def _unit(vector: np.ndarray) -> np.ndarray:
    return (vector / max(float(np.linalg.norm(vector)), 1e-12)).astype(np.float32)
