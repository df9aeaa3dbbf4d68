"""MMLU's 57 subjects grouped into EMO's 17 categories (EMO Table 4).

EMO selects expert subsets per *category*: every subject of a category is served by one group of
experts, and aggregate MMLU numbers exclude ``other`` (EMO §C, Appendix B.3). The 17 categories
are the subcategories of the MMLU release (hendrycks/test ``categories.py``); the grouping below
was checked against EMO Table 4: for every category, the converted test + validation rows equal
the table's *Train+Val* + *Test* (e.g. biology 320 + 182 = 454 test + 48 validation rows).
"""

from __future__ import annotations

from moectl.errors import ConfigError

# subject -> EMO category (lower case, spaces as underscores so they can name tasks)
MMLU_CATEGORY: dict[str, str] = {
    "abstract_algebra": "math",
    "anatomy": "health",
    "astronomy": "physics",
    "business_ethics": "business",
    "clinical_knowledge": "health",
    "college_biology": "biology",
    "college_chemistry": "chemistry",
    "college_computer_science": "computer_science",
    "college_mathematics": "math",
    "college_medicine": "health",
    "college_physics": "physics",
    "computer_security": "computer_science",
    "conceptual_physics": "physics",
    "econometrics": "economics",
    "electrical_engineering": "engineering",
    "elementary_mathematics": "math",
    "formal_logic": "philosophy",
    "global_facts": "other",
    "high_school_biology": "biology",
    "high_school_chemistry": "chemistry",
    "high_school_computer_science": "computer_science",
    "high_school_european_history": "history",
    "high_school_geography": "geography",
    "high_school_government_and_politics": "politics",
    "high_school_macroeconomics": "economics",
    "high_school_mathematics": "math",
    "high_school_microeconomics": "economics",
    "high_school_physics": "physics",
    "high_school_psychology": "psychology",
    "high_school_statistics": "math",
    "high_school_us_history": "history",
    "high_school_world_history": "history",
    "human_aging": "health",
    "human_sexuality": "culture",
    "international_law": "law",
    "jurisprudence": "law",
    "logical_fallacies": "philosophy",
    "machine_learning": "computer_science",
    "management": "business",
    "marketing": "business",
    "medical_genetics": "health",
    "miscellaneous": "other",
    "moral_disputes": "philosophy",
    "moral_scenarios": "philosophy",
    "nutrition": "health",
    "philosophy": "philosophy",
    "prehistory": "history",
    "professional_accounting": "other",
    "professional_law": "law",
    "professional_medicine": "health",
    "professional_psychology": "psychology",
    "public_relations": "politics",
    "security_studies": "politics",
    "sociology": "culture",
    "us_foreign_policy": "politics",
    "virology": "health",
    "world_religions": "philosophy",
}

MMLU_CATEGORIES: tuple[str, ...] = tuple(sorted(set(MMLU_CATEGORY.values())))

# EMO Table 4, MMLU block: category -> (Train+Val, Test); they split MMLU test + validation.
EMO_TABLE4_MMLU: dict[str, tuple[int, int]] = {
    "biology": (320, 182),
    "business": (308, 176),
    "chemistry": (211, 122),
    "computer_science": (289, 165),
    "culture": (232, 134),
    "economics": (525, 298),
    "engineering": (103, 58),
    "geography": (140, 80),
    "health": (1162, 659),
    "history": (658, 373),
    "law": (1250, 707),
    "math": (752, 427),
    "other": (825, 467),
    "philosophy": (1427, 808),
    "physics": (453, 257),
    "politics": (459, 260),
    "psychology": (823, 463),
}

# EMO reports aggregate MMLU without the catch-all category (Appendix B.3).
EMO_AGGREGATE_EXCLUDES: tuple[str, ...] = ("other",)


def category_of(subject: str) -> str:
    """The EMO category of an MMLU subject (``ValueError`` naming the valid subjects otherwise)."""
    try:
        return MMLU_CATEGORY[subject]
    except KeyError:
        raise ConfigError(
            f"unknown MMLU subject {subject!r}; valid subjects: {', '.join(sorted(MMLU_CATEGORY))}"
        ) from None


def subjects_of(category: str) -> list[str]:
    """The MMLU subjects of an EMO category."""
    if category not in MMLU_CATEGORIES:
        raise ConfigError(f"unknown MMLU category {category!r}; valid: {', '.join(MMLU_CATEGORIES)}")
    return sorted(s for s, c in MMLU_CATEGORY.items() if c == category)
