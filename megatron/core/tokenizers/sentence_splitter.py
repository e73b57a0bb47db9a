"""Sentence splitting for ``preprocess_data.py --split-sentences``.

Megatron uses NLTK's punkt model. NLTK is optional here: when it is installed *and* its punkt
data is present (``NLTK_DATA``; nothing is downloaded) it finds the sentences; otherwise a
built-in rule splitter does, so ``--split-sentences`` always works offline.

Built-in rules (English-oriented, like punkt's default model):

* a sentence ends at ``.``, ``!``, ``?`` or ``...`` (optionally followed by closing quotes or
  brackets) when whitespace follows and the next word starts with an upper-case letter, a
  digit, or an opening quote/bracket;
* not after a common abbreviation (``Mr.``, ``e.g.``, ``i.e.``, ``Fig.``, ...) or a single-letter
  initial (``J. Smith``);
* a blank line (paragraph break) always ends a sentence.

Both splitters then treat the whitespace between sentences the same way: it is dropped, unless
``keep_newlines`` is set and it contains a newline, in which case it stays at the end of the
preceding sentence (so newline tokens survive into the data, as with Megatron's
``--keep-newlines``). Sentences are otherwise exact slices of the text; empty ones are dropped.
"""

from typing import Callable, Iterable, List, Optional, Tuple

import regex

ABBREVIATIONS = frozenset(
    """
mr mrs ms dr prof sr jr st mt ft vs e.g i.e cf al approx dept est fig figs eq eqs no nos vol vols
ch sec secs pp p ed eds rev gen col lt sgt capt cmdr gov sen rep inc ltd co corp jan feb mar apr
jun jul aug sep sept oct nov dec u.s u.k a.m p.m ph.d b.a m.a resp viz ca op cit ibid
""".split()
)

# A gap between sentences: whitespace after sentence-final punctuation (and closing marks), or a
# blank line anywhere.
_CANDIDATE = regex.compile(r"""(?<=[.!?\u2026]["'\u2019\u201d)\]]*)\s+|\n[^\S\n]*\n\s*""")
_NEXT_STARTS_SENTENCE = regex.compile(r"""["'\u2018\u201c(\[]*[\p{Lu}\p{Lt}\p{N}]""")
_CLOSERS = "\"'\u2019\u201d)]"
_BLANK_LINE = regex.compile(r"\n[^\S\n]*\n")


def _rule_gaps(text: str) -> Iterable[Tuple[int, int]]:
    """(start, end) of each whitespace gap the built-in rules treat as a sentence boundary."""
    for m in _CANDIDATE.finditer(text):
        start, end = m.span()
        if end >= len(text):
            continue
        if _BLANK_LINE.search(text, start, end):
            yield start, end
            continue
        if not _NEXT_STARTS_SENTENCE.match(text, end):
            continue
        # The word before the gap: everything after the previous whitespace (a short window
        # keeps this O(1) per gap on long texts).
        window = text[max(0, start - 64) : start]
        token = window.split()[-1].rstrip(_CLOSERS) if window.strip() else ""
        stem = token.rstrip(".!?\u2026").lower()
        if token.endswith(".") and (stem in ABBREVIATIONS or (len(stem) == 1 and stem.isalpha())):
            continue
        yield start, end


def _gaps_from_spans(text: str, spans: Iterable[Tuple[int, int]]) -> Iterable[Tuple[int, int]]:
    """Turn sentence spans (e.g. from punkt) into the gaps between consecutive sentences."""
    previous_end = None
    for start, end in spans:
        if previous_end is not None:
            yield previous_end, start
        previous_end = end


def _cut(text: str, gaps: Iterable[Tuple[int, int]], keep_newlines: bool) -> List[str]:
    sentences, start = [], 0
    for gap_start, gap_end in gaps:
        keep = keep_newlines and "\n" in text[gap_start:gap_end]
        sentences.append(text[start : gap_end if keep else gap_start])
        start = gap_end
    sentences.append(text[start:])
    if keep_newlines:
        return [s for s in sentences if s.strip()]
    return [s.strip() for s in sentences if s.strip()]


def _load_punkt(lang: str) -> Optional[Callable[[str], Iterable[Tuple[int, int]]]]:
    """punkt's span tokenizer for ``lang`` if NLTK and its data are installed, else None."""
    try:
        import nltk
    except ImportError:
        return None
    for loader in (
        lambda: nltk.tokenize.PunktTokenizer(lang),  # nltk >= 3.8.2 (punkt_tab data)
        lambda: nltk.data.load(f"tokenizers/punkt/{lang}.pickle"),
    ):
        try:
            return loader().span_tokenize
        except Exception:  # missing data files surface as LookupError, OSError or ValueError
            continue
    return None


class SentenceSplitter:
    """Split text into sentences (punkt when available, else the built-in rules).

    Args:
        lang: punkt model language (``--lang``); the built-in rules are English-oriented.
        keep_newlines: keep newline whitespace between sentences (``--keep-newlines``).
        use_nltk: None = punkt if available; False = always the built-in rules.
    """

    def __init__(
        self, lang: str = "english", keep_newlines: bool = False, use_nltk: Optional[bool] = None
    ):
        self.keep_newlines = keep_newlines
        self._punkt = _load_punkt(lang) if use_nltk is not False else None
        if use_nltk and self._punkt is None:
            raise ValueError(
                f"NLTK punkt data for '{lang}' is not available (install nltk and its punkt data, "
                f"or set NLTK_DATA)"
            )
        self.backend = "nltk-punkt" if self._punkt is not None else "builtin-rules"

    def split(self, text: str) -> List[str]:
        if self._punkt is not None:
            gaps = _gaps_from_spans(text, self._punkt(text))
        else:
            gaps = _rule_gaps(text)
        return _cut(text, gaps, self.keep_newlines)

    __call__ = split
