"""The ifbench reward: IFEval's 25 instructions with lm-evaluation-harness's strict verdicts."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from relax_hpc.data.sample import Sample
from relax_hpc.rewards.ifbench import INSTRUCTION_IDS, IfbenchReward, check_instruction, ifbench_reward

LESS, AT_LEAST = "less than", "at least"

# (instruction id, kwargs, a response that follows it, one that does not). Each pair is worked out
# from the reference's check_following.
CASES: list[tuple[str, dict[str, Any], str, str]] = [
    ("keywords:existence", {"keywords": ["Paris", "river"]}, "paris has a river", "Paris only"),
    ("keywords:existence", {"keywords": ["cat"]}, "a category", "a dog"),  # a substring counts
    ("keywords:frequency", {"keyword": "the", "frequency": 2, "relation": AT_LEAST}, "The sun, the moon", "The sun"),
    ("keywords:frequency", {"keyword": "very", "frequency": 2, "relation": LESS}, "very good", "very very good"),
    ("keywords:forbidden_words", {"forbidden_words": ["very"]}, "quite good, everything", "Very good"),
    ("keywords:letter_frequency", {"letter": "a", "let_frequency": 3, "let_relation": AT_LEAST}, "A banana", "a pear"),
    ("keywords:letter_frequency", {"letter": "z", "let_frequency": 2, "let_relation": LESS}, "a zoo", "Zig zag"),
    (
        "language:response_language",
        {"language": "fr"},
        "Bonjour, je m'appelle Marie et j'habite à Paris depuis dix ans.",
        "Hello, my name is Mary and I have lived in London for ten years.",
    ),
    # "Mr." does not end a sentence for punkt: 2 sentences, not 3.
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": LESS}, "Mr. Li came. Go.", "Go. Run. Go."),
    ("length_constraints:number_sentences", {"num_sentences": 2, "relation": AT_LEAST}, "One. Two!", "Only one."),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "First.\n***\nSecond.", "First.\n***\n***\nThird."),
    ("length_constraints:number_words", {"num_words": 3, "relation": AT_LEAST}, "one, two-three", "one two"),
    ("length_constraints:number_words", {"num_words": 3, "relation": LESS}, "one two", "one two three"),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
        "First part.\n\n\"Then, the second.",
        "First part.\n\nAnd then the second.",
    ),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "[name] at [address]", "[name] at [\n]"),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Hi.\n**P.S.** bye", "Hi. PS bye"),
    ("detectable_content:postscript", {"postscript_marker": "P.P.S"}, "Hi.\np. p. s. bye", "Hi.\nP.S. bye"),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* one\n- two\n**not**", "* one\n* two\n- three"),
    ("detectable_format:constrained_response", {}, "My answer is no.", "My answer is nope."),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*one* and **two**", "*one* and * *"),
    (
        "detectable_format:multiple_sections",
        {"section_spliter": "Section", "num_sections": 2},
        "Section 1\na\nSection 2\nb",
        "Section 1\na\nSECTION 2\nb",
    ),
    ("detectable_format:json_format", {}, '```json\n{"a": 1}\n```', "{a: 1}"),
    ("detectable_format:title", {}, "<<My Title>>\ntext", "<< >>\ntext"),
    ("combination:two_responses", {}, "Yes.\n******\nNo.", "Yes.\n******\nYes."),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Write a poem."}, " write a poem. Roses", "Sure! Write a poem."),
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, '"Done. Any other questions?"', "Any other? No."),
    # NLTK's tokens: THE, U.S., DO, N'T, CAN, NOT are all capitals (6); "Hello," is not.
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 6, "capital_relation": AT_LEAST},
        "Hello, THE U.S. DON'T. CANNOT!",
        "Hello, THE U.S. DOES. CAN!",
    ),
    ("change_case:capital_word_frequency", {"capital_frequency": 2, "capital_relation": LESS}, "ONE two", "ONE TWO"),
    (
        "change_case:english_capital",
        {},
        "THIS IS A SHORT ANSWER WRITTEN IN ENGLISH.",
        "CECI EST UNE RÉPONSE ÉCRITE EN FRANÇAIS.",
    ),
    (
        "change_case:english_lowercase",
        {},
        "this is a short answer written in english.",
        "ceci est une réponse écrite en français, pas en anglais.",
    ),
    ("punctuation:no_comma", {}, "no commas here", "one, two"),
    ("startend:quotation", {}, '  "quoted"\n', '"half quoted'),
]
KWARGS = {instruction: kwargs for instruction, kwargs, _, _ in CASES}


def _sample(text: str, label: Any = None, **metadata: Any) -> Sample:
    return Sample([1], [2], [-1.0], 0, group_id=0, prompt_index=0, label=label, response_text=text, metadata=metadata)


def _reward(text: str, ids: list[str], kwargs: list[dict[str, Any]]) -> dict[str, float]:
    return ifbench_reward(_sample(text, instruction_id_list=ids, kwargs=kwargs))


def test_all_25_reference_instructions_have_cases() -> None:
    assert len(INSTRUCTION_IDS) == 25
    assert set(KWARGS) == set(INSTRUCTION_IDS)


@pytest.mark.parametrize(("instruction", "kwargs", "good", "bad"), CASES)
def test_check_follows_and_fails(instruction: str, kwargs: dict[str, Any], good: str, bad: str) -> None:
    assert check_instruction(instruction, good, kwargs) is True
    assert check_instruction(instruction, bad, kwargs) is False
    assert _reward(good, [instruction], [kwargs]) == {"score": 1.0, "followed_frac": 1.0}
    assert _reward(bad, [instruction], [kwargs]) == {"score": 0.0, "followed_frac": 0.0}


@pytest.mark.parametrize("instruction", INSTRUCTION_IDS)
def test_empty_response_follows_nothing(instruction: str) -> None:
    # "Less than", forbidden words, no comma, lowercase... would all hold for an empty text.
    for empty in ("", "  \n\t "):
        assert check_instruction(instruction, empty, KWARGS[instruction]) is False


def test_keywords_with_non_word_characters() -> None:
    assert check_instruction("keywords:existence", "I write c++ daily", {"keywords": ["C++"]})
    assert check_instruction("keywords:existence", "Made in the U.S.", {"keywords": ["U.S."]})
    assert not check_instruction("keywords:existence", "Made in the USA", {"keywords": ["U.S."]})  # literal dots
    forbidden = {"forbidden_words": ["c++", "U.S."]}
    assert not check_instruction("keywords:forbidden_words", "I like C++.", forbidden)
    assert not check_instruction("keywords:forbidden_words", "the U.S. economy", forbidden)
    assert check_instruction("keywords:forbidden_words", "I like C and the US", forbidden)
    # Forbidden words are whole words, as in the reference: "cat" does not forbid "category".
    assert check_instruction("keywords:forbidden_words", "a category", {"forbidden_words": ["cat"]})


def test_whole_word_keyword_match() -> None:
    cat = {"keywords": ["cat"]}
    assert check_instruction("keywords:existence", "a category", cat)
    assert not check_instruction("keywords:existence", "a category", cat, keyword_match="whole_word")
    assert check_instruction("keywords:existence", "the cat.", cat, keyword_match="whole_word")
    assert check_instruction("keywords:existence", "use C++!", {"keywords": ["c++"]}, keyword_match="whole_word")
    # "the" in "There the other": 3 substrings, 1 whole word.
    twice = {"keyword": "the", "frequency": 2, "relation": AT_LEAST}
    assert check_instruction("keywords:frequency", "There the other", twice)
    assert not check_instruction("keywords:frequency", "There the other", twice, keyword_match="whole_word")
    reward = IfbenchReward(keyword_match="whole_word")
    assert not reward(_sample("a category", instruction_id_list=["keywords:existence"], kwargs=[cat]))["score"]
    assert ifbench_reward(_sample("a category", instruction_id_list=["keywords:existence"], kwargs=[cat]))["score"]


def test_reference_details() -> None:
    # Text langdetect cannot read counts as followed, as in the reference.
    assert check_instruction("language:response_language", "12345 !!!", {"language": "fr"})
    assert not check_instruction("change_case:english_lowercase", "1234 ...", {})  # no letter is not lower case
    # A quoted response may end with the phrase inside the quotes.
    assert check_instruction("startend:end_checker", '"Bye. Anything else?"', {"end_phrase": "anything else?"})
    # Leading and trailing dividers leave no paragraph; an empty one in between fails.
    assert check_instruction("length_constraints:number_paragraphs", "***\nA\n***\nB\n***", {"num_paragraphs": 2})
    # The nth paragraph is counted in the raw split: a leading blank part shifts it.
    nth = {"num_paragraphs": 2, "nth_paragraph": 1, "first_word": "first"}
    assert not check_instruction("length_constraints:nth_paragraph_first_word", "\n\nFirst\n\nSecond", nth)
    # A `*` that ends its line takes the next line into the same bullet.
    assert check_instruction("detectable_format:number_bullet_lists", "*\n* two", {"num_bullets": 1})
    assert check_instruction("detectable_format:json_format", '```JSON\n[1, "x"]```', {})
    assert not check_instruction("detectable_format:json_format", "[" * 100_000, {})  # nesting, not a crash
    # Parquet/pandas fill kwargs of other instructions with None / NaN.
    assert check_instruction("punctuation:no_comma", "fine", {"num_words": None, "frequency": float("nan")})


def test_all_must_hold_and_kwargs_from_parquet() -> None:
    ids = ["punctuation:no_comma", "change_case:english_lowercase"]
    kwargs = [{"num_words": None}, {"relation": None}]
    text = "this short answer is written in plain english"
    assert _reward(text + ", with a comma", ids, kwargs) == {"score": 0.0, "followed_frac": 0.5}
    assert _reward(text, ids, kwargs)["score"] == 1.0
    label = {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}
    assert ifbench_reward(_sample("fine", label))["score"] == 1.0  # instructions in a dict label
    assert _reward("", ["punctuation:no_comma"], [{}]) == {"score": 0.0, "followed_frac": 0.0}


@pytest.mark.parametrize(
    ("instruction", "kwargs", "message"),
    [
        ("keywords:existence", {"keywords": None}, "'keywords:existence' kwarg 'keywords' is missing"),
        ("keywords:existence", {"keywords": []}, "'keywords:existence' kwarg 'keywords' is missing"),
        ("keywords:frequency", {"keyword": "x", "frequency": 2}, "'keywords:frequency' kwarg 'relation' is missing"),
        ("length_constraints:number_words", {"num_words": 3, "relation": "at most"}, "'at most'; allowed"),
        ("length_constraints:number_words", {"num_words": -1, "relation": LESS}, "'num_words' must be at least 0"),
        ("detectable_format:number_bullet_lists", {"num_bullets": "2"}, "'num_bullets' must be an integer"),
        ("combination:repeat_prompt", {}, "'combination:repeat_prompt' kwarg 'prompt_to_repeat' is missing"),
        ("keywords:letter_frequency", {"letter": "ab", "let_frequency": 1, "let_relation": LESS}, "one ASCII letter"),
        ("language:response_language", {"language": "english"}, "'language' is 'english'; langdetect knows"),
        (
            "length_constraints:nth_paragraph_first_word",
            {"num_paragraphs": 2, "nth_paragraph": 3, "first_word": "a"},
            "'nth_paragraph' is 3, past num_paragraphs=2",
        ),
    ],
)
def test_missing_or_bad_kwargs_raise(instruction: str, kwargs: dict[str, Any], message: str) -> None:
    # Checked before the response, so an empty response does not hide a broken row.
    for text in ("some text", ""):
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            check_instruction(instruction, text, kwargs)


def test_bad_rows_raise_clearly() -> None:
    with pytest.raises(ValueError, match="unknown instruction id 'nope:x'; supported: keywords:existence, .*no_comma"):
        _reward("x", ["nope:x"], [{}])
    with pytest.raises(ValueError, match="no 'instruction_id_list'.*metadata_keys"):
        ifbench_reward(_sample("x"))
    with pytest.raises(ValueError, match="2 instruction ids but 1 kwargs"):
        _reward("x", ["punctuation:no_comma", "startend:quotation"], [{}])
    with pytest.raises(ValueError, match="keyword_match='word'; allowed: reference, whole_word"):
        check_instruction("punctuation:no_comma", "x", {}, keyword_match="word")
    with pytest.raises(ValueError, match="keyword_match='word'"):
        IfbenchReward(keyword_match="word")  # type: ignore[arg-type]


def test_ifbench_reward_pickles() -> None:
    reward = IfbenchReward(keyword_match="whole_word")
    copy = pickle.loads(pickle.dumps(reward))
    assert copy == reward and copy.keyword_match == "whole_word"
    sample = _sample("no commas", instruction_id_list=["punctuation:no_comma"], kwargs=[{}])
    assert copy(sample) == reward(sample) == {"score": 1.0, "followed_frac": 1.0}
    assert pickle.loads(pickle.dumps(ifbench_reward))(sample)["score"] == 1.0


_N = 200_000
ADVERSARIAL = {
    "spaces": "a" + " " * _N + "b",
    "mixed whitespace": "x" + " \t\r" * (_N // 3) + "y",
    "newlines": "a" + "\n" * _N,
    "spaces then newline": (" " * 100 + "\n") * (_N // 101),
    "stars": "*" * _N,
    "star lines": "*\n" * (_N // 2),
    "angle brackets": "<<" * (_N // 2),
    "open brackets": "[" * _N,
    "indented dashes": (" " * 50 + "-") * (_N // 51),
    "periods": ". " * (_N // 2),
    "sentences": "DON'T STOP. " * (_N // 12),
    "markers": "p. P.P Section " * (_N // 15),
    "braces": "{" * _N,
    "quotes": "'\"" * (_N // 2),
}


@pytest.mark.timeout(120)  # a guard against a quadratic regex; each check takes well under a second
@pytest.mark.parametrize("text", ADVERSARIAL.values(), ids=list(ADVERSARIAL))
def test_long_adversarial_responses_finish(text: str) -> None:
    for instruction in INSTRUCTION_IDS:
        for keyword_match in ("reference", "whole_word"):
            followed = check_instruction(instruction, text, KWARGS[instruction], keyword_match=keyword_match)
            assert isinstance(followed, bool)


def test_hub_builds_ifbench_with_the_spec_keyword_match() -> None:
    from relax_hpc.rewards.hub import RewardHub
    from relax_hpc.spec.schema import RewardSpec

    row = {"instruction_id_list": ["keywords:existence"], "kwargs": [{"keywords": ["cat"]}]}
    for mode, expected in (("reference", 1.0), ("whole_word", 0.0)):
        hub = RewardHub.from_settings(RewardSpec(function="ifbench", ifbench_keyword_match=mode))
        try:
            sample = Sample([1], [2], [-1.0], 0, group_id=0, prompt_index=0, label=row,
                            response_text="A category of its own.")
            hub.score([sample])  # in a worker process: the configured reward pickles
        finally:
            hub.close()
        assert sample.reward == expected, mode
