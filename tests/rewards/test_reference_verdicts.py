"""Our `dapo` and `ifbench` rewards against verdicts recorded from the code they follow.

tests/rewards/data/ holds hand-written cases (*_cases.jsonl) and the verdicts of veRL's
`math_dapo` and of lm-evaluation-harness's IFEval (strict) on them (*_reference.json), recorded
once by tools/record_reward_verdicts.py at the commits those files name; the references are not
dependencies. Every case where we differ is listed below with its reason. A new difference, or
a listed one that went away, fails and names the case and both verdicts; after changing a case
file, re-record (see the script's docstring).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from relax_hpc.data.sample import Sample
from relax_hpc.rewards.ifbench import INSTRUCTION_IDS, check_instruction
from relax_hpc.rewards.math_answer import dapo_reward

DATA = Path(__file__).parent / "data"
RECORD = "python tools/record_reward_verdicts.py --verl DIR --lm-eval DIR (see its docstring)"
MIN_AGREEMENT = 0.95

# math_dapo normalises the answer and the label as strings (it drops "=" left sides, spaces,
# "$", \text{}, a list of unit words, thousands commas of plain integers) and compares them;
# `dapo` compares with math-verify after a cheap string check (normalize_answer). Both read the
# last "Answer:" line of the final 300 characters with the same regex, so differences are
# about equality only: mostly forms math-verify knows are equal and math_dapo's strings do not.
MATH_DIFFERENCES: dict[str, str] = {
    "int-leading-zero": "math-verify reads 042 as the integer 42; math_dapo compares '042' with '42'",
    "int-trailing-period": "normalize_answer drops a sentence period after the answer; math_dapo keeps it: "
    "'42.' != '42'",
    "int-float-form": "math-verify: 42.0 == 42; math_dapo compares the strings",
    "int-parenthesised": "math-verify reads (42) as 42; math_dapo keeps the parentheses",
    "frac-vs-decimal": "math-verify treats 0.5 and \\frac{1}{2} as equal; math_dapo compares normalised strings",
    "frac-vs-slash": "math-verify treats 1/2 and \\frac{1}{2} as equal; math_dapo compares normalised strings",
    "frac-slash-vs-decimal": "math-verify treats 1/2 and 0.5 as equal; math_dapo compares normalised strings",
    "frac-dfrac": "normalize_answer maps \\dfrac to \\frac; math_dapo does not",
    "frac-tfrac-vs-decimal": "math-verify treats \\tfrac{3}{4} and 0.75 as equal; math_dapo compares strings",
    "frac-unreduced": "math-verify reduces \\frac{2}{4} to 1/2; math_dapo compares strings",
    "frac-decimal-zeros": "math-verify: 0.50 == 0.5; math_dapo compares the strings",
    "frac-negative-numerator": "math-verify: \\frac{-1}{2} == -\\frac{1}{2}; math_dapo compares strings",
    "frac-long-third": "math-verify compares decimals to 1/3 after rounding to 6 places, so 0.3333333333 counts "
    "(0.333 does not, case frac-rounded-third); math_dapo compares strings",
    "frac-mixed-number": "math-verify reads 1\\frac{1}{2} as the mixed number 3/2; math_dapo compares strings",
    "unit-apples": "we drop plain words after a number ('3 apples' -> 3, as '12 dollars' -> 12); math_dapo "
    "strips only the unit words on its list, which has no 'apples'",
    "unit-percent": "math-verify accepts 5\\% for the label 5 (a percentage of the same number); math_dapo "
    "keeps '5\\%'",
    "sep-thin-space": "normalize_answer removes LaTeX thin spaces (\\,); math_dapo removes ',\\!' and '{,}' only",
    "sep-comma-decimal": "math-verify reads 12,345.6 as 12345.6; math_dapo drops commas only from plain integers",
    "neg-unicode-minus": "math-verify reads the unicode minus sign (U+2212) as '-'; math_dapo compares strings",
    "neg-parenthesised": "math-verify reads (-7) as -7; math_dapo keeps the parentheses",
    "neg-double": "math-verify evaluates -(-7) to 7; math_dapo compares strings",
    "space-left-right": "normalize_answer drops \\left and \\right; math_dapo keeps them",
    "space-quad": "math-verify ignores the trailing \\quad; math_dapo keeps it",
    "space-a-quirk": "math_dapo deletes every 'a ' (meant for 'a 5' style answers), turning the label 'a + b' "
    "into '+b'; normalize_answer only drops spaces, so 'a+b' == 'a + b'",
    "space-dfrac-spaced": "normalize_answer maps \\dfrac to \\frac and drops spaces; math_dapo keeps \\dfrac",
    "set-reordered": "math-verify compares sets as sets; math_dapo compares the strings",
    "set-list-reordered": "math-verify reads '1, 2' and '2, 1' as the same set {1, 2}; math_dapo drops the "
    "commas of digit strings and compares 12 with 21",
    "sym-expanded": "math-verify simplifies (x+1)^2 - (x^2+2x+1) to 0; math_dapo compares strings",
    "sym-like-terms": "math-verify: 2x == x+x; math_dapo compares strings",
    "sym-pi-over-2": "math-verify: \\pi/2 == \\frac{\\pi}{2}; math_dapo compares strings",
    "sym-sqrt2-over-2": "math-verify: \\frac{\\sqrt{2}}{2} == \\frac{1}{\\sqrt{2}}; math_dapo compares strings",
    "sym-sqrt18": "math-verify: 3\\sqrt{2} == \\sqrt{18}; math_dapo compares strings",
    "sym-difference-squares": "math-verify: x^2-1 == (x-1)(x+1); math_dapo compares strings",
    "sym-power-small": "math-verify evaluates 2^{10} to 1024 (small enough for the power-tower guard); "
    "math_dapo compares strings",
    "sym-factorial-small": "math-verify evaluates 10! to 3628800 (small enough for the guard); math_dapo "
    "compares strings",
    "sym-letter-choice-paren": "math-verify reads (B) as the symbol b, as it reads the label B; math_dapo keeps "
    "the parentheses",
    "none-answer-bold": "both take '** 42' from '**Answer:** 42'; math-verify skips the markdown stars and "
    "reads 42, math_dapo compares '**42' with '42'",
    # The other tower-* cases agree: a tower whose value needs more than 10,000 digits is refused
    # before sympy (wrong, -1) unless normalize_answer makes it the label's string, and math_dapo
    # then compares the same strings (tower-9-vs-value-exponent is the same number, -1 on both).
    "tower-small-evaluable": "2^{2^{2^{2}}} = 65536 has 5 digits, far under the power-tower guard's limit, so "
    "math-verify evaluates it; math_dapo compares strings",
}

# `check_instruction` re-implements lm-evaluation-harness's IFEval checks instruction by
# instruction; keys are "case id/index of the instruction in the row". The reference passes
# keywords to `re` as patterns (unescaped), so "C++" is "one or more c" (a possessive quantifier
# since Python 3.11) and the dots of "U.S." match any character; we match keywords as the
# literal text the row wrote, by design.
IFEVAL_DIFFERENCES: dict[str, str] = {
    "existence-cpp-regex/0": "the reference's re.search('C++', ..., IGNORECASE) finds the c of 'code'; we need the "
    "literal text C++",
    "existence-us-regex/0": "the reference's pattern 'U.S.' matches 'upse' in 'upset' (a dot is any character); "
    "we need the literal text U.S.",
    "frequency-cpp-regex/0": "the reference's re.findall('C++', ..., IGNORECASE) counts every run of c (Cool, code, "
    "C++: 3); we count the literal C++ once",
    "forbidden-c-regex/0": "the reference's pattern \\bC++\\b matches the lone word C; we forbid only the literal "
    "word C++",
    "forbidden-ussr-regex/0": "the reference's pattern \\bU.S.\\b matches 'USSR' (dots match the S and the R); we "
    "forbid only the literal U.S.",
    "capword-tis/0": "nltk's version decides: since nltk 3.10, word_tokenize cuts the apostrophe off \"'TIS\" "
    "(\"'\", 'TIS': 3 capital words, the recorded verdict); nltk 3.9.1, the reference's minimum, keeps \"'TIS\" "
    "for its 'tis/'twas rule (\"'T\", 'IS': 4 capital words), which is what we count",
}


def _read_cases(name: str) -> list[dict[str, Any]]:
    lines = (DATA / name).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _recorded(name: str, cases: list[dict[str, Any]]) -> dict[str, Any]:
    """The recorded verdicts, after checking they cover exactly the cases."""
    verdicts = json.loads((DATA / name).read_text(encoding="utf-8"))["verdicts"]
    ids = [case["id"] for case in cases]
    missing = [i for i in ids if i not in verdicts]
    stale = sorted(set(verdicts) - set(ids))
    if missing or stale:
        pytest.fail(
            f"{name} does not match the cases: no verdict for {missing}, verdicts for removed cases {stale}; "
            f"re-record with {RECORD}"
        )
    return verdicts


def _difference_report(differing: dict[str, str], listed: dict[str, str]) -> str:
    """One line per unlisted difference and per listed one that went away; empty when they match."""
    new = [f"  {key}: {why} -- not listed; fix it or list it with its reason"
           for key, why in sorted(differing.items()) if key not in listed]
    gone = [f"  {key}: agrees with the reference now -- remove it from the list"
            for key in sorted(listed.keys() - differing.keys())]
    return "\n".join(new + gone)


def test_case_tables_cover_what_they_should() -> None:
    math_cases, ifeval_cases = _read_cases("math_dapo_cases.jsonl"), _read_cases("ifeval_cases.jsonl")
    assert len(math_cases) >= 100 and len(ifeval_cases) >= 120
    for cases in (math_cases, ifeval_cases):
        ids = [case["id"] for case in cases]
        assert len(ids) == len(set(ids)), "case ids must be unique"
        assert all(case.get("note") for case in cases), "every case says what it probes"
    used = {i for case in ifeval_cases for i in case["instruction_id_list"]}
    assert used == set(INSTRUCTION_IDS)
    reference = _recorded("ifeval_reference.json", ifeval_cases)
    for instruction in INSTRUCTION_IDS:
        seen = [
            verdict
            for case in ifeval_cases
            for i, verdict in zip(case["instruction_id_list"], reference[case["id"]])
            if i == instruction
        ]
        assert len(seen) >= 3 and any(seen) and not all(seen), f"{instruction}: {seen}"


def _math_sample(case: dict[str, Any]) -> Sample:
    return Sample([1], [2], [-1.0], 0, group_id=0, prompt_index=0, label=case["label"], response_text=case["response"])


def test_dapo_differs_from_verl_math_dapo_only_where_listed(capsys: pytest.CaptureFixture[str]) -> None:
    cases = _read_cases("math_dapo_cases.jsonl")
    reference = _recorded("math_dapo_reference.json", cases)
    differing = {}
    for case in cases:
        recorded = reference[case["id"]]
        ours = dapo_reward(_math_sample(case))["score"]
        if ours != recorded["score"]:
            differing[case["id"]] = f"math_dapo {recorded['score']:+.0f} (pred {recorded['pred']!r}), dapo {ours:+.0f}"
    with capsys.disabled():
        agreeing = len(cases) - len(differing)
        print(f"\ndapo vs veRL math_dapo: same score on {agreeing}/{len(cases)} = {agreeing / len(cases):.1%}")
    report = _difference_report(differing, MATH_DIFFERENCES)
    assert not report, f"dapo vs veRL math_dapo ({len(cases)} cases):\n{report}"


def _ifeval_comparison() -> tuple[dict[str, str], int, int, int, int]:
    """Differing instructions ("case/index" -> both verdicts) and the agreement counts."""
    cases = _read_cases("ifeval_cases.jsonl")
    reference = _recorded("ifeval_reference.json", cases)
    differing: dict[str, str] = {}
    prompts_agreeing = 0
    for case in cases:
        theirs = reference[case["id"]]
        if len(theirs) != len(case["instruction_id_list"]):
            pytest.fail(f"ifeval_reference.json: {case['id']} has {len(theirs)} verdicts for "
                        f"{len(case['instruction_id_list'])} instructions; re-record with {RECORD}")
        ours = [
            check_instruction(instruction, case["response"], kwargs)
            for instruction, kwargs in zip(case["instruction_id_list"], case["kwargs"])
        ]
        for index, (mine, recorded) in enumerate(zip(ours, theirs)):
            if mine != recorded:
                differing[f"{case['id']}/{index}"] = f"IFEval {recorded}, ifbench {mine}"
        prompts_agreeing += all(ours) == all(theirs)
    instructions = sum(len(case["instruction_id_list"]) for case in cases)
    return differing, instructions - len(differing), instructions, prompts_agreeing, len(cases)


def test_ifbench_differs_from_ifeval_only_where_listed(capsys: pytest.CaptureFixture[str]) -> None:
    differing, agreeing, instructions, prompts_agreeing, prompts = _ifeval_comparison()
    with capsys.disabled():
        print(
            f"\nifbench vs IFEval (strict): instructions {agreeing}/{instructions} = {agreeing / instructions:.1%}, "
            f"prompts {prompts_agreeing}/{prompts} = {prompts_agreeing / prompts:.1%}"
        )
    report = _difference_report(differing, IFEVAL_DIFFERENCES)
    assert not report, f"ifbench vs lm-evaluation-harness IFEval:\n{report}"
    assert agreeing / instructions >= MIN_AGREEMENT
    assert prompts_agreeing / prompts >= MIN_AGREEMENT
