"""GSM8K exact match, MATH equivalence, confidence intervals and the byte tokenizer, on known inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moectl.eval.gsm8k import exact_match, extract_flexible, extract_strict, reference_answer
from moectl.eval.intervals import mean_interval, perplexity_interval, wilson_interval
from moectl.eval.math_equiv import extract_math_answer, is_equiv, last_boxed, normalize_math_answer


def test_gsm8k_reference_and_extraction():
    assert reference_answer("Janet sells 9 eggs.\n#### 1,018") == "1018"
    assert extract_strict("So 9 * 2 = 18. The answer is 18.\n\nQ: next") == "18"
    assert extract_strict("he pays #### 42") == "42"
    assert extract_strict("I think 18") is None
    assert extract_flexible("First 3 + 4 = 7, then $1,200.") == "$1,200."
    assert exact_match("It costs 2 * 9 = $18. The answer is 18.", "...\n#### 18") == {
        "strict": True,
        "flexible": True,
    }
    # strict needs the sentence; flexible takes the last number
    assert exact_match("2 * 9 = 18", "#### 18") == {"strict": False, "flexible": True}
    assert exact_match("The answer is 1,018. Then 5 more", "#### 1018") == {"strict": True, "flexible": False}
    assert exact_match("The answer is -3.", "#### -3")["strict"]
    assert not exact_match("The answer is 18.5.", "#### 18")["strict"]
    with pytest.raises(ValueError, match="no '####'"):
        reference_answer("18")


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("\\frac12", "\\dfrac{1}{2}"),
        ("0.5", "\\frac{1}{2}"),
        ("\\tfrac{3}{4}", "0.75"),
        ("x = 5", "5"),
        ("5 \\text{ cm}", "5"),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
        ("90^\\circ", "90"),
        ("\\$18.", "18"),
        ("50\\%", "50"),
        ("\\boxed{7}", "7"),
        ("1,000", "1000"),
        ("\\sqrt3", "\\sqrt{3}"),
        ("3/4", "\\frac{3}{4}"),
        (".5", "0.5"),
        ("\\text{(A)}", "(A)"),
        ("\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}"),
        ("$x \\geq 2$", "x\\ge2"),
    ],
)
def test_math_equivalent(a, b):
    assert is_equiv(a, b), (normalize_math_answer(a), normalize_math_answer(b))


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("2", "3"),
        ("\\frac{1}{2}", "\\frac{1}{3}"),
        ("x^2+1", "x^2+2"),
        ("(1,2)", "[1,2]"),
        ("\\sqrt{2}", "2"),
    ],
)
def test_math_not_equivalent(a, b):
    assert not is_equiv(a, b)


def test_math_answer_extraction():
    assert last_boxed("so $\\boxed{\\frac{1}{2}}$, then \\boxed{\\left(3, \\frac{\\pi}{2}\\right)}.") == (
        "\\left(3, \\frac{\\pi}{2}\\right)"
    )
    assert last_boxed("no box") is None
    assert last_boxed("\\boxed{\\frac{1}{2}") is None  # unbalanced
    assert extract_math_answer("Final Answer: The final answer is $5$. I hope it is correct.") == "$5$"
    assert is_equiv(extract_math_answer("... so the answer is 12."), "12")
    assert extract_math_answer("nothing here") is None
    assert not is_equiv(None, "1")


def test_wilson_known_values():
    lo, hi = wilson_interval(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    lo, hi = wilson_interval(0, 10)  # does not collapse at 0, unlike the normal interval
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = wilson_interval(81, 263)
    assert lo == pytest.approx(0.2553, abs=1e-4) and hi == pytest.approx(0.3662, abs=1e-4)
    assert wilson_interval(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    with pytest.raises(ValueError, match=r"successes must be in 0\.\.n=10"):
        wilson_interval(11, 10)
    with pytest.raises(ValueError, match="n >= 1"):
        wilson_interval(0, 0)


def test_bootstrap_is_seeded_and_sensible():
    rng = np.random.default_rng(0)
    tokens = rng.integers(50, 150, size=200)
    nll = tokens * rng.uniform(2.0, 3.0, size=200)
    point = math.exp(nll.sum() / tokens.sum())
    a = perplexity_interval(nll, tokens, seed=7)
    assert a == perplexity_interval(nll, tokens, seed=7)
    assert a != perplexity_interval(nll, tokens, seed=8)
    assert a[0] < point < a[1] and a[1] / a[0] < 1.2
    # identical documents: no sampling variation
    lo, hi = perplexity_interval(np.full(20, 30.0), np.full(20, 10), seed=0)
    assert lo == pytest.approx(math.exp(3.0)) and hi == pytest.approx(math.exp(3.0))
    lo, hi = mean_interval([0.0, 1.0] * 50, seed=0)
    assert 0.38 < lo < 0.5 < hi < 0.62


def test_byte_tokenizer_matches_tiny_models():
    from moectl.eval.eval_tokenizer import byte_tokenizer
    from moectl.models.load import ByteTokenizer

    fast, ref = byte_tokenizer(), ByteTokenizer()
    for text in ["Question: 2+2?\nAnswer:", " héllo ☃ 日本", "a  b\t\r\n"]:
        ids = fast.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text) and fast.decode(ids) == text
    assert (fast.pad_token_id, fast.bos_token_id, fast.eos_token_id, len(fast)) == (0, 1, 2, 259)
