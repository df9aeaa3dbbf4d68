"""``generate_texts`` (lm-eval's ``generate_until``) runs on the engine and decodes what eval's own loop did.

``RECORDED`` holds the greedy texts of the decode loop ``eval_generation`` ran before it moved onto
``moectl.engine`` (commit 505db38, over the same tiny model, contexts and plans):
no routing, an expert mask, request-keyed Gumbel noise (alone and as ``repeats = 3`` copies
averaged), a document pool with Gumbel noise, RoE and a sampling controller (a policy drawing from a
stream, run with the seed ``reseed`` gives it). No routing and the mask are also checked against
``model.generate`` (engine-free); a request's text does not depend on its batch-mates.
"""

from __future__ import annotations

import pytest
import torch

import moectl
from moectl import ExpertMask
from moectl.ensemble.roe_config import RoEConfig
from moectl.eval.eval_generation import GenSettings, generate_texts
from moectl.eval.eval_tokenizer import byte_tokenizer
from moectl.eval.forward import BatchRouting, SwitchStats, static_plan
from moectl.eval.request_noise import keyed_policies
from moectl.models.tokens import encode
from moectl.routing import route
from moectl.routing.gumbel import GumbelTopK
from moectl.routing.pool import DocumentPool

CONTEXTS = ["Q: Tom has 2 apples.\nA:", "Q: hi\nA:", "The cat", "Q: Tom has 2 apples.\nA: He", "x", ""]
SETTINGS = {"plain": GenSettings(("\n\n",), 8), "stop": GenSettings(("t", "\x19"), 12)}
RECORDED = {
    ("none", "plain"): [
        "Q\ufffd\ufffd\u063e\x19\ufffd\x1b",
        "))\ufffd))t\u07ed",
        "\ufffd!\ufffd!\x19[\ufffd\ufffd",
        "\u07d6G\x19)t\x19)",
        "\ufffd&\ufffd&\ufffd\ufffd\u0148",
        "\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd",
    ],
    ("none", "stop"): [
        "Q\ufffd\ufffd\u063e",
        "))\ufffd))",
        "\ufffd!\ufffd!",
        "\u07d6G",
        "\ufffd&\ufffd&\ufffd\ufffd\u0148?\ufffdD\ufffd",
        "\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd",
    ],
    ("mask", "plain"): [
        "Q\ufffd\ufffd\u063e\x19\ufffd\x1b",
        ")\ufffd)))t\u07ed",
        "\ufffd!\ufffd!\x19[\ufffd\ufffd",
        "\u07d6G\x19)t\x19)",
        "\ufffd&\ufffd}\ufffdJ\x1a\ufffd",
        "\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd",
    ],
    ("mask", "stop"): [
        "Q\ufffd\ufffd\u063e",
        ")\ufffd)))",
        "\ufffd!\ufffd!",
        "\u07d6G",
        "\ufffd&\ufffd}\ufffdJ\x1a\ufffdE\ufffd&\ufffd",
        "\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd",
    ],
    ("gumbel", "plain"): [
        "Q\ufffd\ufffd\u063e\x19\ufffd\x1b",
        "))))Q\x19)t",
        "\ufffd!\ufffd!\x19[\ufffd\ufffd",
        "\u07d6G\x19)t\x19)",
        "\ufffd&\ufffd\ufffdi\ufffd\ufffd\ufffd",
        "\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd",
    ],
    ("gumbel", "stop"): [
        "Q\ufffd\ufffd\u063e",
        "))))Q",
        "\ufffd!\ufffd!",
        "\u07d6G",
        "\ufffd&\ufffd\ufffdi\ufffd\ufffd\ufffdi\ufffd\ufffd\ufffd",
        "\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd",
    ],
    ("gumbel_k3", "plain"): [
        "Q\ufffd\ufffd\u063e\x19\ufffd\x1b",
        "))\ufffd))t\u07ed",
        "\ufffd!\ufffd!\x19[\ufffd\ufffd",
        "\u07d6G\x19)t\x19)",
        "\ufffd&\ufffd\ufffdi\ufffd\ufffd\ufffd",
        "\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd",
    ],
    ("gumbel_k3", "stop"): [
        "Q\ufffd\ufffd\u063e",
        "))\ufffd))",
        "\ufffd!\ufffd!",
        "\u07d6G",
        "\ufffd&\ufffd\ufffdi\ufffd\ufffd\ufffdi\ufffd\ufffd\ufffd",
        "\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd",
    ],
    ("pool_gumbel", "plain"): [
        "\ufffd\ufffd\u063e\x19\ufffd\x1b\x19",
        "))\ufffd))t\u07ed",
        "\ufffd!\ufffd!\x19[\ufffd\ufffd",
        "\x1b\x19)t\ufffdV)t",
        "\ufffd&\ufffd\ufffdi\ufffdi\ufffd",
        "\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd",
    ],
    ("pool_gumbel", "stop"): [
        "\ufffd\ufffd\u063e",
        "))\ufffd))",
        "\ufffd!\ufffd!",
        "\x1b",
        "\ufffd&\ufffd\ufffdi\ufffdi\ufffd\ufffd\ufffdi\ufffd",
        "\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd",
    ],
    ("roe", "plain"): [
        "Q\ufffd\ufffd\u063e\x19\ufffd\x1b",
        "))))Q\x19)t",
        "\ufffd!\ufffd!\x19[\ufffd\ufffd",
        "\u07d6G\x19)t\x19)",
        "\ufffd&\ufffd}\ufffdJ\x1a\ufffd",
        "\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd",
    ],
    ("roe", "stop"): [
        "Q\ufffd\ufffd\u063e",
        "))))Q",
        "\ufffd!\ufffd!",
        "\u07d6G",
        "\ufffd&\ufffd}\ufffdJ\x1a\ufffdE\ufffd&\ufffd",
        "\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd",
    ],
    ("controller", "plain"): [
        "Q\ufffd\ufffd\u063e\x19\ufffdX",
        "))))Q\x19)t",
        "\ufffd!\ufffd!\x19[\ufffd\ufffd",
        "\u07d6G\x19)t\x19)",
        "\ufffd&\ufffd&\ufffd\ufffd\u0148",
        "\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd",
    ],
    ("controller", "stop"): [
        "Q\ufffd\ufffd\u063e",
        "))))Q",
        "\ufffd!\ufffd!",
        "\u07d6G",
        "\ufffd&\ufffd&\ufffd\ufffd\u0148?\ufffdD\ufffd",
        "\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd",
    ],
}


@pytest.fixture(scope="module")
def env():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = moectl.tiny("olmoe", vocab_size=259)
    model.set_experts_implementation("eager")
    yield model, moectl.inspect(model)
    torch.set_num_threads(threads)


def _plans(info) -> dict:
    from moectl.options import ControllerPolicy, build_controller

    gumbel3 = BatchRouting(keyed_policies([GumbelTopK(3.0, seed=3)]), repeats=3)
    torch.manual_seed(0)
    controller = ControllerPolicy(build_controller(info, k_hat=4))  # mode "sample": draws per token
    return {
        "none": static_plan([]),
        "mask": static_plan([ExpertMask.everywhere(info, [0, 1, 2, 3])]),
        "gumbel": static_plan([GumbelTopK(1.0, seed=3)]),
        "gumbel_k3": lambda batch: gumbel3,
        "pool_gumbel": static_plan([DocumentPool(4), GumbelTopK(0.5, seed=1)]),
        "roe": static_plan(roe=RoEConfig(K=3, tau=1.0, seed=5)),
        "controller": static_plan([controller]),
    }


@pytest.fixture(scope="module")
def plans(env):
    return _plans(env[1])


@pytest.mark.parametrize("name", ["none", "mask", "gumbel", "gumbel_k3", "pool_gumbel", "roe", "controller"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_texts_are_the_old_loops(env, plans, name, setting):
    model, info = env
    texts = generate_texts(
        model, byte_tokenizer(), CONTEXTS, SETTINGS[setting], plans[name], info, batch_size=4
    )
    assert texts == RECORDED[(name, setting)]


def test_recorded_routings_differ():
    """The recorded texts tell the routings apart (each case checks its own routing)."""
    plain = [
        RECORDED[(n, "plain")] for n in ("none", "mask", "gumbel", "gumbel_k3", "pool_gumbel", "controller")
    ]
    assert len({tuple(t) for t in plain}) == len(plain)


def _generate_reference(model, info, context: str, n: int, policies: list) -> str:
    """Greedy ``model.generate`` of one context (ids without special tokens) under ``policies``."""
    tok = byte_tokenizer()
    ids = torch.tensor([encode(tok, context)])
    with route(model, policies, info=info):
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        )  # fmt: skip
    new = [t for t in out[0, ids.shape[1] :].tolist() if t != tok.eos_token_id]
    return tok.decode(new, skip_special_tokens=True)


@pytest.mark.parametrize("masked", [False, True])
def test_greedy_texts_are_model_generate(env, masked):
    model, info = env
    policies = [ExpertMask.everywhere(info, [0, 1, 2, 3])] if masked else []
    contexts = CONTEXTS[:5]
    texts = generate_texts(
        model, byte_tokenizer(), contexts, GenSettings((), 8), static_plan(policies), info, 3
    )
    assert texts == [_generate_reference(model, info, c, 8, policies) for c in contexts]


@pytest.mark.parametrize("name", ["gumbel", "gumbel_k3", "pool_gumbel", "controller", "roe"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_request_ignores_its_batch_mates(env, plans, name, temperature):
    """Batched with others or alone, a request decodes the same text (greedy and sampled)."""
    model, info = env
    settings = GenSettings(("\n\n",), 6, temperature)
    together = generate_texts(model, byte_tokenizer(), CONTEXTS, settings, plans[name], info, batch_size=6)
    alone = [
        generate_texts(model, byte_tokenizer(), [c], settings, plans[name], info, 1)[0] for c in CONTEXTS
    ]
    assert together == alone


@pytest.mark.parametrize(("name", "copies"), [("gumbel", 1), ("gumbel_k3", 3)])
def test_keyed_noise_requests_share_one_group_of_rows(env, plans, name, copies, monkeypatch):
    """Request-keyed noise keeps nothing per request but its code: the requests of a batch share one
    group of rows (one policy call per layer for all), each row drawing with its own code and
    position, so each still decodes its recorded text (test above)."""
    from moectl.engine.rows import RowRouter

    sizes: list[list[int]] = []
    original = RowRouter.set_groups

    def spy(self, groups, batch, device):
        sizes.append([int(g.rows.numel()) for g in groups])
        return original(self, groups, batch, device)

    monkeypatch.setattr(RowRouter, "set_groups", spy)
    model, info = env
    texts = generate_texts(model, byte_tokenizer(), CONTEXTS[:4], GenSettings((), 4), plans[name], info, 4)
    assert [4 * copies] in sizes  # a decoding step: all four requests' rows in one group
    assert texts == [
        generate_texts(model, byte_tokenizer(), [c], GenSettings((), 4), plans[name], info, 1)[0]
        for c in CONTEXTS[:4]
    ]


def test_sampling_is_seeded_per_evaluation(env, plans):
    model, info = env
    settings = GenSettings((), 8, temperature=1.0)
    runs = [
        generate_texts(model, byte_tokenizer(), CONTEXTS, settings, plans["mask"], info, seed=s)
        for s in (1, 1, 2)
    ]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_switch_rates_come_from_each_requests_trace(env):
    """SwitchStats over generation: one sequence per request (per copy with repeats), each as
    ``route(record=True)`` records the request alone under ``model.generate``."""
    model, info = env
    mask = ExpertMask.everywhere(info, [0, 1, 2, 3, 4, 5])
    contexts = CONTEXTS[:3]
    stats = SwitchStats()
    generate_texts(
        model, byte_tokenizer(), contexts, GenSettings((), 6), static_plan([mask]), info, 2, stats=stats
    )
    reference = SwitchStats()
    tok = byte_tokenizer()
    for context in contexts:
        ids = torch.tensor([encode(tok, context)])
        with route(model, [mask], info=info, record=True) as session:
            model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False
            )
        reference.add(session.trace, "generated")
    got, want = stats.summary(), reference.summary()
    assert got["sequences"] == 3
    assert sorted(got["per_sequence"]) == pytest.approx(sorted(want["per_sequence"]))
    assert got["allowed_mean"] == want["allowed_mean"]
    copies = SwitchStats()
    plan = lambda batch: BatchRouting([mask], repeats=2)  # noqa: E731
    generate_texts(model, byte_tokenizer(), contexts, GenSettings((), 6), plan, info, 2, stats=copies)
    assert copies.summary()["sequences"] == 6
    assert sorted(copies.summary()["per_sequence"]) == pytest.approx(sorted(want["per_sequence"] * 2))


def test_roe_composed_with_a_mask_is_the_old_loops(env):
    """A policy beside RoE (``--policy mask --roe``) reaches the engine's RoE ensemble (recorded)."""
    model, info = env
    plan = static_plan([ExpertMask.everywhere(info, [0, 1, 2, 3])], RoEConfig(K=3, tau=1.0, seed=5))
    contexts = [CONTEXTS[0], CONTEXTS[1], CONTEXTS[2], CONTEXTS[4]]
    texts = generate_texts(model, byte_tokenizer(), contexts, GenSettings((), 8), plan, info, 4)
    assert texts == [
        "\ufffd\ufffd\u063e\x19\ufffd\x1b\x19",
        ")\ufffd)))t\u07ed",
        "\ufffd!\ufffd!\x19[\ufffd\ufffd",
        "\ufffd&\ufffd}\ufffdJ\x1a\ufffd",
    ]
    assert texts[0] != RECORDED[("roe", "plain")][0], "the mask is active under RoE"


class _StreamNoise:
    """A user's policy drawing from a seeded stream, not forkable: copied and reseeded per request."""

    def __init__(self, seed: int) -> None:
        self.seed, self.generator = seed, None

    def draws(self) -> bool:
        return True

    def bind(self, info) -> None:
        self.generator = torch.Generator().manual_seed(self.seed)

    def apply(self, state) -> None:
        state.add_noise(torch.randn(state.logits.shape, generator=self.generator).to(state.logits) * 3.0)


def test_a_stream_drawing_policy_ignores_batch_mates(env):
    model, info = env
    plan = static_plan([_StreamNoise(4)])
    settings = GenSettings((), 6)
    together = generate_texts(model, byte_tokenizer(), CONTEXTS, settings, plan, info, batch_size=6)
    alone = [generate_texts(model, byte_tokenizer(), [c], settings, plan, info, 1)[0] for c in CONTEXTS]
    assert together == alone
    plain = generate_texts(model, byte_tokenizer(), CONTEXTS, settings, static_plan([]), info, batch_size=6)
    assert together != plain, "the noise is active"


def test_any_number_of_stop_strings(env):
    """More stop strings than the engine stops on (16): the text is still cut at the first of any."""
    model, info = env
    until = (*(f"zz{i}" for i in range(20)), "t", "\x19")
    texts = generate_texts(
        model, byte_tokenizer(), CONTEXTS, GenSettings(until, 12), static_plan([]), info, 4
    )
    assert texts == RECORDED[("none", "stop")]
